"""Batch-invariant mode on CUDA (Triton kernels): with the trainer's model and the generator's copy converted
(`make_batch_invariant_`), the generator's bf16 log-probs of its sampled tokens equal the trainer's
recomputation from fp32 masters under its bf16 autocast, bitwise, for batch sizes 1..64, mixed prompt
lengths, different pack layouts, eager and compiled."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from monorl.compile import CompileConfig, compile_blocks, setup_compile_cache
from monorl.generate.generator import Generator, GeneratorConfig
from monorl.generate.sampling import SamplingParams
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.ops import matmul_invariant
from monorl.ops.tunables import chip_of, tuned
from monorl.train.packing import TrainSequence, make_micro_batches
from monorl.train.trainer import Trainer, TrainerConfig

pytestmark = pytest.mark.gpu
TEMPERATURE = 1.0


def _model(seed: int = 0):
    cfg = dataclasses.replace(model_shape("qwen3-0.6b"), num_layers=4)  # Qwen3-0.6B width, 4 layers
    return build_model(cfg, "cuda", torch.float32, seed=seed)


def _mismatch(backend: str | None, max_num_seqs: int, budgets: tuple[int, ...], mode: bool = True,
              n_prompts: int = 12, n: int = 4, new: int = 24, fused: bool = True,
              regional: bool = True) -> tuple[int, int, float]:
    """(mismatching tokens, tokens, max |diff|) between generator and trainer log-probs over all layouts."""
    torch._dynamo.reset()
    model = _model()
    rng = random.Random(max_num_seqs)
    prompts = [[rng.randrange(1, model.config.vocab_size) for _ in range(rng.randint(5, 150))]
               for _ in range(n_prompts)]
    gcfg = GeneratorConfig(max_num_seqs=max_num_seqs, max_model_len=512, kv_cache_bytes=1 << 30)
    cc = CompileConfig(backend=backend or "none", regional=regional)
    setup_compile_cache(cc)
    gen = Generator(model, gcfg, compile=cc, fused=fused)  # fused: as the RL loop builds it (the fused kernels copy)
    if mode:  # both sides, as the RL loop converts them
        make_batch_invariant_(model)
        make_batch_invariant_(gen.model)
    sp = SamplingParams(max_new_tokens=new, temperature=TEMPERATURE, ignore_eos=True, seed=7)
    out = gen.generate(prompts, sp, n=n)
    seqs = [TrainSequence(p, c.token_ids, c.logprobs, 0.0) for p, cs in zip(prompts, out, strict=True) for c in cs]
    if backend:
        compile_blocks(model, cc)
    bad = total = 0
    worst = 0.0
    for budget in budgets:
        tr = Trainer(model, TrainerConfig(micro_batch_tokens=budget), total_steps=1)
        for mb in make_micro_batches(seqs, budget, "cuda", "flash"):
            lp = tr.response_logprobs(model, mb, TEMPERATURE)
            lp.sum().backward()  # the trainer's real path: forward with grad
            d = (lp.detach() - mb.old_logprobs).abs()
            bad += int((d != 0).sum())
            total += d.numel()
            worst = max(worst, float(d.max()))
    return bad, total, worst


@pytest.mark.parametrize("max_num_seqs", [1, 7, 64])
def test_eager_bitwise(max_num_seqs: int) -> None:
    bad, total, worst = _mismatch(None, max_num_seqs, budgets=(512, 2048, 16384))
    assert bad == 0, f"{bad}/{total} log-probs differ, max |diff| {worst:.3g}"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_bitwise(backend: str) -> None:
    bad, total, worst = _mismatch(backend, 64, budgets=(1024, 16384))
    print(f"\n[batch-invariant] compile={backend}: {bad}/{total} differ, max |diff| {worst:.3g}")
    assert bad == 0, f"compile={backend}: {bad}/{total} log-probs differ, max |diff| {worst:.3g}"


def test_unfused_generator_and_whole_model_compile_bitwise() -> None:
    """An unfused generator copy (separate q/k/v and gate/up GEMMs, as LoRA runs build it) against a trainer
    compiled whole (`compile.regional false`: the model's forward outside the blocks is compiled too)."""
    bad, total, worst = _mismatch("inductor", 64, budgets=(16384,), fused=False, regional=False)
    assert bad == 0, f"{bad}/{total} log-probs differ, max |diff| {worst:.3g}"


def test_default_mode_differs() -> None:
    """Negative control: without the mode, bf16 generator and autocast trainer are not bitwise equal."""
    bad, total, worst = _mismatch(None, 64, budgets=(16384,), mode=False)
    print(f"\n[default mode] {bad}/{total} differ, max |diff| {worst:.3g}")
    assert bad > 0


MM_SHAPES = [(1024, 1024), (3072, 1024), (1024, 3072), (6144, 2048), (151936, 1024)]  # (N, K)


@pytest.mark.parametrize("n_k", MM_SHAPES)
def test_matmul_rows_invariant_across_m(n_k: tuple[int, int]) -> None:
    """Rows of a 600-row product equal the same rows computed alone or in smaller batches, on both sides of
    the decode/pack tiling switch (`matmul.decode_rows`)."""
    N, K = n_k
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(600, K, device="cuda", generator=g).bfloat16()
    w = torch.randn(N, K, device="cuda", generator=g).bfloat16()
    full = matmul_invariant.linear(x, w)
    edge = tuned("matmul.decode_rows", chip_of(0))
    for m in (1, 2, 17, 64, 65, edge, edge + 1, 300):
        assert torch.equal(matmul_invariant.linear(x[:m], w), full[:m]), m
    torch.testing.assert_close(full.float(), (x.float() @ w.float().t()), rtol=2e-2, atol=2e-2)


def test_matmul_tilings_agree_bitwise() -> None:
    """Every tiling `_mm_config` can pick computes each element identically: the property that lets the tiling
    follow M (decode vs pack). Should a Triton or GPU change break it, this fails before any parity test."""
    mi = matmul_invariant
    if not mi.tiling_may_follow_m(0):
        pytest.skip("the tiling follows M on Hopper only; elsewhere one tiling per weight shape")
    edge = tuned("matmul.decode_rows", chip_of(0))
    configs = sorted({mi._mm_config(m, n, k) for m in (1, 64, edge, edge + 1, 8192) for n, k in MM_SHAPES})
    assert len(configs) > 1
    g = torch.Generator(device="cuda").manual_seed(1)
    for N, K in MM_SHAPES:
        x = torch.randn(200, K, device="cuda", generator=g).bfloat16()
        w = torch.randn(N, K, device="cuda", generator=g).bfloat16()
        ref = mi._mm_triton(x, w, configs[0])
        for c in configs[1:]:
            assert torch.equal(mi._mm_triton(x, w, c), ref), (N, K, c, configs[0])


@pytest.mark.parametrize("inter_k", [(3072, 1024), (6144, 2048), (100, 64)])
def test_mm_silu_mul_equals_gemm_then_silu(inter_k: tuple[int, int]) -> None:
    """The decode step's gate/up GEMM with SiLU * up as its epilogue equals the invariant GEMM followed by the
    SiLU kernel, bitwise, at every decode row count it runs at."""
    from monorl.ops.block_kernels import silu_mul

    inter, K = inter_k
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(64, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(2 * inter, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    with torch.no_grad():
        for m in (1, 2, 7, 40, 48, 64):
            assert matmul_invariant.silu_mul_fusable(x[:m])
            gate, up = matmul_invariant.linear(x[:m], w).split([inter, inter], dim=-1)
            assert torch.equal(matmul_invariant.mm_silu_mul(x[:m], w), silu_mul(gate, up)), m
    assert not matmul_invariant.silu_mul_fusable(x.requires_grad_())


@pytest.mark.parametrize("V", [151936, 5000, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_token_logprobs_rows_invariant(V: int, dtype: torch.dtype) -> None:
    """The token log-prob kernels (vocabulary segments, then their merge): a row's value is the same alone, in a
    decode-sized batch and in a trainer-sized one, bitwise, and close to log_softmax; vocabularies smaller than
    the segments (empty ones) included."""
    from monorl.ops.logprob_invariant import token_logprobs

    g = torch.Generator(device="cuda").manual_seed(3)
    x = (4 * torch.randn(600, V, device="cuda", generator=g)).to(dtype)
    tok = torch.randint(0, V, (600,), device="cuda", generator=g)
    full = token_logprobs(x, tok, 0.7)
    for a, b in ((0, 1), (5, 45), (100, 600)):
        assert torch.equal(token_logprobs(x[a:b], tok[a:b], 0.7), full[a:b]), (a, b)
    ref = torch.log_softmax(x.double() / 0.7, -1).gather(1, tok[:, None])[:, 0]
    torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=2e-5)


def test_attention_backward_flash_matches_textbook() -> None:
    """The mode's attention backward on CUDA is flash attention's (backward values need not be invariant), from
    the invariant forward's output and log-sum-exp (that log-sum-exp is flash's own forward's, to fp32 rounding):
    its gradients agree with the textbook formulas in fp32, GQA and a static pack's zero-length entries included."""
    from monorl.model.attention import VarlenContext
    from monorl.ops.attention.invariant import backward_flash, backward_padded, bi_varlen_attn

    g = torch.Generator(device="cuda").manual_seed(0)
    ctx = VarlenContext.from_lengths([37, 120, 5, 1, 0, 0], "cuda", "invariant", max_seqlen=128)
    T = int(ctx.cu_seqlens[-1])
    q, grad = (torch.randn(T, 16, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(T, 8, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    out, lse = bi_varlen_attn(q, k, v, ctx.cu_seqlens, ctx.pad_index, ctx.valid)
    L = ctx.valid.shape[1]
    _, flash_lse, _, _, _ = torch.ops.aten._flash_attention_forward(q, k, v, ctx.cu_seqlens, ctx.cu_seqlens, L, L,
                                                                    0.0, True, False)
    torch.testing.assert_close(lse, flash_lse, rtol=1e-5, atol=1e-4)
    flash = backward_flash(grad, q, k, v, out, lse, ctx.cu_seqlens, L)
    exact = backward_padded(grad, q, k, v, ctx.pad_index, ctx.valid)[:3]  # (the fourth: the sinks')
    for name, a, b in zip(("dq", "dk", "dv"), flash, exact, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 1e-2, f"{name}: relative error {rel:.3g}"
