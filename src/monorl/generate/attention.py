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
    return (bi.HAS_TRITON and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and head_dim >= 16 and head_dim & (head_dim - 1) == 0)


def paged_decode_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                        seq_lens: Tensor) -> Tensor:
    """Paged flash-decode: the one Triton attention kernel of monorl (`ops.batch_invariant`), which the
    batch-invariant mode also uses for varlen prefill/training. One program per (sequence, kv head), keys
    in blocks of 64 read through the block table; only seq_len keys are read."""
    return bi.attention_triton(q, k_cache, v_cache, None, seq_lens, block_tables)
