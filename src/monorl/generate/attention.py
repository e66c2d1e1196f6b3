"""The generator's attention contexts: prefill (write prompt KV, varlen causal attention), decode (write one
token's KV per sequence, attend over the paged cache) and cached prefill (an episode's next turn: new tokens of
several sequences attend their cached prefix and each other). All implement
`monorl.model.attention.AttentionContext`, so the one model definition runs them unchanged.

Decode backends:
- "torch": portable. Gathers each sequence's block table into padded K/V and runs masked SDPA.
  Reads `width * block_size` keys per sequence, so callers pass tables cut to the longest live one.
- "triton": a paged flash-decode kernel (CUDA, bf16/fp16, power-of-two head_dim), reads only
  `seq_len` keys per sequence; the CUDA-graph path needs it (its cost does not depend on table width).
- "invariant": a batch-invariant model's (`batch_invariant()`, `monorl.ops.attention.invariant`): the same
  key-block order as its varlen prefill / training path.

`attend` is one custom op per context (`monorl::prefill_attention`, `monorl::decode_attention`,
`monorl::cached_prefill_attention`): the compiler sees an opaque call that mutates this layer's cache in place, so
a compiled TransformerBlock is one graph (no graph break) that fuses everything around it, and the cache is never
copied.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from monorl.compile import mark_dynamic
from monorl.generate.cache import blocks_for, table_tensor
from monorl.model.attention import VarlenContext, positions_of, sdpa_masked
from monorl.model.pack_layout import bucket_size, filler_lengths, next_pow2, static_max_seqlen
from monorl.ops import HAS_TRITON, custom_op, sm_count
from monorl.ops.attention import invariant as attention_invariant
from monorl.ops.attention.kernel import attention_triton, cached_attention_triton, decode_splits
from monorl.ops.block_kernels import write_kv
from monorl.ops.tunables import chip_of
from monorl.speedups.private_apis import flash_attention_forward, flash_window


@custom_op("monorl::prefill_attention", mutates_args=("cache",))
def prefill_attention(q: Tensor, k: Tensor, v: Tensor, cache: Tensor, slot_mapping: Tensor, cu_seqlens: Tensor,
                      positions: Tensor, pad_index: Tensor, valid: Tensor, backend: str, kv_written: bool,
                      window: int = 0, sinks: Tensor | None = None) -> Tensor:
    """Write the prompts' k/v to `slot_mapping` (unless the caller did), then varlen causal attention within each
    prompt. max_seqlen is `valid.shape[1]`: a tensor size, so compiled code sees no Python int to specialise on."""
    if not kv_written:
        write_kv(k, v, cache, slot_mapping)
    varlen = VarlenContext(cu_seqlens, valid.shape[1], positions, pad_index, valid, backend)
    return varlen.attend(q, k, v, window=window, sinks=sinks).contiguous()


@prefill_attention.register_fake
def _(q, k, v, cache, slot_mapping, cu_seqlens, positions, pad_index, valid, backend, kv_written, window=0,
      sinks=None):
    return torch.empty_like(q)


@custom_op("monorl::decode_attention", mutates_args=("cache",))
def decode_attention(q: Tensor, k: Tensor, v: Tensor, cache: Tensor, slot_mapping: Tensor, block_tables: Tensor,
                     seq_lens: Tensor, backend: str, kv_written: bool, window: int = 0,
                     sinks: Tensor | None = None) -> Tensor:
    """Write each sequence's new k/v (unless the caller did), then attend over its paged cache (seq_lens include
    the new token); with a window, over its last `window` keys only (the kernels read no block before them)."""
    if not kv_written:
        write_kv(k, v, cache, slot_mapping)
    if backend == "invariant":  # same kernel and key-block order as the varlen (prefill / trainer) path
        out = attention_invariant.paged_decode(q, cache[0], cache[1], block_tables, seq_lens, window, sinks)
    elif backend == "triton":
        out = paged_decode_triton(q, cache[0], cache[1], block_tables, seq_lens, window, sinks)
    else:
        out = paged_decode_torch(q, cache[0], cache[1], block_tables, seq_lens, window, sinks)
    return out.contiguous()  # the layout the fake (compile-time) output promises


@decode_attention.register_fake
def _(q, k, v, cache, slot_mapping, block_tables, seq_lens, backend, kv_written, window=0, sinks=None):
    return torch.empty_like(q)


@dataclass
class PrefillContext:
    """Packed prompts: writes each token's k/v to `slot_mapping`, attends causally within each prompt."""

    varlen: VarlenContext
    slot_mapping: Tensor  # int64 [T]

    def __post_init__(self) -> None:
        mark_dynamic(self.slot_mapping)  # prompt tokens vary: one dynamic compile

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache: Tensor, kv_written: bool = False,
               window: int = 0, sinks: Tensor | None = None) -> Tensor:
        if hasattr(cache, "window_context"):  # a recycled window layer: its own blocks (`generate.window_cache`)
            return cache.window_context(self).attend(q, k, v, cache.kv, kv_written, window, sinks)
        c = self.varlen
        return prefill_attention(q, k, v, cache, self.slot_mapping, c.cu_seqlens, c.positions, c.pad_index, c.valid,
                                 c.backend, kv_written, window, sinks)

    def batch_invariant(self) -> PrefillContext:
        return dataclasses.replace(self, varlen=self.varlen.batch_invariant())


