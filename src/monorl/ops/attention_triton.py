"""The one Triton attention kernel of monorl: varlen-causal (packed sequences) and paged decode (keys read
through a block table) in one code path.

Every query walks its keys in blocks of `ATTN_BLOCK_N` from position 0 with the same online-softmax
update; only the key addressing differs between the layouts. So a token's output is the same function of
its q and its keys in both, which is what makes `attention_invariant` batch-invariant; the generator's
ordinary paged decode (`monorl.generate.attention`) runs the same kernel for its speed: it reads only
each sequence's `seq_len` keys.
"""

from __future__ import annotations

import torch
from torch import Tensor

from monorl.ops import HAS_TRITON

ATTN_BLOCK_N = 64  # keys per block (both layouts)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, kbase_ptr, lens_ptr, bt_ptr,
                     stride_qt, stride_qh, stride_kblk, stride_ktok, stride_kh, stride_btb,
                     stride_ot, stride_oh, scale,
                     PAGED: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                     BS: tl.constexpr, BLOCK_N: tl.constexpr):
        # One program per (query token, kv head); the G query heads of that kv head are the rows. Only the
        # key addressing differs between layouts (PAGED): the arithmetic below is one code path.
        r = tl.program_id(0)
        hk = tl.program_id(1)
        seqlen = tl.load(lens_ptr + r)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        gmask = offs_g < G
        q = tl.load(q_ptr + r * stride_qt + (hk * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                    mask=gmask[:, None], other=0.0)
        m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GP], dtype=tl.float32)
        acc = tl.zeros([GP, D], dtype=tl.float32)
        if not PAGED:
            kbase = tl.load(kbase_ptr + r).to(tl.int64)
        for start in range(0, seqlen, BLOCK_N):
            tok = start + offs_n
            nmask = tok < seqlen
            if PAGED:
                blk = tl.load(bt_ptr + r * stride_btb + tok // BS, mask=nmask, other=0)
                off = blk.to(tl.int64) * stride_kblk + (tok % BS) * stride_ktok + hk * stride_kh
            else:
                off = (kbase + tok) * stride_ktok + hk * stride_kh
            k = tl.load(k_ptr + off[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + off[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + r * stride_ot + (hk * G + offs_g)[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=gmask[:, None])


def attention_triton(q: Tensor, k: Tensor, v: Tensor, kbase: Tensor | None, lens: Tensor,
                     block_tables: Tensor | None) -> Tensor:
    """q [R, Hq, D]. Varlen: k/v [T, Hkv, D], row r attends keys kbase[r] .. kbase[r]+lens[r]-1.
    Paged: k/v caches [N, BS, Hkv, D], row r attends its table's first lens[r] keys."""
    R, Hq, D = q.shape
    Hkv = k.shape[-2]
    G = Hq // Hkv
    q = q.contiguous()
    out = torch.empty_like(q)
    if R == 0:
        return out
    paged = block_tables is not None
    if paged:
        bs, s_blk, s_tok, s_h, s_bt = k.shape[1], k.stride(0), k.stride(1), k.stride(2), block_tables.stride(0)
        kbase = lens  # unused
    else:
        k, v = k.contiguous(), v.contiguous()
        bs, s_blk, s_tok, s_h, s_bt = 1, 0, k.stride(0), k.stride(1), 0
        block_tables = lens  # unused
    _attn_kernel[(R, Hkv)](
        q, k, v, out, kbase, lens, block_tables,
        q.stride(0), q.stride(1), s_blk, s_tok, s_h, s_bt, out.stride(0), out.stride(1), D ** -0.5,
        PAGED=paged, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BS=bs, BLOCK_N=ATTN_BLOCK_N, num_warps=4)
    return out
