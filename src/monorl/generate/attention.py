"""The generator's attention contexts: prefill (write prompt KV, varlen causal attention) and decode
(write one token's KV per sequence, attend over the paged cache). Both implement
`monorl.model.attention.AttentionContext`, so the one model definition runs them unchanged.

Decode backends:
- "torch": portable. Gathers each sequence's block table into padded K/V and runs masked SDPA.
  Reads `width * block_size` keys per sequence, so callers pass tables cut to the longest live one.
- "triton": a paged flash-decode kernel (CUDA, bf16/fp16, power-of-two head_dim), reads only
  `seq_len` keys per sequence; the CUDA-graph path needs it (its cost does not depend on table width).

`attend` is excluded from torch.compile (the cache write mutates a large buffer, and the Triton
launch is opaque), so regional compile of a TransformerBlock fuses everything around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from monorl.model.attention import VarlenContext
from monorl.ops import batch_invariant as bi

try:  # triton only exists on the GPU machines
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised on CPU CI
    HAS_TRITON = False


def _write_kv(k: Tensor, v: Tensor, cache: tuple[Tensor, Tensor], slots: Tensor) -> None:
    k_cache, v_cache = cache
    Hkv, D = k_cache.shape[-2:]
    k_cache.view(-1, Hkv, D).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, Hkv, D).index_copy_(0, slots, v.to(v_cache.dtype))


@dataclass
class PrefillContext:
    """Packed prompts: writes each token's k/v to `slot_mapping`, attends causally within each prompt."""

    varlen: VarlenContext
    slot_mapping: Tensor  # int64 [T]

    @torch.compiler.disable
    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache: Any) -> Tensor:
        _write_kv(k, v, cache, self.slot_mapping)
        return self.varlen.attend(q, k, v)


@dataclass
class DecodeContext:
    """One query token per sequence. seq_lens includes the current token (its k/v is written first)."""

    block_tables: Tensor  # int32 [B, W]
    seq_lens: Tensor  # int32 [B]
    slot_mapping: Tensor  # int64 [B]
    backend: str = "torch"

    @torch.compiler.disable
    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache: Any) -> Tensor:
        _write_kv(k, v, cache, self.slot_mapping)
        if bi.is_enabled():  # same kernel and key-block order as the varlen (prefill / trainer) path
            return bi.paged_decode(q, cache[0], cache[1], self.block_tables, self.seq_lens)
        if self.backend == "triton":
            return paged_decode_triton(q, cache[0], cache[1], self.block_tables, self.seq_lens)
        return paged_decode_torch(q, cache[0], cache[1], self.block_tables, self.seq_lens)


def paged_decode_torch(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor) -> Tensor:
    """q [B, Hq, D]; caches [N, bs, Hkv, D]; block_tables [B, W]; seq_lens [B] -> [B, Hq, D]."""
    B, W = block_tables.shape
    bs, Hkv, D = k_cache.shape[1:]
    idx = block_tables.long()
    k = k_cache[idx].view(B, W * bs, Hkv, D).transpose(1, 2)
    v = v_cache[idx].view(B, W * bs, Hkv, D).transpose(1, 2)
    mask = torch.arange(W * bs, device=q.device)[None, :] < seq_lens[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k.to(q.dtype), v.to(q.dtype),
                                         attn_mask=mask[:, None, None, :], enable_gqa=q.shape[1] != Hkv)
    return out[:, :, 0, :]


def triton_decode_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    return (HAS_TRITON and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and head_dim >= 16 and head_dim & (head_dim - 1) == 0)


if HAS_TRITON:

    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, lens_ptr,
                             stride_qb, stride_qh, stride_kblk, stride_ktok, stride_kh, stride_btb,
                             stride_ob, stride_oh, scale,
                             G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                             BLOCK_N: tl.constexpr):
        # One program per (sequence, kv head): the G query heads of that kv head share each K/V load.
        b = tl.program_id(0)
        hk = tl.program_id(1)
        seqlen = tl.load(lens_ptr + b)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        gmask = offs_g < G
        q = tl.load(q_ptr + b * stride_qb + (hk * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                    mask=gmask[:, None], other=0.0)
        m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GP], dtype=tl.float32)
        acc = tl.zeros([GP, D], dtype=tl.float32)
        for start in range(0, seqlen, BLOCK_N):
            tok = start + offs_n
            nmask = tok < seqlen
            blk = tl.load(bt_ptr + b * stride_btb + tok // BS, mask=nmask, other=0)
            off = blk.to(tl.int64) * stride_kblk + (tok % BS) * stride_ktok + hk * stride_kh
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
        tl.store(o_ptr + b * stride_ob + (hk * G + offs_g)[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=gmask[:, None])


def paged_decode_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                        seq_lens: Tensor) -> Tensor:
    B, Hq, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    q = q.contiguous()
    out = torch.empty_like(q)
    block_n = 64 if bs <= 64 else bs
    _paged_decode_kernel[(B, Hkv)](
        q, k_cache, v_cache, out, block_tables, seq_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), D ** -0.5,
        G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BS=bs, BLOCK_N=block_n, num_warps=4,
    )
    return out
