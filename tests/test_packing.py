import pytest
import torch

from monorl.model.config import model_shape
from monorl.model.logprobs import token_logprobs
from monorl.model.qwen3 import build_model
from monorl.train.packing import (
    PackShape,
    TrainSequence,
    bucket_size,
    make_micro_batches,
    plan_micro_batches,
    token_buckets,
    token_share,
)


def _seq(p: int, c: int, start: int = 3) -> TrainSequence:
    return TrainSequence(list(range(start, start + p)), list(range(start + p, start + p + c)), [0.0] * c, 0.5)


def test_buckets_and_plan():
    assert token_buckets(1000)[:3] == (64, 128, 192) and token_buckets(1000)[-3:] == (896, 960, 1000)
    assert [bucket_size(n) for n in (1, 16, 17, 200, 8192, 8193, 8400)] == [16, 16, 32, 208, 8192, 9216, 9216]
    for n in range(1, 20000, 37):  # padding stays within 12.5% above 8 x the smallest bucket
        b = bucket_size(n)
        assert n <= b and (b <= 128 or b <= n * 1.125)
    plan = plan_micro_batches([60, 50, 40, 30, 20], max_tokens=100)
    assert sorted(i for b in plan for i in b) == [0, 1, 2, 3, 4]
    for b in plan:
        assert sum([60, 50, 40, 30, 20][i] for i in b) <= 100
    with pytest.raises(ValueError, match="sequence 1 has 120 tokens"):
        plan_micro_batches([10, 120], max_tokens=100)


def test_pack_layout_is_bucketed_and_unpadded():
    seqs = [_seq(5, 3), _seq(7, 4), _seq(2, 6)]
    (mb,) = make_micro_batches(seqs, max_tokens=64, device="cpu", buckets=(16, 32, 64))
    assert mb.input_ids.numel() == 32 and mb.num_real_tokens == 27
    assert mb.ctx.cu_seqlens.tolist() == [0, 8, 19, 27, 32]  # last segment is the filler
    assert mb.targets.numel() == 13
    # every target is the token right after its logit row
    assert torch.equal(mb.input_ids[mb.logit_index + 1], mb.targets)
    assert mb.seq_ids.tolist() == [0] * 3 + [1] * 4 + [2] * 6


def test_packed_logprobs_equal_per_sequence():
    torch.manual_seed(0)
    model = build_model(model_shape("tiny"), seed=1).eval()
    seqs = [TrainSequence(torch.randint(3, 100, (p,)).tolist(), torch.randint(3, 100, (c,)).tolist(), [0.0] * c, 1.0)
            for p, c in [(5, 3), (9, 7), (3, 1)]]
    mbs = make_micro_batches(seqs, max_tokens=64, device="cpu", buckets=(48, 64))
    assert len(mbs) == 1
    mb = mbs[0]
    with torch.no_grad():
        packed = token_logprobs(model.compute_logits(model(mb.input_ids, mb.ctx.positions, mb.ctx)[mb.logit_index]),
                                mb.targets)
        alone = []
        for s in seqs:
            from monorl.model.attention import VarlenContext

            ids = torch.tensor(s.prompt_ids + s.completion_ids)
            ctx = VarlenContext.from_lengths([len(ids)], "cpu")
            logits = model.compute_logits(model(ids, ctx.positions, ctx))
            p = len(s.prompt_ids)
            alone.append(token_logprobs(logits[p - 1:-1], torch.tensor(s.completion_ids)))
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=0)


def test_static_pack_pads_every_dimension_to_a_bucket():
    seqs = [_seq(5, 3), _seq(7, 4), _seq(2, 6)]
    (mb,) = make_micro_batches(seqs, max_tokens=64, device="cpu", buckets=(16, 32, 64), static=True)
    # 27 real tokens -> 32; max_seqlen 16 (>= 11); fillers of <= 16 tokens; 4 entries padded to 8 with zeros
    assert mb.shape == PackShape(tokens=32, seqs=8, targets=16, max_seqlen=16, full_tokens=32, copies=1)
    assert mb.ctx.cu_seqlens.tolist() == [0, 8, 19, 27, 32, 32, 32, 32, 32]
    assert mb.num_targets == 13 and mb.token_mask.tolist() == [1.0] * 13 + [0.0] * 3
    assert torch.equal(mb.input_ids[mb.logit_index[:13] + 1], mb.targets[:13])
    # another pack of the same bucket sizes has the same static shape (one CUDA graph serves both)
    (mb2,) = make_micro_batches([_seq(9, 2), _seq(4, 9)], max_tokens=64, device="cpu", buckets=(16, 32, 64),
                                static=True)
    assert mb2.shape == mb.shape


def test_static_pack_logprobs_equal_dynamic_pack():
    """Zero-length entries, a larger max_seqlen and padded rows change nothing for the real tokens."""
    torch.manual_seed(0)
    model = build_model(model_shape("tiny"), seed=1).eval()
    seqs = [TrainSequence(torch.randint(3, 100, (p,)).tolist(), torch.randint(3, 100, (c,)).tolist(), [0.0] * c, 1.0)
            for p, c in [(5, 3), (9, 7), (3, 1)]]
    out = []
    for static in (False, True):
        (mb,) = make_micro_batches(seqs, max_tokens=64, device="cpu", static=static)
        with torch.no_grad():
            hidden = model(mb.input_ids, mb.ctx.positions, mb.ctx)
            lp = token_logprobs(model.compute_logits(hidden[mb.logit_index]), mb.targets)
        out.append(lp[: mb.num_targets])
        assert bool(torch.isfinite(lp).all())
    torch.testing.assert_close(out[1], out[0], atol=1e-5, rtol=0)


def _grouped(prompt: int, completion: int, group: int) -> TrainSequence:
    return TrainSequence([1] * prompt, [2] * completion, [0.0] * completion, 1.0, group=group)


def _shares(seqs: list[TrainSequence], ranks: int) -> list[tuple[int, int]]:
    return [(s.start, s.stop) for s in (token_share(seqs, r, ranks) for r in range(ranks))]


def test_token_share_balances_packed_tokens_between_groups() -> None:
    # one long group, three short: by sequence count rank 0 would pack 420 tokens and rank 1 60
    seqs = [_grouped(10, 100, 0)] * 4 + [_grouped(10, 10, g) for g in (1, 2, 3) for _ in range(4)]
    assert _shares(seqs, 2) == [(0, 4), (4, 16)]
    assert _shares(seqs, 4) == [(0, 4), (4, 8), (8, 12), (12, 16)]  # no rank left without a group
    assert _shares(seqs, 1) == [(0, 16)]


def test_token_share_equal_lengths_is_the_even_split() -> None:
    seqs = [_grouped(10, 10, i // 8) for i in range(64)]
    assert _shares(seqs, 4) == [(0, 16), (16, 32), (32, 48), (48, 64)]
    # fewer groups than ranks: cut inside the group, every part packs the prompt once
    one_group = [_grouped(10, 10, 0)] * 16
    assert _shares(one_group, 4) == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_token_share_covers_every_sequence_once() -> None:
    g = torch.Generator().manual_seed(1)
    for ranks in (2, 3, 4):
        seqs = [_grouped(5, int(torch.randint(1, 50, (1,), generator=g)), i // 3) for i in range(20)]
        shares = _shares(seqs, ranks)
        assert shares[0][0] == 0 and shares[-1][1] == 20
        assert all(a[1] == b[0] for a, b in zip(shares, shares[1:], strict=False))
        assert all(lo % 3 == 0 for lo, _ in shares)  # cuts fall between groups
