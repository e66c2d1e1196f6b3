"""The generator's attention contexts: prefill (write prompt KV, varlen causal attention) and decode
(write one token's KV per sequence, attend over the paged cache). Both implement
`monorl.model.attention.AttentionContext`, so the one model definition runs them unchanged.

Decode backends:
- "torch": portable. Gathers each sequence's block table into padded K/V and runs masked SDPA.
  Reads `width * block_size` keys per sequence, so callers pass tables cut to the longest live one.
- "triton": a paged flash-decode kernel (CUDA, bf16/fp16, power-of-two head_dim), reads only
  `seq_len` keys per sequence; the CUDA-graph path needs it (its cost does not depend on table width).
- "invariant": a batch-invariant model's (`batch_invariant()`, `monorl.ops.attention_invariant`): the same
  key-block order as its varlen prefill / training path.

`attend` is one custom op per context (`monorl::prefill_attention`, `monorl::decode_attention`): the
compiler sees an opaque call that mutates this layer's cache in place, so a compiled TransformerBlock is
one graph (no graph break) that fuses everything around it, and the cache is never copied.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from monorl.compile import mark_dynamic
from monorl.model.attention import VarlenContext
from monorl.ops import HAS_TRITON, attention_invariant, custom_op, sm_count
from monorl.ops.attention_triton import attention_triton, decode_splits
from monorl.ops.block_kernels import write_kv
from monorl.ops.tunables import chip_of


@custom_op("monorl::prefill_attention", mutates_args=("cache",))
def prefill_attention(q: Tensor, k: Tensor, v: Tensor, cache: Tensor, slot_mapping: Tensor, cu_seqlens: Tensor,
                      positions: Tensor, pad_index: Tensor, valid: Tensor, backend: str, kv_written: bool) -> Tensor:
    """Write the prompts' k/v to `slot_mapping` (unless the caller did), then varlen causal attention within each
    prompt. max_seqlen is `valid.shape[1]`: a tensor size, so compiled code sees no Python int to specialise on."""
    if not kv_written:
        write_kv(k, v, cache, slot_mapping)
    varlen = VarlenContext(cu_seqlens, valid.shape[1], positions, pad_index, valid, backend)
    return varlen.attend(q, k, v).contiguous()


@prefill_attention.register_fake
def _(q, k, v, cache, slot_mapping, cu_seqlens, positions, pad_index, valid, backend, kv_written):
    return torch.empty_like(q)


@custom_op("monorl::decode_attention", mutates_args=("cache",))
def decode_attention(q: Tensor, k: Tensor, v: Tensor, cache: Tensor, slot_mapping: Tensor, block_tables: Tensor,
                     seq_lens: Tensor, backend: str, kv_written: bool) -> Tensor:
    """Write each sequence's new k/v (unless the caller did), then attend over its paged cache (seq_lens include
    the new token)."""
    if not kv_written:
        write_kv(k, v, cache, slot_mapping)
    if backend == "invariant":  # same kernel and key-block order as the varlen (prefill / trainer) path
        out = attention_invariant.paged_decode(q, cache[0], cache[1], block_tables, seq_lens)
    elif backend == "triton":
        out = paged_decode_triton(q, cache[0], cache[1], block_tables, seq_lens)
    else:
        out = paged_decode_torch(q, cache[0], cache[1], block_tables, seq_lens)
    return out.contiguous()  # the layout the fake (compile-time) output promises


@decode_attention.register_fake
def _(q, k, v, cache, slot_mapping, block_tables, seq_lens, backend, kv_written):
    return torch.empty_like(q)


@dataclass
class PrefillContext:
    """Packed prompts: writes each token's k/v to `slot_mapping`, attends causally within each prompt."""

    varlen: VarlenContext
    slot_mapping: Tensor  # int64 [T]

    def __post_init__(self) -> None:
        mark_dynamic(self.slot_mapping)  # prompt tokens vary: one dynamic compile

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache: Tensor, kv_written: bool = False) -> Tensor:
        c = self.varlen
        return prefill_attention(q, k, v, cache, self.slot_mapping, c.cu_seqlens, c.positions, c.pad_index, c.valid,
                                 c.backend, kv_written)

    def batch_invariant(self) -> PrefillContext:
        return dataclasses.replace(self, varlen=self.varlen.batch_invariant())


@dataclass
class DecodeContext:
    """One query token per sequence. seq_lens includes the current token (its k/v is written first)."""

    block_tables: Tensor  # int32 [B, W]
    seq_lens: Tensor  # int32 [B]
    slot_mapping: Tensor  # int64 [B]
    backend: str = "torch"  # torch | triton | invariant (see the module docstring)

    def __post_init__(self) -> None:
        # batch buckets (and, eager, table widths) vary: compile once for any, not once static then dynamic
        mark_dynamic(self.block_tables, self.seq_lens, self.slot_mapping)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache: Tensor, kv_written: bool = False) -> Tensor:
        return decode_attention(q, k, v, cache, self.slot_mapping, self.block_tables, self.seq_lens, self.backend,
                                kv_written)

    def batch_invariant(self) -> DecodeContext:
        return dataclasses.replace(self, backend="invariant")


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


def paged_decode_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                        seq_lens: Tensor) -> Tensor:
    """Paged flash-decode: the one Triton attention kernel of monorl (`monorl.ops.attention_triton`), which the
    batch-invariant ops also run for varlen prefill/training. Programs per (sequence, kv head), keys in blocks of
    64 read through the block table; only seq_len keys are read. Few sequences split their keys over several
    programs (`decode_splits`: a function of the row count, so one CUDA graph per batch bucket keeps its
    launch)."""
    splits = paged_decode_splits(q.shape[0], k_cache.shape[-2], q.device)
    return attention_triton(q, k_cache, v_cache, seq_lens, block_tables, splits)


def paged_decode_splits(rows: int, kv_heads: int, device: torch.device) -> int:
    """How many parts `paged_decode_triton` splits each row's keys into, for `rows` sequences on `device`."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return decode_splits(rows, kv_heads, sm_count(index), chip=chip_of(index))
