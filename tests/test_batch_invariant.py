"""Batch-invariant mode on CPU (the ops' CPU path): with the model and the generator's copy converted
(`make_batch_invariant_`), generator log-probs == trainer log-probs, bitwise; a model not converted is untouched."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from monorl.generate.generator import Generator, GeneratorConfig
from monorl.generate.sampling import SamplingParams
from monorl.model.attention import VarlenContext
from monorl.model.batch_invariant import is_batch_invariant, make_batch_invariant_
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.logprobs import token_logprobs
from monorl.ops import logprob_invariant, matmul_invariant, rmsnorm_invariant
from monorl.ops.attention import invariant as attention_invariant
from monorl.train.packing import TrainSequence, make_micro_batches
from monorl.train.trainer import Trainer, TrainerConfig

TEMPERATURE = 0.9


def _prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _rollouts(model, prompts, max_num_seqs: int, n: int = 2, new: int = 10) -> list[TrainSequence]:
    gen = Generator(model, GeneratorConfig(max_num_seqs=max_num_seqs, max_model_len=128, block_size=8))
    if is_batch_invariant(model):  # the generator's copy converted too, as the RL loop does
        make_batch_invariant_(gen.model)
    sp = SamplingParams(max_new_tokens=new, temperature=TEMPERATURE, ignore_eos=True, seed=1)
    out = gen.generate(prompts, sp, n=n)
    return [TrainSequence(p, c.token_ids, c.logprobs, 0.0) for p, cs in zip(prompts, out, strict=True) for c in cs]


def _trainer_logprobs(model, seqs: list[TrainSequence], budget: int) -> list[torch.Tensor]:
    """Trainer log-probs per sequence (in `seqs` order), packed into micro-batches of `budget` tokens."""
    tr = Trainer(model, TrainerConfig(micro_batch_tokens=budget), total_steps=1)
    out: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for mb in make_micro_batches(seqs, budget, "cpu"):
            lp = tr.response_logprobs(model, mb, TEMPERATURE)
            for i in mb.seq_ids.unique().tolist():
                out[i] = lp[mb.seq_ids == i]
    return [out[i] for i in range(len(seqs))]


@pytest.fixture(scope="module")
def model():
    return build_model(model_shape("tiny"), seed=3)


@pytest.fixture(scope="module")
def invariant_model(model):
    return make_batch_invariant_(copy.deepcopy(model))


def test_ops_rows_do_not_depend_on_batch() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 96, generator=g), torch.randn(50, 96, generator=g)
    linear = matmul_invariant.linear
    full = linear(x, w)
    assert all(torch.equal(linear(x[i:i + 1], w)[0], full[i]) for i in range(37))
    assert torch.equal(linear(x[5:20], w), full[5:20])
    nw = torch.rand(96, generator=g)
    rms_norm = rmsnorm_invariant.rms_norm
    assert torch.equal(rms_norm(x[3:4], nw, 1e-6), rms_norm(x, nw, 1e-6)[3:4])
    tok = torch.randint(0, 96, (37,), generator=g)
    lp = logprob_invariant.token_logprobs
    assert torch.equal(lp(x[7:9], tok[7:9], 0.7), lp(x, tok, 0.7)[7:9])
    # close to the ordinary math, too
    torch.testing.assert_close(full, x @ w.t(), rtol=1e-5, atol=1e-4)


def _linear_master_check(device: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(37, 64, device=device).bfloat16().requires_grad_()
    w = (torch.randn(48, 64, device=device) * 0.1).requires_grad_()
    grad = torch.randn(37, 48, device=device).bfloat16()
    out = matmul_invariant.linear(x, w)
    assert torch.equal(out, matmul_invariant.bi_mm(x.detach(), w.detach().bfloat16()))  # the forward is unchanged
    out.backward(grad)
    wb = w.detach().bfloat16()
    assert torch.equal(x.grad, grad @ wb)
    exact = grad.double().t() @ x.detach().double()
    rounded = (grad.t() @ x.detach()).float()  # what autograd's bf16 product then cast gave
    assert w.grad.dtype == torch.float32
    assert (w.grad.double() - exact).abs().max() <= (rounded.double() - exact).abs().max()
    assert (w.grad.double() - exact).abs().max() < 1e-4 * exact.abs().max()
    frozen = w.detach().requires_grad_(False)  # no weight gradient wanted: the plain path
    assert torch.equal(matmul_invariant.linear(x.detach(), frozen), out.detach())


def test_linear_weight_gradient_in_fp32_from_the_gemm() -> None:
    """`matmul_invariant.linear` on an fp32 master under a bf16 x: the forward is bi_mm's; the weight gradient
    comes out of its GEMM in fp32 (no bf16 rounding of the product, no cast), at least as close to the exact
    product as autograd's bf16-then-cast one."""
    _linear_master_check("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_linear_weight_gradient_in_fp32_from_the_gemm_on_cuda() -> None:
    _linear_master_check("cuda")


def test_attention_varlen_equals_decode() -> None:
    """A token's attention output is the same from a packed causal forward and from a decode step over
    a paged cache holding the same keys (scattered blocks)."""
    g = torch.Generator().manual_seed(1)
    L, Hq, Hkv, D, bs = 21, 4, 2, 16, 4
    q, k, v = (torch.randn(L, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    c = VarlenContext.from_lengths([L], "cpu")
    full = attention_invariant.varlen_attention(q, k, v, c.cu_seqlens, c.pad_index, c.valid)
    blocks = torch.randperm(16, generator=g)[:6]  # a non-contiguous block table
    kc, vc = torch.full((16, bs, Hkv, D), float("nan")), torch.full((16, bs, Hkv, D), float("nan"))
    slots = blocks.repeat_interleave(bs)[:L] * bs + torch.arange(L) % bs
    kc.view(-1, Hkv, D)[slots], vc.view(-1, Hkv, D)[slots] = k, v
    for t in (0, 3, 4, 20):
        dec = attention_invariant.paged_decode(q[t:t + 1], kc, vc, blocks[None].int(),
                                               torch.tensor([t + 1], dtype=torch.int32))
        assert torch.equal(dec[0], full[t]), t
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
    torch.testing.assert_close(full, ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_attention_log_sum_exp() -> None:
    """The varlen op's second output, what flash attention's backward takes (fp32 [Hq, T]): each row's log-sum-exp
    of its scaled causal scores within its own sequence, GQA included."""
    g = torch.Generator().manual_seed(4)
    lengths, Hq, Hkv, D = [7, 1, 12], 4, 2, 16
    T = sum(lengths)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    c = VarlenContext.from_lengths(lengths, "cpu")
    out, lse = attention_invariant.bi_varlen_attn(q, k, v, c.cu_seqlens, c.pad_index, c.valid)
    assert lse.shape == (Hq, T) and lse.dtype == torch.float32
    start = 0
    for L in lengths:
        kk = k[start:start + L].repeat_interleave(Hq // Hkv, dim=1)
        s = torch.einsum("thd,shd->hts", q[start:start + L], kk) * D ** -0.5
        s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
        torch.testing.assert_close(lse[:, start:start + L], torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)
        start += L
    assert torch.equal(out, attention_invariant.varlen_attention(q, k, v, c.cu_seqlens, c.pad_index, c.valid))


def test_attention_compiles_with_backward() -> None:
    """Compiled (AOT autograd traces both custom ops through their fake implementations, forward and backward),
    the invariant attention's gradients equal eager's."""
    g = torch.Generator().manual_seed(5)
    lengths, Hq, Hkv, D = [5, 9, 3], 4, 2, 16
    q, k, v = (torch.randn(sum(lengths), h, D, generator=g, requires_grad=True) for h in (Hq, Hkv, Hkv))
    c = VarlenContext.from_lengths(lengths, "cpu")

    def loss(q, k, v):
        return attention_invariant.varlen_attention(q, k, v, c.cu_seqlens, c.pad_index, c.valid).square().sum()

    ref = torch.autograd.grad(loss(q, k, v), (q, k, v))
    got = torch.autograd.grad(torch.compile(loss, backend="aot_eager", fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b)


def test_attention_backward_static_pack_layout() -> None:
    """The invariant attention's backward reads only device tensors of the context (no host sync: it runs inside
    trainer CUDA graphs); with a static pack's layout (zero-length entries, a larger max_seqlen) its gradients
    equal the exact layout's and the portable backend's."""
    g = torch.Generator().manual_seed(2)
    lengths, Hq, Hkv, D = [5, 9, 3], 4, 2, 16
    T = sum(lengths)
    q, k, v = (torch.randn(T, h, D, generator=g, requires_grad=True) for h in (Hq, Hkv, Hkv))
    w = torch.randn(T, Hq, D, generator=g)

    def grads(ctx, invariant):
        out = (ctx.batch_invariant() if invariant else ctx).attend(q, k, v)
        return torch.autograd.grad((out * w).sum(), (q, k, v))

    exact = VarlenContext.from_lengths(lengths, "cpu")
    static = VarlenContext.from_lengths(lengths + [0, 0], "cpu", max_seqlen=16)
    ref = grads(exact, False)
    for ctx in (exact, static):
        for a, b in zip(grads(ctx, True), ref, strict=True):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("max_num_seqs", [1, 5, 16])
def test_generator_equals_trainer_bitwise(invariant_model, max_num_seqs: int) -> None:
    model = invariant_model
    prompts = _prompts(8, seed=max_num_seqs, vocab=model.config.vocab_size)
    seqs = _rollouts(model, prompts, max_num_seqs)
    for budget in (64, 160, 4096):  # different pack layouts: one sequence per pack up to all in one
        got = _trainer_logprobs(model, seqs, budget)
        for s, lp in zip(seqs, got, strict=True):
            assert torch.equal(lp, torch.tensor(s.old_logprobs, dtype=torch.float32)), (budget, s)


def test_trainer_backward_runs_in_mode() -> None:
    m = build_model(model_shape("tiny"), seed=3)
    mi = make_batch_invariant_(copy.deepcopy(m))
    seqs = [TrainSequence([1, 2, 3], [4, 5], [-1.0, -1.0], 1.0), TrainSequence([7] * 9, [3, 2, 1], [-1.0] * 3, -1.0)]
    (mb,) = make_micro_batches(seqs, 64, "cpu")
    tr = Trainer(mi, TrainerConfig(micro_batch_tokens=64), total_steps=1)
    tr.response_logprobs(mi, mb, 1.0).sum().backward()
    grads_bi = {n: p.grad.clone() for n, p in mi.named_parameters()}
    tr.response_logprobs(m, mb, 1.0).sum().backward()
    for n, p in m.named_parameters():  # backward is ordinary math: close to the default mode's gradient
        torch.testing.assert_close(grads_bi[n], p.grad, rtol=1e-3, atol=1e-5, msg=n)


def test_default_mode_is_not_bitwise(model) -> None:
    """Negative control: without the mode, the trainer's recomputation differs from the generator's
    log-probs in the last bits somewhere (so the bitwise test above is not vacuous)."""
    seqs = _rollouts(model, _prompts(8, seed=5, vocab=model.config.vocab_size), max_num_seqs=16)
    got = _trainer_logprobs(model, seqs, 4096)
    diffs = [float((lp - torch.tensor(s.old_logprobs)).abs().max()) for s, lp in zip(seqs, got, strict=True)]
    assert max(diffs) > 0
    assert max(diffs) < 1e-4


def test_loop_reports_zero_logprob_diff(tmp_path) -> None:
    """In the RL loop with `batch_invariant: true`, the reported logprob_diff max is 0 every step."""
    from monorl.presets import preset
    from monorl.run.grpo import GRPORun

    cfg = preset("tiny")
    cfg.run_dir, cfg.steps, cfg.batch_invariant = str(tmp_path / "run"), 2, True
    cfg.warm_start.steps, cfg.validation.num_prompts = 0, 2
    cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 3, 4, 8
    cfg.trainer.lr = 1e-3  # weights change between steps: the generator must follow them exactly
    result = GRPORun(cfg, progress=False).run()
    assert len(result.steps) == 2
    for s in result.steps:
        assert s["logprob_diff_max"] == 0.0 and s["logprob_diff_mean"] == 0.0, s


def test_conversion_leaves_other_models_alone() -> None:
    """No global state: after converting one model, another model's forward and its generator's tokens and
    log-probs are bit for bit what they were before (the default mode's); the converted one's differ."""
    plain = build_model(model_shape("tiny"), seed=4)
    other = copy.deepcopy(plain)
    vocab = plain.config.vocab_size
    prompts = _prompts(5, seed=11, vocab=vocab)
    ids = torch.tensor([t for p in prompts for t in p])
    ctx = VarlenContext.from_lengths([len(p) for p in prompts], "cpu")

    def logits(m):
        with torch.no_grad():
            return m.compute_logits(m(ids, ctx.positions, ctx))

    def rollouts(m):
        return [(s.completion_ids, s.old_logprobs) for s in _rollouts(m, prompts, max_num_seqs=3)]

    before_logits, before_gen = logits(plain), rollouts(plain)
    make_batch_invariant_(other)
    assert is_batch_invariant(other) and not is_batch_invariant(plain)
    assert plain.token_logprobs is token_logprobs
    assert torch.equal(logits(plain), before_logits)
    assert rollouts(plain) == before_gen
    assert ctx.backend == "sdpa"  # the converted model rebinds a copy of the context, never the context itself
    assert not torch.equal(logits(other), before_logits)


def test_rms_backward_launch_covers_the_rows() -> None:
    """The norm backward's grid-stride launch (`_backward_launch`): no more programs than tiles (each writes a
    weight-gradient partial), at most `rmsnorm.backward_programs_per_sm` an SM, none for no rows -- whose weight
    gradient is then the sum of no partials, zeros (`sum_rows`)."""
    from monorl.ops.tunables import HOPPER, tuned

    launch = rmsnorm_invariant._backward_launch
    per_sm = tuned("rmsnorm.backward_programs_per_sm", HOPPER)
    for rows, half_p, sms in [(9216, 512, 132), (147456, 64, 132), (37, 64, 3), (1, 2048, 132), (0, 64, 132)]:
        programs, tile, _ = launch(rows, half_p, sms)
        assert tile >= 1 and programs <= min(-(-rows // tile), per_sm * sms)
        assert (programs >= 1) == (rows > 0)
    assert torch.equal(rmsnorm_invariant.sum_rows(torch.empty(0, 8)), torch.zeros(8))
    p = torch.randn(5, 8)
    assert torch.equal(rmsnorm_invariant.sum_rows(p), p.sum(0))