@dataclass
class DecodeContext:
    """One query token per sequence. seq_lens includes the current token (its k/v is written first)."""

    block_tables: Tensor  # int32 [B, W]
    seq_lens: Tensor  # int32 [B]
    slot_mapping: Tensor  # int64 [B]
    backend: str = "torch"  # torch | triton | invariant (see the module docstring)
    # `CachedPrefillContext.decode_rows`: the rows' sequences (int32 [S+1]), for layers whose state is per
    # sequence, not per key (a recurrent layer runs each sequence's rows in order); None: one row per sequence
    cu_seqlens: Tensor | None = None

    def __post_init__(self) -> None:
        # batch buckets (and, eager, table widths) vary: compile once for any, not once static then dynamic
        mark_dynamic(self.block_tables, self.seq_lens, self.slot_mapping)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache: Tensor, kv_written: bool = False,
               window: int = 0, sinks: Tensor | None = None) -> Tensor:
        if hasattr(cache, "window_context"):  # a recycled window layer: its own blocks (`generate.window_cache`)
            return cache.window_context(self).attend(q, k, v, cache.kv, kv_written, window, sinks)
        return decode_attention(q, k, v, cache, self.slot_mapping, self.block_tables, self.seq_lens, self.backend,
                                kv_written, window, sinks)

    def batch_invariant(self) -> DecodeContext:
        return dataclasses.replace(self, backend="invariant")


@custom_op("monorl::cached_prefill_attention", mutates_args=("cache",))
def cached_prefill_attention(q: Tensor, k: Tensor, v: Tensor, cache: Tensor, slot_mapping: Tensor, key_slots: Tensor,
                             cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, bounds: Tensor, block_tables: Tensor,
                             backend: str, kv_written: bool, window: int = 0, sinks: Tensor | None = None) -> Tensor:
    """Write the new tokens' k/v (unless the caller did), gather every sequence's keys and values (positions 0..,
    cached and new) from the cache into one packed pair, then one varlen attention whose sequences have more keys
    than queries, the queries being each sequence's last ones. bounds' sizes: the longest query and key runs.
    backend "paged": no gather, the Triton kernel reads each sequence's keys through its block table
    (`cached_attention_triton`), which "flash" runs too for sinks (GPT-OSS). window, sinks: see
    `AttentionContext.attend`."""
    if not kv_written:
        write_kv(k, v, cache, slot_mapping)
    if backend == "paged" or (backend == "flash" and sinks is not None):  # flash attention takes no sinks
        return cached_attention_triton(q, cache[0], cache[1], cu_seqlens_q, cu_seqlens_k, block_tables,
                                       bounds.shape[0], window, sinks).contiguous()
    # keys and values gathered as whole rows of [slots, Hkv * D] (index_select along dim 0: the vectorised row
    # gather; along dim 1 of [2, slots, Hkv, D] it ran the elementwise gather kernel, 41% of a turn boundary's GPU
    # time on an H200)
    slots = cache.flatten(1, 2)
    kv = [slots[i].flatten(1).index_select(0, key_slots).view(-1, *slots.shape[2:]).to(q.dtype) for i in (0, 1)]
    max_q, max_k = bounds.shape[0], bounds.shape[1]
    if backend == "flash":
        # flash attention's causal mask is aligned bottom-right: query i of a sequence's n sees its keys 0..len_k-n+i.
        # The ATen op (not `varlen_attn`): it takes fewer kv heads on every torch we support; no autograd here.
        out = flash_attention_forward(q, kv[0], kv[1], cu_seqlens_q, cu_seqlens_k, max_q, max_k, 0.0,
                                      True, False, **flash_window(window))[0]
    else:
        out = sdpa_cached(q, kv[0], kv[1], cu_seqlens_q, cu_seqlens_k, max_q, max_k, window, sinks)
    return out.contiguous()


