"""GPT-OSS's attention sinks in the Triton attention kernel (`monorl.ops.attention.kernel`), run on CPU tensors by
Triton's interpreter: paged decode (with and without key splits), a turn's cached prefill and the packed varlen
forward with its log-sum-exp, each with and without a window, against the portable sdpa forms with sinks; and the
sinks' gradient (`sink_grad`, the CUDA backward's) from the kernel's output and log-sum-exp against autograd's.

The interpreter has to be switched on before triton is imported, so `test_kernel_sinks_under_the_interpreter` runs
this file again in a subprocess with TRITON_INTERPRET=1, where the cases below run (~5 s in all); without triton
(CPU CI) everything skips. fp32 only: the interpreter computes bf16 wrongly (the unchanged kernel too)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.triton_interpreter import cases, interpreter_patches, outer, run_this_file_interpreted  # noqa: E402


@outer
def test_kernel_sinks_under_the_interpreter():
    run_this_file_interpreted(__file__)


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    from monorl.ops.attention import kernel
    yield from interpreter_patches(monkeypatch, kernel)


def packed(lengths, hq=4, hkv=2, d=16, seed=0, device="cpu", dtype=torch.float32):
    """Random q [T, hq, d], k/v [T, hkv, d] of packed sequences, and sinks [hq] O(1) next to their scores."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k, v = (torch.randn(T, h, d, generator=g) for h in (hq, hkv, hkv))
    sinks = 2 * torch.randn(hq, generator=g)
    return [x.to(device, dtype) for x in (q, k, v)] + [sinks.to(device)]


def paged(k, v, lengths, bs=4):
    """Each sequence's packed keys written into a paged cache [N, bs, H, D] through shuffled block tables."""
    width = max(-(-n // bs) for n in lengths)
    n_blocks = 1 + len(lengths) * width
    perm = torch.randperm(n_blocks - 1, generator=torch.Generator().manual_seed(1)) + 1
    tables = perm.view(len(lengths), width).to(torch.int32).to(k.device)
    kc = torch.zeros(n_blocks, bs, *k.shape[1:], device=k.device, dtype=k.dtype)
    vc = torch.zeros_like(kc)
    start = 0
    for s, n in enumerate(lengths):
        p = torch.arange(n, device=k.device)
        blk = tables[s, p // bs].long()
        kc[blk, p % bs], vc[blk, p % bs] = k[start:start + n], v[start:start + n]
        start += n
    return kc, vc, tables


LENGTHS = [5, 70, 1]  # 70: two of the kernel's 64-key blocks
WINDOWS = pytest.mark.parametrize("window", [0, 3, 40])


@cases
@pytest.mark.parametrize("window,splits", [(0, 1), (3, 1), (40, 1), (0, 4), (40, 4)])
def test_paged_decode_counts_the_sinks(window, splits):
    from monorl.generate.attention import paged_decode_torch
    from monorl.ops.attention.kernel import attention_triton
    q, k, v, sinks = packed(LENGTHS)
    kc, vc, tables = paged(k, v, LENGTHS)
    lens = torch.tensor(LENGTHS, dtype=torch.int32)
    qd = q[lens.cumsum(0) - 1]  # each sequence's last token
    out = attention_triton(qd, kc, vc, lens, tables, splits, window=window, sinks=sinks)
    torch.testing.assert_close(out, paged_decode_torch(qd, kc, vc, tables, lens, window, sinks), atol=1e-5, rtol=0)
    assert not torch.allclose(out, paged_decode_torch(qd, kc, vc, tables, lens, window), atol=1e-2)


@cases
@WINDOWS
def test_cached_prefill_counts_the_sinks(window):
    from monorl.generate.attention import sdpa_cached
    from monorl.ops.attention.kernel import cached_attention_triton
    lens_k, lens_q = [70, 9], [30, 9]
    q_all, k, v, sinks = packed(lens_k)
    kc, vc, tables = paged(k, v, lens_k)
    rows = torch.cat([torch.arange(sum(lens_k[:s]) + lens_k[s] - lens_q[s], sum(lens_k[:s + 1])) for s in range(2)])
    q = q_all[rows]
    cu_q = torch.tensor([0, lens_q[0], sum(lens_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, lens_k[0], sum(lens_k)], dtype=torch.int32)
    out = cached_attention_triton(q, kc, vc, cu_q, cu_k, tables, max(lens_q), window, sinks)
    ref = sdpa_cached(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), window, sinks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@cases
@WINDOWS
def test_varlen_forward_lse_and_sink_grad(window):
    """Output and log-sum-exp (counting the sinks) as the CPU references'; the sinks' gradient from them
    (`sink_grad`) as autograd's through the sdpa form."""
    from monorl.model.attention import VarlenContext, sdpa_varlen
    from monorl.ops.attention.invariant import bi_varlen_attn, sink_grad
    from monorl.ops.attention.kernel import varlen_attention_triton
    q, k, v, sinks = packed(LENGTHS)
    ctx = VarlenContext.from_lengths(LENGTHS, "cpu")
    lse = torch.empty(q.shape[1], q.shape[0])
    out = varlen_attention_triton(q, k, v, ctx.cu_seqlens, ctx.max_seqlen, lse, window, sinks)
    sinks.requires_grad_(True)
    ref = sdpa_varlen(q, k, v, ctx.pad_index, ctx.valid, window, sinks)
    torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=0)
    ref_lse = bi_varlen_attn(q, k, v, ctx.cu_seqlens, ctx.pad_index, ctx.valid, window, sinks.detach())[1]
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (ref_ds,) = torch.autograd.grad((ref * grad).sum(), sinks)
    torch.testing.assert_close(sink_grad(grad, out, lse, sinks.detach()), ref_ds, atol=1e-5, rtol=1e-5)
