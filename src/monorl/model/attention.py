"""Attention metadata and backends: the one seam between the model and how tokens are laid out.

The model never sees padding or caches. Each attention layer hands its q, k, v (after RoPE) to an
`AttentionContext`, which knows the layout of the current forward:

- `VarlenContext`: packed sequences (training, or a prefill that keeps no cache): flat tokens
  `[T]` and `cu_seqlens`, causal within each sequence.
- the generator's prefill / decode contexts (`monorl.generate`) implement the same `attend`
  and additionally read and write the per-layer KV cache passed in `cache`.

Two backends compute varlen causal attention: "sdpa" (portable, CPU and GPU: one
scaled_dot_product_attention over the pack with a block-diagonal causal mask) and "flash"
(`torch.nn.attention.varlen.varlen_attn`, CUDA, bf16/fp16). "auto" picks flash where it can.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

BACKENDS = ("auto", "sdpa", "flash")


class AttentionContext(Protocol):
    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache: Any) -> Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] (RoPE applied) -> [T, Hq, D]. `cache` is this
        layer's KV-cache entry (None when the context keeps no cache)."""
        ...


def flash_available(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose from {BACKENDS}")
    if backend == "auto":
        return "flash" if flash_available(device, dtype) else "sdpa"
    if backend == "flash" and not flash_available(device, dtype):
        raise ValueError(f"attention backend 'flash' needs CUDA and bf16/fp16, got {device} {dtype}")
    return backend


def sdpa_varlen(q: Tensor, k: Tensor, v: Tensor, seq_ids: Tensor, positions: Tensor) -> Tensor:
    """Portable varlen causal attention: one SDPA over the whole pack, masked so each token sees
    only earlier tokens of its own sequence. O(T^2) memory: meant for CPU and tests."""
    mask = (seq_ids[:, None] == seq_ids[None, :]) & (positions[:, None] >= positions[None, :])
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)


def flash_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
    from torch.nn.attention.varlen import varlen_attn

    if k.shape[1] != q.shape[1]:
        try:
            return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                               window_size=(-1, 0), enable_gqa=True)
        except TypeError:  # older varlen_attn without enable_gqa: expand kv heads
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    try:
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, window_size=(-1, 0))
    except TypeError:  # older signature: is_causal flag
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, is_causal=True)


@dataclass
class VarlenContext:
    """Packed causal sequences, no KV cache. Build with `VarlenContext.from_lengths`."""

    cu_seqlens: Tensor  # int32 [B+1]
    max_seqlen: int
    seq_ids: Tensor  # int64 [T], which sequence each token belongs to (sdpa mask)
    positions: Tensor  # int64 [T], position within its sequence
    backend: str = "sdpa"

    @staticmethod
    def from_lengths(lengths: list[int] | Tensor, device: torch.device | str, backend: str = "sdpa") -> VarlenContext:
        lengths = torch.as_tensor(lengths, dtype=torch.int64, device="cpu")
        if lengths.numel() == 0 or bool((lengths <= 0).any()):
            raise ValueError(f"sequence lengths must be positive, got {lengths.tolist()}")
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lengths, 0)
        seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        starts = torch.repeat_interleave(cu[:-1].long(), lengths)
        positions = torch.arange(int(cu[-1])) - starts
        return VarlenContext(
            cu_seqlens=cu.to(device), max_seqlen=int(lengths.max()), seq_ids=seq_ids.to(device),
            positions=positions.to(device), backend=backend,
        )

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache: Any = None) -> Tensor:
        if self.backend == "flash":
            return flash_varlen(q, k, v, self.cu_seqlens, self.max_seqlen)
        return sdpa_varlen(q, k, v, self.seq_ids, self.positions)