@cached_prefill_attention.register_fake
def _(q, k, v, cache, slot_mapping, key_slots, cu_seqlens_q, cu_seqlens_k, bounds, block_tables, backend, kv_written,
      window=0, sinks=None):
    return torch.empty_like(q)


def sdpa_cached(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_q: int,
                max_k: int, window: int = 0, sinks: Tensor | None = None) -> Tensor:
    """Portable `cached_prefill_attention`: q [T, Hq, D] (each sequence's last queries), k/v [K, Hkv, D] (each
    sequence's keys from position 0) padded to [S, max_q] and [S, max_k], one masked SDPA: a query at position p
    sees keys 0..p. Device tensors only (no host read)."""
    T, K, S = q.shape[0], k.shape[0], cu_seqlens_q.shape[0] - 1
    dev = q.device
    len_q, len_k = cu_seqlens_q.diff().long(), cu_seqlens_k.diff().long()
    i, j = torch.arange(max_q, device=dev), torch.arange(max_k, device=dev)
    q_index = torch.where(i < len_q[:, None], cu_seqlens_q[:-1, None] + i, T)  # [S, max_q]; T: the zero row
    k_index = torch.where(j < len_k[:, None], cu_seqlens_k[:-1, None] + j, K)
    position = (len_k - len_q)[:, None] + i  # >= 0; a padding row's is past its real keys (no all-masked row)
    mask = j[None, None, :] <= position[:, :, None]  # [S, max_q, max_k]
    if window:  # (a padding row may then see no key: its NaN goes to the dropped row T)
        mask = mask & (j[None, None, :] > position[:, :, None] - window)

    def padded(x: Tensor, index: Tensor) -> Tensor:  # [N, H, D] -> [S, H, L, D]
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[index].transpose(1, 2)

    out = sdpa_masked(padded(q, q_index), padded(k, k_index), padded(v, k_index), mask[:, None], sinks)
    flat = out.new_empty(T + 1, *q.shape[1:])  # scattered by q_index (no boolean indexing: a host read); row T dropped
    flat[q_index.reshape(-1)] = out.transpose(1, 2).reshape(S * max_q, *q.shape[1:])
    return flat[:T]


CACHED_BACKENDS = ("flash", "sdpa", "paged")  # `CachedPrefillContext.backend`


