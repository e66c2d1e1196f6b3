"""Attention metadata and backends: the one seam between the model and how tokens are laid out.

The model never sees padding or caches. Each attention layer hands its q, k, v (after RoPE) to an
`AttentionContext`, which knows the layout of the current forward:

- `VarlenContext`: packed sequences (training, or a prefill that keeps no cache): flat tokens
  `[T]` and `cu_seqlens`, causal within each sequence.
- the generator's prefill / decode contexts (`monorl.generate`) implement the same `attend`
  and additionally read and write the per-layer KV cache passed in `cache`.

Two backends compute varlen causal attention: "sdpa" (portable, CPU and GPU: the pack gathered
into a padded batch, one causal scaled_dot_product_attention) and "flash"
(`torch.nn.attention.varlen.varlen_attn`, CUDA, bf16/fp16). "auto" picks flash where it can.
A third, "invariant" (`monorl.ops.attention.invariant`), is no user's choice: a batch-invariant model
(`monorl.model.batch_invariant`) rebinds every context it is given to it (`batch_invariant()`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, get_args

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from monorl.compile import mark_dynamic
from monorl.ops.attention import invariant as attention_invariant
from monorl.ops.row_copies import sum_row_copies, take_rows
from monorl.speedups.private_apis import flash_attention_forward, flash_window

AttnBackend = Literal["auto", "sdpa", "flash"]
BACKENDS: tuple[str, ...] = get_args(AttnBackend)


class AttentionContext(Protocol):
    slot_mapping: Tensor | None  # int64 [T]: each token's KV-cache slot (None when the context keeps no cache)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache: Any, kv_written: bool = False, window: int = 0,
               sinks: Tensor | None = None) -> Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] (RoPE applied) -> [T, Hq, D]. `cache` is this
        layer's KV-cache entry (None when the context keeps no cache); kv_written: the caller already wrote
        k/v to `cache` at `slot_mapping` (the fused kernels' model does, in its q/k pass); window: a query at
        position p sees keys p - window + 1 .. p only (a sliding-window layer; 0: every key up to p); sinks: [Hq]
        a learned logit per head added to the softmax's denominator (GPT-OSS: a key with that score and a zero
        value; `sdpa_masked`)."""
        ...

    def batch_invariant(self) -> AttentionContext:
        """The same layout, attended by the batch-invariant kernel (`monorl.ops.attention.invariant`)."""
        ...


def flash_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose from {BACKENDS}")
    if backend == "auto":
        return "flash" if flash_available(device, dtype) else "sdpa"
    if backend == "flash" and not flash_available(device, dtype):
        raise ValueError(f"attention backend 'flash' needs CUDA and bf16/fp16, got {device} {dtype}")
    return backend


def sdpa_masked(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, sinks: Tensor | None = None) -> Tensor:
    """scaled_dot_product_attention of q [B, Hq, Lq, D] over k/v [B, Hkv, Lk, D] under a bool `mask` (True: seen),
    GQA by head groups. sinks [Hq]: each head's softmax also counts exp(sink) in its denominator (HF's GptOss
    eager attention), as one more key of score `sink` and value 0: the mask becomes additive, that key's column
    the sink (differentiable: the sinks get their gradient through the mask)."""
    gqa = q.shape[1] != k.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    zero = k.new_zeros(*k.shape[:2], 1, k.shape[3])
    k, v = torch.cat([k, zero], 2), torch.cat([v, zero], 2)
    B, Hq, Lq = q.shape[0], q.shape[1], q.shape[2]
    bias = q.new_zeros(mask.shape).masked_fill(~mask, float("-inf")).expand(B, Hq, Lq, mask.shape[3])
    bias = torch.cat([bias, sinks.to(q.dtype)[None, :, None, None].expand(B, Hq, Lq, 1)], -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=gqa)


def sdpa_varlen(q: Tensor, k: Tensor, v: Tensor, pad_index: Tensor, valid: Tensor, window: int = 0,
                sinks: Tensor | None = None) -> Tensor:
    """Portable varlen causal attention: gather the pack into a padded [B, L] batch (`pad_index`
    points into the flat tokens, `valid` marks real slots), one causal SDPA, then drop the padding.
    Cost O(B * L^2), not O(T^2): packs of many short sequences stay cheap on CPU. window: see
    `AttentionContext.attend` (and sinks)."""
    def padded(x: Tensor) -> Tensor:  # [T, H, D] -> [B, H, L, D]; index T is a zero row for padding
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
        return x[pad_index].transpose(1, 2)

    L = pad_index.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    if window:
        causal = causal.triu(1 - window)
    # key 0 stays visible to every row: a zero-length entry (static packs pad the sequence count with
    # them) would otherwise be all-masked and give NaN; its rows are dropped below anyway
    first = torch.arange(L, device=q.device) == 0
    keys = valid | first
    mask = causal[None, None] & keys[:, None, None, :]
    if window:  # a padding row may have no key in its window: it sees key 0 (and is dropped)
        mask = mask | (~valid[:, None, :, None] & first)
    out = sdpa_masked(padded(q), padded(k), padded(v), mask, sinks)
    return out.transpose(1, 2)[valid]  # sequences are laid out in order, so this is the flat order


