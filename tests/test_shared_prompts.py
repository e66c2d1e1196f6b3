"""Shared prompts in the trainer's packs (`monorl.train.packing`): a prompt group's prompt is packed once, the
model's per-token work runs on it once, and attention sees every sequence whole. The log-probs and gradients are
those of the unshared pack (bit for bit in batch-invariant mode), static packs keep one shape per bucket, and the
trainer's step is the unshared step."""

from __future__ import annotations

import random

import pytest
import torch

from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.logprobs import token_logprobs
from monorl.train.packing import TrainSequence, make_micro_batches, plan_micro_batches
from monorl.train.trainer import Trainer, TrainerConfig


def _groups(sizes: list[int], prompt_lens: list[int], seed: int = 0, singles: int = 1) -> list[TrainSequence]:
    """Prompt groups (each `size` sequences of one random prompt, completions of random lengths) in a shuffled
    order, plus `singles` sequences of their own prompt."""
    rng = random.Random(seed)
    seqs = []
    for size, p in zip(sizes, prompt_lens, strict=True):
        prompt = [rng.randrange(3, 100) for _ in range(p)]
        for _ in range(size):
            c = rng.randrange(1, 12)
            seqs.append(TrainSequence(prompt, [rng.randrange(3, 100) for _ in range(c)],
                                      [rng.uniform(-3, 0) for _ in range(c)], rng.uniform(-1, 1)))
    for _ in range(singles):
        seqs.append(TrainSequence([rng.randrange(3, 100) for _ in range(5)], [7, 8, 9], [-1.0] * 3, 0.5))
    rng.shuffle(seqs)
    return seqs


def _logprobs(model: torch.nn.Module, mb) -> torch.Tensor:
    hidden = model(mb.input_ids, mb.ctx.positions, mb.ctx)
    return token_logprobs(model.compute_logits(hidden[mb.logit_index]), mb.targets)[: mb.num_targets]


def test_a_shared_pack_holds_each_prompt_once():
    seqs = _groups([3, 2], [6, 4])
    (shared,) = make_micro_batches(seqs, 512, "cpu")
    (whole,) = make_micro_batches(seqs, 512, "cpu", share_prompts=False)
    completions = sum(len(s.completion_ids) for s in seqs)
    real = sum(len(s) for s in seqs)  # the tokens trained on, as TRL counts them: whole sequences either way
    assert shared.num_real_tokens == whole.num_real_tokens == real and whole.ctx.shared is None
    sh = shared.ctx.shared
    # the two prompts once but their last tokens (one a sequence: 3 + 2), the single whole
    assert sh.expand_index[:real].unique().numel() == 5 + 3 + 5 + 5 + completions
    # every target row is read once: its gradient is no sum of several, whose order nothing would fix
    n = shared.num_targets
    assert shared.logit_index[:n].unique().numel() == n
    # the attention's layout is the unshared pack's: the same lengths, and each row a copy of the same token
    assert torch.equal(shared.ctx.cu_seqlens[:len(seqs) + 1], whole.ctx.cu_seqlens[:len(seqs) + 1])
    assert torch.equal(shared.input_ids[sh.expand_index[:real]], whole.input_ids[:real])
    assert torch.equal(shared.ctx.positions[sh.expand_index[:real]], whole.ctx.positions[:real])
    assert sh.copies.shape[1] == 3  # a prompt token of the group of three; a completion token has one copy
    # targets in the same order, each predicted by a copy of the same row
    assert torch.equal(shared.targets, whole.targets) and torch.equal(shared.seq_ids, whole.seq_ids)
    assert torch.equal(shared.input_ids[shared.logit_index], whole.input_ids[whole.logit_index])


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("invariant", [False, True])
def test_shared_logprobs_and_gradients_equal_the_unshared(invariant, hybrid):
    """Dynamic and static packs; batch-invariant: log-probs bit for bit (every op is row-local or sees the same
    keys in the same order); default: to fp32 rounding. Gradients of a weighted sum to fp32 rounding. Hybrid: a
    Qwen3.5 tiny model, whose Gated DeltaNet layers see each sequence whole too."""
    from tests.test_recurrent_state import HYBRID

    torch.manual_seed(0)
    model = build_model(HYBRID, seed=None).init_weights(1) if hybrid else build_model(model_shape("tiny"), seed=1)
    if invariant:
        make_batch_invariant_(model)
    seqs = _groups([4, 3], [9, 5], seed=1)
    for static in (False, True):
        out = {}
        for share in (True, False):
            (mb,) = make_micro_batches(seqs, 512, "cpu", static=static, share_prompts=share)
            model.zero_grad()
            lp = _logprobs(model, mb)
            (lp * torch.linspace(0.5, 1.5, lp.numel())).sum().backward()
            out[share] = lp.detach(), [p.grad.clone() for p in model.parameters()]
        if invariant:
            assert torch.equal(out[True][0], out[False][0])
        else:
            torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=1e-5)
        for a, b in zip(out[True][1], out[False][1], strict=True):  # to 1e-5 of the largest (sums reordered)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def test_static_shared_packs_of_a_bucket_share_one_shape():
    """Two steps of the same group structure and other lengths: one `PackShape` (one CUDA graph)."""
    shapes = []
    for seed in (0, 1):
        (mb,) = make_micro_batches(_groups([8, 8], [16, 16], seed=seed, singles=0), 4096, "cpu", static=True)
        shapes.append(mb.shape)
        assert mb.shape.copies == 8 and mb.shape.full_tokens > mb.shape.tokens
        assert mb.ctx.shared.expand_index.numel() == mb.shape.full_tokens
    assert shapes[0] == shapes[1]