@dataclass
class CachedPrefillContext:
    """New tokens of several sequences over the K/V their block tables already hold (an episode's next turn: the
    environment's tokens after its cached conversation). Sequence s's new tokens are rows cu_seqlens_q[s].. at
    positions start_s..; each attends causally to its sequence's keys 0..its position. A layer writes the new
    tokens' k/v, gathers every sequence's keys once and runs one varlen attention ("flash": CUDA, bf16/fp16; "sdpa":
    portable): cost ~ new tokens x context on tensor cores, no per-sequence launch; or ("paged": CUDA, bf16/fp16, the
    Triton kernel) reads the keys through the block tables, gathering nothing. `decode_rows` is the same work
    as one paged-decode row per new token; a batch-invariant model runs that form (its kernel is the trainer's, so a
    token's result is the trainer's bit for bit). Build with `CachedPrefillContext.build`."""

    slot_mapping: Tensor  # int64 [T]: each new token's cache slot
    positions: Tensor  # int64 [T]
    cu_seqlens_q: Tensor  # int32 [S+1]: the new tokens of each sequence
    cu_seqlens_k: Tensor  # int32 [S+1]: its keys (cached and new)
    key_slots: Tensor  # int64 [K]: each sequence's key slots (positions 0..), sequences end to end
    # no elements; sizes [max_q, max_k, 0]: bounds (>= 2: no size-1 dimension to specialise on) of the sequences'
    # query and key counts, as tensor sizes, so compiled code sees no Python int to specialise on
    bounds: Tensor
    block_tables: Tensor  # int32 [S, W]
    seq_index: Tensor  # int64 [T]: each new token's sequence
    backend: str = "sdpa"  # flash | sdpa | paged

    def __post_init__(self) -> None:
        mark_dynamic(self.slot_mapping, self.positions, self.cu_seqlens_q, self.cu_seqlens_k, self.key_slots,
                     self.block_tables, self.seq_index)
        mark_dynamic(self.bounds, dims=(0, 1))

    @staticmethod
    def build(chunks: list[list[int]], starts: list[int], tables: list[list[int]], block_size: int,
              device: torch.device, backend: str, static: bool = False) -> CachedPrefillContext:
        """chunks[s]: sequence s's new tokens (non-empty), at positions starts[s].. of block table tables[s] (which
        holds the K/V of positions 0..starts[s]-1). Index tensors are built on the host in a few vectorised ops.

        static: the layout a CUDA graph can replay for other boundaries of similar size (`ModelRunner.prefill_cached`),
        as `static_prefill_pack` lays out prompts: the new tokens rounded up to a bucket (`bucket_size`) by filler
        sequences of token 0 (each its own keys, at positions 0.., in the scratch block 0), the sequence count to a
        power of two (>= 8) with zero-length entries, the key count to a bucket (the gathered rows past the last
        sequence's are never read), the bounds and the table width to powers of two. The real sequences come first;
        every one of their rows is computed as without the padding (the ops are row- or sequence-local)."""
        if backend not in CACHED_BACKENDS:
            raise ValueError(f"cached prefill backend must be one of {CACHED_BACKENDS}, got {backend!r}")
        if not chunks or len(starts) != len(chunks) or len(tables) != len(chunks) or any(not c for c in chunks):
            raise ValueError("a cached prefill needs, per sequence, a non-empty token list, a start and a block table")
        # numpy, not torch's CPU ops: on a many-core host those cost milliseconds each at these sizes (64 episodes x
        # 700 keys: `positions_of`), and the GPU waits for them at every turn boundary
        lens_q = np.fromiter(map(len, chunks), dtype=np.int64, count=len(chunks))
        start = np.asarray(starts, dtype=np.int64)
        lens_k = start + lens_q
        ends = lens_k.tolist()
        for s, (end, table) in enumerate(zip(ends, tables, strict=True)):
            if starts[s] < 0 or len(table) < blocks_for(end, block_size):
                raise ValueError(f"sequence {s}: start {starts[s]}, end {end}: its block table covers "
                                 f"{len(table) * block_size} positions")
        width = blocks_for(max(ends), block_size)
        tables = [t[:width] for t in tables]
        if static:
            size = bucket_size(int(lens_q.sum()), 64)
            chunk = static_max_seqlen(lens_q.tolist(), size)  # a filler's tokens: within the query runs' bound
            fill = np.asarray(filler_lengths(lens_q.tolist(), size, chunk, static=True)[len(chunks):],
                              dtype=np.int64)  # fillers (keys: their own tokens), then zero-length entries
            lens_q, lens_k = np.concatenate([lens_q, fill]), np.concatenate([lens_k, fill])
            start = np.concatenate([start, np.zeros_like(fill)])
            width = next_pow2(max(width, blocks_for(chunk, block_size)))
            tables = tables + [[]] * len(fill)  # rows of zeros: the scratch block
        # paged: keys are read through the tables, so no key slots and no key bound in the shape
        key_count = 0 if backend == "paged" else bucket_size(int(lens_k.sum()), 64) if static else int(lens_k.sum())
        table_rows = table_tensor(tables, width, torch.device("cpu"))
        rows = table_rows.numpy().astype(np.int64)
        S = len(lens_q)
        seq_q = np.repeat(np.arange(S, dtype=np.int64), lens_q)
        pos_q = start[seq_q] + positions_of(lens_q).numpy()

        def slots(seq: np.ndarray, pos: np.ndarray) -> np.ndarray:
            return rows[seq, pos // block_size] * block_size + pos % block_size

        def cumulative(lengths: np.ndarray) -> np.ndarray:
            return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)

        def dev(a: np.ndarray | Tensor) -> Tensor:
            return (torch.from_numpy(a) if isinstance(a, np.ndarray) else a).to(device, non_blocking=True)

        key_slots = np.zeros(key_count, dtype=np.int64)
        if key_count:
            seq_k = np.repeat(np.arange(S, dtype=np.int64), lens_k)
            key_slots[:len(seq_k)] = slots(seq_k, positions_of(lens_k).numpy())

        def bound(n: int) -> int:  # >= 2 (no size-1 dimension); static: a power of two
            return next_pow2(n, 16) if static else max(2, n)

        max_q, max_k = bound(int(lens_q.max())), bound(int(lens_k.max())) if key_count else 2
        return CachedPrefillContext(
            slot_mapping=dev(slots(seq_q, pos_q)), positions=dev(pos_q), cu_seqlens_q=dev(cumulative(lens_q)),
            cu_seqlens_k=dev(cumulative(lens_k)), key_slots=dev(key_slots),
            bounds=torch.empty(max_q, max_k, 0, device=device), block_tables=dev(table_rows),
            seq_index=dev(seq_q), backend=backend)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache: Tensor, kv_written: bool = False,
               window: int = 0, sinks: Tensor | None = None) -> Tensor:
        if hasattr(cache, "window_context"):  # a recycled window layer: its own blocks (`generate.window_cache`)
            return cache.window_context(self).attend(q, k, v, cache.kv, kv_written, window, sinks)
        return cached_prefill_attention(q, k, v, cache, self.slot_mapping, self.key_slots, self.cu_seqlens_q,
                                        self.cu_seqlens_k, self.bounds, self.block_tables, self.backend, kv_written,
                                        window, sinks)

    def decode_rows(self, backend: str) -> DecodeContext:
        """The same attention as one paged-decode row per new token (its seq_len: its position + 1; every row's k/v
        is written before any row attends), on a decode backend (torch | triton | invariant)."""
        return DecodeContext(block_tables=self.block_tables.index_select(0, self.seq_index),
                             seq_lens=(self.positions + 1).to(torch.int32), slot_mapping=self.slot_mapping,
                             backend=backend, cu_seqlens=self.cu_seqlens_q)

    def batch_invariant(self) -> DecodeContext:
        return self.decode_rows("invariant")