# torch's varlen_attn and whether it takes GQA keys: it gained enable_gqa in torch 2.12; torch 2.11 (the oldest we
# support) has window_size only, and there the kv heads are expanded. Loaded by the first flash context
# (`VarlenContext.__post_init__`, eager code, so traced code sees constants), not at import: its module imports
# torch._dynamo (~1 s), which a run on the sdpa or batch-invariant kernels and no compile never needs.
_FLASH_VARLEN: tuple[Callable[..., Tensor], bool] | None = None


def _load_flash_varlen() -> tuple[Callable[..., Tensor], bool]:
    global _FLASH_VARLEN
    if _FLASH_VARLEN is None:
        from torch.nn.attention.varlen import varlen_attn
        _FLASH_VARLEN = varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters
    return _FLASH_VARLEN


def flash_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int | torch.SymInt,
                 window: int = 0) -> Tensor:
    """window: see `AttentionContext.attend` (flash's window_size (window - 1, 0))."""
    varlen_attn, takes_gqa = _load_flash_varlen()
    left = window - 1 if window else -1
    kw: dict[str, Any] = {}
    if k.shape[1] != q.shape[1]:
        if takes_gqa:
            kw["enable_gqa"] = True
        elif not torch.is_grad_enabled():
            # the flash kernel itself takes fewer kv heads (query head h reads kv head h // group); only torch
            # 2.11's wrapper has no flag for it. Without autograd, call the kernel: no expanded copies of k and v
            # (two copies a layer, ~40 ms of a 0.45 s prefill total in benchmarks/bench_throughput.py, H200)
            return flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                           0.0, True, False, **flash_window(window))[0]
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, window_size=(left, 0), **kw)