def test_groups_are_kept_apart_by_their_index():
    """Two groups of one prompt in a step (a small task draws a prompt twice) stay two groups of the step's size,
    so a pack's shape does not depend on the draw; without indices equal prompts are one group."""
    seqs = [TrainSequence([5, 6, 7, 8, 9, 10], [11 + j] * (1 + j % 3), [-1.0] * (1 + j % 3), 0.5) for j in range(8)]
    (merged,) = make_micro_batches(seqs, 512, "cpu")
    assert merged.shape.copies == 8
    for j, s in enumerate(seqs):
        s.group = j // 4
    (apart,) = make_micro_batches(seqs, 512, "cpu")
    def unique(mb) -> int:
        return mb.ctx.shared.expand_index[:mb.num_real_tokens].unique().numel()

    assert apart.shape.copies == 4 and unique(apart) == unique(merged) + 5  # the second prompt, its last token apart


def test_a_group_is_planned_into_one_micro_batch():
    lengths = [30, 30, 30, 20, 20, 25]
    groups = ["a", "b", "a", "b", "a", "c"]
    plan = plan_micro_batches(lengths, 100, groups)
    for g in "abc":
        assert sum(any(groups[i] == g for i in b) for b in plan) == 1
    assert sorted(i for b in plan for i in b) == list(range(6))
    # a group larger than the budget is cut into runs that fit
    plan = plan_micro_batches([40] * 5, 100, ["a"] * 5)
    assert sorted(len(b) for b in plan) == [1, 2, 2] and all(sum(40 for _ in b) <= 100 for b in plan)


def test_the_trainer_step_with_shared_prompts_is_the_unshared_step():
    seqs = _groups([4, 4], [10, 7], seed=2)
    out = {}
    for share in (True, False):
        model = build_model(model_shape("tiny"), seed=3)
        tr = Trainer(model, TrainerConfig(lr=1e-3, share_prompts=share, micro_batch_tokens=64), total_steps=2)
        m = tr.step(seqs)
        out[share] = m, [p.detach().clone() for p in model.parameters()]
    for k in ("loss", "grad_norm", "logprob_diff_mean", "entropy"):
        assert out[True][0][k] == pytest.approx(out[False][0][k], rel=1e-4, abs=1e-7), k
    for a, b in zip(out[True][1], out[False][1], strict=True):  # 1% of the lr: AdamW's first step is ~lr * sign(g)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_copy_sum_kernel_matches_the_gather(dtype):
    """`sum_row_copies`' Triton kernel (one program a row, the copies that exist read in order) against its CPU
    path: fp32 bit for bit, bf16 to one rounding of the sum; rows with no copy are zero."""
    from monorl.ops.row_copies import sum_row_copies

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, 8, 128, generator=g).to(dtype)
    copies = torch.randint(0, 3600, (2000, 8), generator=g)  # ~1 in 6 past the end: no copy
    copies[5] = 3000
    got = sum_row_copies(x.cuda(), copies.cuda()).cpu()
    want = sum_row_copies(x, copies)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-2)
    assert not got[5].any()