def paged_decode_torch(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                       window: int = 0, sinks: Tensor | None = None) -> Tensor:
    """q [B, Hq, D]; caches [N, bs, Hkv, D]; block_tables [B, W]; seq_lens [B] -> [B, Hq, D]; window: only the last
    `window` keys."""
    B, W = block_tables.shape
    bs, Hkv, D = k_cache.shape[1:]
    idx = block_tables.long()
    k = k_cache[idx].view(B, W * bs, Hkv, D).transpose(1, 2)
    v = v_cache[idx].view(B, W * bs, Hkv, D).transpose(1, 2)
    key = torch.arange(W * bs, device=q.device)[None, :]
    mask = key < seq_lens[:, None]
    if window:
        mask = mask & (key >= seq_lens[:, None] - window)
    out = sdpa_masked(q[:, :, None, :], k.to(q.dtype), v.to(q.dtype), mask[:, None, None, :], sinks)
    return out[:, :, 0, :]


def triton_decode_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    return (HAS_TRITON and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and head_dim >= 16 and head_dim & (head_dim - 1) == 0)


def paged_decode_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                        seq_lens: Tensor, window: int = 0, sinks: Tensor | None = None) -> Tensor:
    """Paged flash-decode: the one Triton attention kernel of monorl (`monorl.ops.attention.kernel`), which the
    batch-invariant ops also run for varlen prefill/training. Programs per (sequence, kv head), keys in blocks of
    64 read through the block table; only seq_len keys are read. Few sequences split their keys over several
    programs (`decode_splits`: a function of the row count, so one CUDA graph per batch bucket keeps its
    launch)."""
    splits = paged_decode_splits(q.shape[0], k_cache.shape[-2], q.device, window)
    return attention_triton(q, k_cache, v_cache, seq_lens, block_tables, splits, window=window, sinks=sinks)


def paged_decode_splits(rows: int, kv_heads: int, device: torch.device, window: int = 0) -> int:
    """How many parts `paged_decode_triton` splits each row's keys into, for `rows` sequences on `device` (a
    sliding-window layer's: `window`)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return decode_splits(rows, kv_heads, sm_count(index), chip=chip_of(index), window=window)