class _ExpandCopies(torch.autograd.Function):
    """x [T, H, D] of a pack's unique tokens -> [T_full, H, D], each sequence's own copy of its tokens
    (`SharedPrompts.expand_index`). Backward sums each token's copies (`SharedPrompts.copies`) in fp32, in a fixed
    order (deterministic: no atomics); with `pick` only its first copy's gradient is taken, which is exact for the
    queries: a copy whose output is dropped (`attend` keeps each token's first) has a zero query gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, expand_index: Tensor, copies: Tensor, pick: bool) -> Tensor:
        ctx.save_for_backward(copies)
        ctx.pick = pick
        return x[expand_index]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (copies,) = ctx.saved_tensors
        if ctx.pick:
            return grad[copies[:, 0]], None, None, None
        return sum_row_copies(grad, copies), None, None, None


@dataclass
class SharedPrompts:
    """A pack whose prompt groups hold their prompt's tokens once (`monorl.train.packing`): the model's per-token
    work runs on the T unique tokens, and attention on the T_full tokens of every sequence laid out whole, as an
    unshared pack would be (the context's cu_seqlens / pad_index / valid describe that layout), so each token's
    attention output is what it is without sharing."""

    expand_index: Tensor  # int64 [T_full]: the unique token each full-layout row copies
    copies: Tensor  # int64 [T, C]: each unique token's full-layout rows, the first one first; T_full where absent

    def expand(self, x: Tensor, pick: bool = False) -> Tensor:
        return _ExpandCopies.apply(x, self.expand_index, self.copies, pick)

    def contract(self, out: Tensor) -> Tensor:
        """The full layout's attention output -> each unique token's (its first copy's)."""
        return take_rows(out, self.copies[:, 0])


def positions_of(lengths: list[int] | Tensor | np.ndarray) -> Tensor:
    """Each token's position within its sequence, for sequences of `lengths` laid end to end (int64, CPU). In numpy:
    torch's CPU `repeat_interleave` took ~5 ms a call on 45k positions on a 64-core host (a turn boundary's index
    build: 43 ms of its 99 ms host time, profiled on an H100 host)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    return torch.from_numpy(np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths))


@dataclass
class VarlenContext:
    """Packed causal sequences, no KV cache. Build with `VarlenContext.from_lengths`. With `shared`, the pack holds
    shared prompts once (see `SharedPrompts`): `positions` are the unique tokens', the rest the full layout's."""

    cu_seqlens: Tensor  # int32 [B+1]
    max_seqlen: int
    positions: Tensor  # int64 [T], position within its sequence
    pad_index: Tensor  # int64 [B, max_seqlen] flat index of each (sequence, position); T where padding (sdpa)
    valid: Tensor  # bool [B, max_seqlen]
    backend: str = "sdpa"  # sdpa | flash | invariant (see `batch_invariant`)
    shared: SharedPrompts | None = None
    slot_mapping: ClassVar[None] = None  # no KV cache

    def __post_init__(self) -> None:
        if self.backend == "flash":
            _load_flash_varlen()

    @staticmethod
    def from_lengths(lengths: list[int] | Tensor, device: torch.device | str, backend: str = "sdpa",
                     max_seqlen: int | None = None, shared: SharedPrompts | None = None,
                     positions: Tensor | None = None) -> VarlenContext:
        """`lengths` may end in zero-length entries (a static pack pads its sequence count with them);
        `max_seqlen` (>= every length) fixes the attention bound, for a CUDA graph replayed on other packs.
        shared (with the unique tokens' `positions`, int64): the lengths are the full layout's."""
        lengths = np.asarray(lengths, dtype=np.int64)  # numpy: see `positions_of`
        if lengths.size == 0 or bool((lengths < 0).any()) or int(lengths.sum()) == 0:
            raise ValueError(f"sequence lengths must be >= 0 with at least one token, got {lengths.tolist()}")
        cu = np.zeros(len(lengths) + 1, dtype=np.int32)
        cu[1:] = np.cumsum(lengths)
        T, L = int(cu[-1]), int(lengths.max())
        if max_seqlen is not None:
            if max_seqlen < L:
                raise ValueError(f"max_seqlen={max_seqlen} is below the longest sequence ({L})")
            L = max_seqlen
        col = np.arange(L, dtype=np.int64)
        valid_np = col[None, :] < lengths[:, None]
        valid = torch.from_numpy(valid_np)
        pad_index = torch.from_numpy(np.where(valid_np, cu[:-1, None].astype(np.int64) + col[None, :], T))
        cu = torch.from_numpy(cu)
        if shared is not None:
            if positions is None or shared.expand_index.numel() != T:
                raise ValueError(f"a shared-prompt pack needs the unique tokens' positions and {T} expand rows")
        else:
            positions = positions_of(lengths)
        ctx = VarlenContext(
            cu_seqlens=cu.to(device), max_seqlen=L, positions=positions.to(device),
            pad_index=pad_index.to(device), valid=valid.to(device), backend=backend, shared=shared,
        )
        # the number and lengths of packed sequences vary every call: compile for any from the start
        mark_dynamic(ctx.cu_seqlens, ctx.positions, ctx.pad_index, ctx.valid)
        if shared is not None:
            mark_dynamic(shared.expand_index)
            mark_dynamic(shared.copies, dims=(0,))
        return ctx

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache: Any = None, kv_written: bool = False,
               window: int = 0, sinks: Tensor | None = None) -> Tensor:
        if self.shared is not None:
            sh = self.shared
            return sh.contract(self._attend(sh.expand(q, pick=True), sh.expand(k), sh.expand(v), window, sinks))
        return self._attend(q, k, v, window, sinks)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, window: int = 0, sinks: Tensor | None = None) -> Tensor:
        # invariant: the same kernel (and key-block order) as the invariant decode. flash with sinks (GPT-OSS):
        # varlen_attn takes none, so that op too: the Triton kernel's forward, sinks in its softmax state, and flash
        # attention's backward from its log-sum-exp (exact with sinks: `bi_varlen_attn_backward`). The sinks as the
        # compute dtype holds them: a trainer's fp32 masters rounded as the generator's bf16 copy (its gradient
        # passes the cast)
        sinks = None if sinks is None else sinks.to(q.dtype)
        if self.backend == "invariant" or (self.backend == "flash" and sinks is not None):
            return attention_invariant.varlen_attention(q, k, v, self.cu_seqlens, self.pad_index, self.valid, window,
                                                        sinks)
        if self.backend == "flash":
            # max_seqlen as a tensor size, not the Python int: compiled code then never specialises on it
            return flash_varlen(q, k, v, self.cu_seqlens, self.valid.shape[1], window)
        return sdpa_varlen(q, k, v, self.pad_index, self.valid, window, sinks)

    def batch_invariant(self) -> VarlenContext:
        return dataclasses.replace(self, backend="invariant")
