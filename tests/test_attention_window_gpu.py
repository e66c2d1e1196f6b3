"""Sliding windows on the CUDA attention paths: the Triton kernel (varlen, paged decode with and without key splits,
cached prefill), flash's window, against the portable sdpa forms; and the batch-invariant varlen and decode rows
equal bit for bit with a window (rows whose first key blocks are all outside their window)."""

from __future__ import annotations

import pytest
import torch

from monorl.generate.attention import paged_decode_torch, sdpa_cached
from monorl.model.attention import VarlenContext, flash_varlen, sdpa_varlen
from monorl.ops.attention import invariant
from monorl.ops.attention.kernel import attention_triton, cached_attention_triton, varlen_attention_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV, DT = "cuda", torch.bfloat16


def packed(lengths, hq=8, hkv=2, d=64, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    T = sum(lengths)
    return [torch.randn(T, h, d, generator=g, device=DEV, dtype=DT) for h in (hq, hkv, hkv)]


def paged(k, v, lengths, bs=16):
    """The packed keys of each sequence written into a paged cache [N, bs, H, D] with shuffled block tables."""
    width = max(-(-n // bs) for n in lengths)
    n_blocks = 1 + len(lengths) * width
    perm = torch.randperm(n_blocks - 1, generator=torch.Generator().manual_seed(1)) + 1
    tables = perm.view(len(lengths), width).to(torch.int32).to(DEV)
    kc = torch.zeros(n_blocks, bs, *k.shape[1:], device=DEV, dtype=DT)
    vc = torch.zeros_like(kc)
    start = 0
    for s, n in enumerate(lengths):
        p = torch.arange(n, device=DEV)
        blk = tables[s, p // bs].long()
        kc[blk, p % bs], vc[blk, p % bs] = k[start:start + n], v[start:start + n]
        start += n
    return kc, vc, tables


@pytest.mark.parametrize("window", [1, 5, 64, 100, 300])
def test_varlen_triton_and_flash_apply_the_window(window):
    lengths = [37, 300, 1, 129]
    q, k, v = packed(lengths)
    ctx = VarlenContext.from_lengths(lengths, DEV)
    ref = sdpa_varlen(q.float(), k.float(), v.float(), ctx.pad_index, ctx.valid, window)
    out = varlen_attention_triton(q, k, v, ctx.cu_seqlens, ctx.max_seqlen, window=window)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)
    fl = flash_varlen(q, k, v, ctx.cu_seqlens, ctx.max_seqlen, window)
    torch.testing.assert_close(fl.float(), ref, atol=2e-2, rtol=0)


@pytest.mark.parametrize("window,splits", [(5, 1), (100, 1), (100, 4), (512, 2), (1000, 8)])
def test_paged_decode_triton_applies_the_window(window, splits):
    lengths = [37, 300, 1, 129]
    q, k, v = packed(lengths)
    kc, vc, tables = paged(k, v, lengths)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    qd = q[torch.tensor(lengths, device=DEV).cumsum(0) - 1]  # each sequence's last token
    ref = paged_decode_torch(qd.float(), kc.float(), vc.float(), tables, lens, window)
    out = attention_triton(qd, kc, vc, lens, tables, splits, window=window)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)


def test_paged_decode_reads_no_block_before_the_window():
    """Blocks wholly before each row's window may hold anything (a window kind recycles them): NaNs there change
    nothing."""
    lengths, window = [300, 129], 40
    q, k, v = packed(lengths)
    kc, vc, tables = paged(k, v, lengths)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    qd = q[torch.tensor(lengths, device=DEV).cumsum(0) - 1]
    before = attention_triton(qd, kc, vc, lens, tables, window=window)
    for s, n in enumerate(lengths):
        first = (n - window) // 64 * 64  # the kernel's 64-key blocks: it starts at the one holding the first key
        for b in range(first // 16):
            kc[tables[s, b].long()] = float("nan")
            vc[tables[s, b].long()] = float("nan")
    assert torch.equal(attention_triton(qd, kc, vc, lens, tables, window=window), before)


@pytest.mark.parametrize("window", [3, 50])
def test_cached_prefill_triton_applies_the_window(window):
    lens_k, lens_q = [200, 77], [30, 9]
    q_all, k, v = packed(lens_k)
    kc, vc, tables = paged(k, v, lens_k)
    rows = torch.cat([torch.arange(sum(lens_k[:s]) + lens_k[s] - lens_q[s], sum(lens_k[:s + 1])) for s in range(2)])
    q = q_all[rows.to(DEV)]
    cu_q = torch.tensor([0, lens_q[0], sum(lens_q)], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, lens_k[0], sum(lens_k)], dtype=torch.int32, device=DEV)
    ref = sdpa_cached(q.float(), k.float(), v.float(), cu_q, cu_k, max(lens_q), max(lens_k), window)
    out = cached_attention_triton(q, kc, vc, cu_q, cu_k, tables, max(lens_q), window)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)


@pytest.mark.parametrize("window", [5, 70, 200])
def test_invariant_varlen_equals_decode_rows_bitwise(window):
    lengths = [150, 67]
    q, k, v = packed(lengths, hq=4, hkv=1)
    ctx = VarlenContext.from_lengths(lengths, DEV)
    out = invariant.varlen_attention(q, k, v, ctx.cu_seqlens, ctx.pad_index, ctx.valid, window)
    kc, vc, tables = paged(k, v, lengths)
    seq = torch.repeat_interleave(torch.arange(2, device=DEV), torch.tensor(lengths, device=DEV))
    pos = torch.cat([torch.arange(n, device=DEV) for n in lengths])
    rows = invariant.paged_decode(q, kc, vc, tables[seq], (pos + 1).to(torch.int32), window)
    assert torch.equal(out, rows)
