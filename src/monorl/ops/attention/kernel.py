"""The one Triton attention kernel of monorl: varlen-causal (packed sequences) and paged decode (keys read
through a block table) in one code path.

Every query row walks its keys in blocks of `attention.block_n` (ops/tunables.py) from position 0 with the same
online-softmax update; only the addressing differs between the layouts. A program holds a tile of `attention.rows` query
rows of one kv head, (token, query head) pairs: in decode the G query heads of one sequence's token (the rest padding),
in a varlen forward the G heads of `rows // G` consecutive tokens of one sequence, which then share every key and value
block they load (one load per tile instead of one per token). The tile's shapes, and so its dot products, are the same
in both layouts, and a row's keys past its own position are masked to -inf: a block the row does not reach leaves its
softmax state exactly unchanged (p = 0, rescale by exp(0) = 1). So a token's output is the same function of its q and
its keys in both, which is what makes `attention_invariant` batch-invariant; the generator's ordinary paged decode
(`monorl.generate.attention`) runs the same kernel for its speed: it reads only each sequence's `seq_len` keys."""

from __future__ import annotations

import torch
from torch import Tensor

from monorl.ops import HAS_TRITON, pdl_launch
from monorl.ops.tunables import HOPPER, chip_for, tuned

# The launch values (keys a block, query rows a program, warps, the default mode's key splits) are in
# ops/tunables.py (`attention.*`), each with its measurement. Warps and tile shapes must be the same in both layouts
# (the batch-invariant mode's equality); paged decode reads each key block's cache blocks from the block table one
# block ahead (see the loop): 34 rows of ~1460 keys 90.9 -> 66.6 us a launch, 138 of ~1000 161.6 -> 148.9
# (`benchmarks/tune_decode_attention.py --spread`, H200, 64-key blocks; 128-key blocks were slower with it).

if HAS_TRITON:
    import triton
    import triton.language as tl

    from monorl.ops import pdl_start

    @triton.jit
    def _attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, lens_ptr, bt_ptr,
                     stride_qt, stride_qh, stride_kblk, stride_ktok, stride_kh, stride_btb,
                     stride_ot, stride_oh, scale, tiles, part_ptr, ml_ptr, lse_ptr, stride_lse, window, sink_ptr,
                     PAGED: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr, TOKENS: tl.constexpr,
                     D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr = 1,
                     STORE_LSE: tl.constexpr = False, PDL: tl.constexpr = False, CACHED: tl.constexpr = False,
                     SINKS: tl.constexpr = False):
        if PDL:  # wait for the kernel before (programmatic dependent launch)
            pdl_start()
        # Rows are (token i < TOKENS of the tile, query head hk * G + g). Paged: program = one sequence's new
        # token (TOKENS = 1), n keys, all of them visible. Varlen: program = tile `pid % tiles` of sequence
        # `pid // tiles`; its token i sees keys 0..t0 + i of that sequence. SPLITS > 1 (paged only, not
        # invariant): program (pid, hk, split) walks the split-th of SPLITS equal runs of whole key blocks and
        # writes its unnormalised state to part_ptr / ml_ptr for `_attn_combine_kernel`. STORE_LSE: each row's
        # log-sum-exp of its scaled scores (m + log l) at lse_ptr [Hq, rows], the softmax statistics flash
        # attention's backward takes, so that backward need not recompute them. CACHED (paged): program = tile
        # `pid % tiles` of sequence `pid // tiles`'s new tokens (cu_ptr: their cu_seqlens; lens_ptr: its keys'
        # cu_seqlens, cached and new), read through its block table row; its token i sees keys 0..its position.
        # window > 0 (a sliding-window layer): a row at position p sees keys p - window + 1 .. p only, and the
        # program walks from the key block holding its first token's first key (blocks before it are never read,
        # so a window kind may hand them back); a row whose first blocks are all masked keeps its empty state.
        # SINKS (GPT-OSS): sink_ptr [Hq] holds a logit per query head that its softmax's denominator counts, a key
        # of that (scaled) score and value 0: the state starts at m = sink, l = exp(sink - m) = 1, acc = 0, before
        # the first key block, in every layout alike (a split decode: in its first split only, counted once).
        pid = tl.program_id(0)
        hk = tl.program_id(1)
        rows = tl.arange(0, ROWS)
        i = rows // G
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        if PAGED:
            if CACHED:
                row = pid // tiles
                t0 = (pid % tiles) * TOKENS
                qstart = tl.load(cu_ptr + row)
                nq = tl.load(cu_ptr + row + 1) - qstart
                if t0 >= nq:  # a tile past its sequence's new tokens (the grid covers the most)
                    return
                n = tl.load(lens_ptr + row + 1) - tl.load(lens_ptr + row)
                tok = t0 + i
                rmask = (i < TOKENS) & (tok < nq)
                qrow = qstart + tl.minimum(tok, nq - 1)
                lim = n - nq + tok + 1
                kv_end = n - tl.maximum(nq - t0 - TOKENS, 0)  # min(n, the tile's last position + 1)
                first = n - nq + t0 + 1 - window
            else:
                row = pid
                n = tl.load(lens_ptr + pid)
                qrow = pid + 0 * i
                lim = n + 0 * i  # keys visible to each row
                rmask = i < TOKENS
                kv_end = n
                first = n - window
            kbase = 0
            kv_start = 0
            if window > 0:
                kv_start = tl.maximum(first, 0) // BLOCK_N * BLOCK_N
            if SPLITS > 1:
                chunk = tl.cdiv(tl.cdiv(n - kv_start, SPLITS), BLOCK_N) * BLOCK_N
                kv_start = kv_start + tl.program_id(2) * chunk
                kv_end = tl.minimum(n, kv_start + chunk)
        else:
            seq = pid // tiles
            t0 = (pid % tiles) * TOKENS
            start = tl.load(cu_ptr + seq)
            n = tl.load(cu_ptr + seq + 1) - start
            if t0 >= n:  # a tile past its sequence's end (the grid covers the longest one)
                return
            tok = t0 + i
            rmask = (i < TOKENS) & (tok < n)
            qrow = start + tl.minimum(tok, n - 1)
            lim = tok + 1
            kv_end = n - tl.maximum(n - t0 - TOKENS, 0)  # min(n, t0 + TOKENS)
            kbase = start.to(tl.int64)
            kv_start = 0
            if window > 0:
                kv_start = tl.maximum(t0 + 1 - window, 0) // BLOCK_N * BLOCK_N
        hq = hk * G + rows % G
        q = tl.load(q_ptr + qrow[:, None].to(tl.int64) * stride_qt + hq[:, None] * stride_qh + offs_d[None, :],
                    mask=rmask[:, None], other=0.0)
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        if SINKS:
            first_split = tl.program_id(2) == 0  # (a grid without splits: always)
            m_i = tl.where(first_split, tl.load(sink_ptr + hq).to(tl.float32), m_i)
            l_i = tl.where(first_split, 1.0, l_i)
        acc = tl.zeros([ROWS, D], dtype=tl.float32)
        lo = lim - window  # each row's first visible key, with a window
        if PAGED:  # each key block's cache blocks are read from the table one block ahead: the key and value
            # loads then wait for no table load of their own
            table = bt_ptr + row * stride_btb
            blk_next = tl.load(table + (kv_start + offs_n) // BS, mask=kv_start + offs_n < kv_end, other=0)
        for start_n in range(kv_start, kv_end, BLOCK_N):
            key = start_n + offs_n
            nmask = key < kv_end
            if PAGED:
                blk = blk_next
                blk_next = tl.load(table + (key + BLOCK_N) // BS, mask=key + BLOCK_N < kv_end, other=0)
                off = blk.to(tl.int64) * stride_kblk + (key % BS) * stride_ktok + hk * stride_kh
            else:
                off = (kbase + key) * stride_ktok + hk * stride_kh
            k = tl.load(k_ptr + off[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            seen = (key[None, :] < lim[:, None]) & ((key[None, :] >= lo[:, None]) | (window == 0))
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row with no visible key yet (a window's start) keeps m = -inf: subtract 0 there, not -inf (NaN)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_sub[:, None])
            alpha = tl.exp(m_i - m_sub)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + off[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if SPLITS > 1:  # state of rows (pid, split, hq): m and l at ml_ptr [2, R, SPLITS, Hq], acc at part_ptr
            nh = tl.num_programs(1) * G
            at = (pid * SPLITS + tl.program_id(2)) * nh + hq
            tl.store(ml_ptr + at, m_i, mask=rmask)
            tl.store(ml_ptr + tl.num_programs(0) * SPLITS * nh + at, l_i, mask=rmask)
            tl.store(part_ptr + at[:, None].to(tl.int64) * D + offs_d[None, :], acc, mask=rmask[:, None])
            return
        out = acc / l_i[:, None]
        if STORE_LSE:
            tl.store(lse_ptr + hq * stride_lse + qrow, m_i + tl.log(l_i), mask=rmask)
        tl.store(o_ptr + qrow[:, None].to(tl.int64) * stride_ot + hq[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=rmask[:, None])

    @triton.jit
    def _attn_combine_kernel(part_ptr, ml_ptr, o_ptr, stride_ot, stride_oh, R, Hq,
                             SPLITS: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr = False):
        """Program (row, head): the SPLITS partial states of a split paged decode merged into its output."""
        if PDL:
            pdl_start()
        r = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.arange(0, SPLITS)
        at = (r * SPLITS + sp) * Hq + h
        m = tl.load(ml_ptr + at)
        lsum = tl.load(ml_ptr + R * SPLITS * Hq + at)
        m_all = tl.max(m, 0)
        w = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)  # an empty split: m = -inf, l = 0, acc = 0
        acc = tl.load(part_ptr + at[:, None].to(tl.int64) * D + tl.arange(0, D)[None, :])
        out = tl.sum(acc * w[:, None], 0) / tl.sum(lsum * w, 0)
        tl.store(o_ptr + r.to(tl.int64) * stride_ot + h * stride_oh + tl.arange(0, D), out.to(o_ptr.dtype.element_ty))


def decode_splits(rows: int, kv_heads: int, sms: int, *, chip: str = HOPPER, window: int = 0) -> int:
    """Key splits of a paged decode (not batch-invariant). 1 once rows * kv_heads reach
    `attention.split_below_programs_per_sm` programs an SM; below, a power of two that brings them to about
    `split_target_programs_per_sm`, at most `max_splits`. Measured on an H100 (`benchmarks/tune_decode_attention.py
    --splits`, cold caches, us a launch): 8 rows of ~1000 keys 53 -> 20 (16 splits), 32 of ~1500 95 -> 73 (8); but 40
    rows of 200-400 keys gained at most 8% alone and left the reference decode step (40 rows, 4 splits then) at 1.59 ms,
    the merge being one more launch a layer; 128 rows of ~800 keys gained 3%. A sliding-window layer (window > 0)
    reads at most ~window keys a row: at most `attention.window_split_keys` of them a split (more splits left most
    programs idle: Gemma 3's 512-key window at 64 rows took 30.9 us with 16 splits, 15.8 with 2)."""
    programs = rows * kv_heads
    if programs >= tuned("attention.split_below_programs_per_sm", chip) * sms:
        return 1
    want = -(-tuned("attention.split_target_programs_per_sm", chip) * sms // max(1, programs))
    splits = min(tuned("attention.max_splits", chip), 1 << (want - 1).bit_length())
    if window:
        splits = min(splits, 1 << max(0, (window // tuned("attention.window_split_keys", chip)).bit_length() - 1))
    return splits


def _tile(Hq: int, Hkv: int, chip: str) -> tuple[int, int, int]:
    """(G, rows, tokens per varlen tile) for a model's head counts."""
    G = Hq // Hkv
    rows = max(tuned("attention.rows", chip), triton.next_power_of_2(G))
    return G, rows, rows // G


def _sink_args(sinks: Tensor | None, out: Tensor) -> tuple[Tensor, dict]:
    """The kernel's sink pointer (any tensor without sinks: never read) and its SINKS flag. The sinks are rounded to
    the activations' dtype, as `sdpa_masked` rounds them: an autocast trainer's fp32 sinks and the generator's bf16
    copy then attend alike."""
    return (out, {}) if sinks is None else (sinks.to(out.dtype).contiguous(), {"SINKS": True})


def attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, lens: Tensor, block_tables: Tensor,
                     splits: int = 1, block_n: int | None = None, window: int = 0,
                     sinks: Tensor | None = None) -> Tensor:
    """Paged decode: q [R, Hq, D] (one token per sequence) attends the first lens[r] keys of row r's block table (caches
    [N, BS, Hkv, D]), in key blocks of block_n (default `attention.block_n`). splits > 1 (a power of two): each row's
    keys are walked in that many parts by separate programs and merged after (`decode_splits`), which fills the GPU when
    rows are few; the sums then round differently, so the batch-invariant ops keep 1 (and the varlen path's block_n).
    window > 0: only each row's last `window` keys (a sliding-window layer), the key blocks before them unread.
    sinks [Hq] (GPT-OSS): a logit per query head its softmax's denominator also counts (a key with no value)."""
    R, Hq, D = q.shape
    Hkv = k_cache.shape[-2]
    chip = chip_for(q)
    G, rows, _ = _tile(Hq, Hkv, chip)
    q = q.contiguous()
    out = torch.empty_like(q)
    if R == 0:
        return out
    part = ml = out
    if splits > 1:
        part = torch.empty(R, splits, Hq, D, dtype=torch.float32, device=q.device)
        ml = torch.empty(2, R, splits, Hq, dtype=torch.float32, device=q.device)
    sink, sink_flag = _sink_args(sinks, out)
    _attn_kernel[(R, Hkv, splits)](
        q, k_cache, v_cache, out, lens, lens, block_tables,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), D ** -0.5, 1, part, ml, out, 0, window, sink,
        PAGED=True, G=G, ROWS=rows, TOKENS=1, D=D, BS=k_cache.shape[1],
        BLOCK_N=block_n or tuned("attention.block_n", chip), SPLITS=splits, num_warps=tuned("attention.warps", chip),
        **sink_flag, **pdl_launch(q))
    if splits > 1:
        _attn_combine_kernel[(R, Hq)](part, ml, out, out.stride(0), out.stride(1), R, Hq, SPLITS=splits, D=D,
                                      num_warps=tuned("attention.combine_warps", chip), **pdl_launch(q))
    return out


def cached_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                            block_tables: Tensor, max_q: int, window: int = 0, sinks: Tensor | None = None) -> Tensor:
    """New tokens over their sequences' cached keys (an episode's next turn), read through the block tables: q [T, Hq,
    D] packed by cu_seqlens_q; sequence s's keys are positions 0..len_k - 1 of block_tables[s] (caches [N, BS, Hkv, D],
    the new tokens' k/v written already), its len_q queries the last of them, each seeing keys up to its own position.
    No key is gathered or copied: a program holds `attention.cached_rows` query rows (the G heads of consecutive new
    tokens of one sequence) and walks that sequence's keys once. Not batch-invariant (the invariant mode runs the
    paged-decode rows: `CachedPrefillContext.decode_rows`). max_q: at least the longest len_q (the grid's tiles).
    window, sinks: as `attention_triton`'s."""
    T, Hq, D = q.shape
    Hkv = k_cache.shape[-2]
    chip = chip_for(q)
    G = Hq // Hkv
    rows = max(tuned("attention.cached_rows", chip), triton.next_power_of_2(G))
    tokens = rows // G
    q = q.contiguous()
    out = torch.empty_like(q)
    if T == 0:
        return out
    tiles = triton.cdiv(max_q, tokens)
    sink, sink_flag = _sink_args(sinks, out)
    _attn_kernel[((cu_seqlens_q.shape[0] - 1) * tiles, Hkv)](
        q, k_cache, v_cache, out, cu_seqlens_q, cu_seqlens_k, block_tables,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), D ** -0.5, tiles, out, out, out, 0, window, sink,
        PAGED=True, CACHED=True, G=G, ROWS=rows, TOKENS=tokens, D=D, BS=k_cache.shape[1],
        BLOCK_N=tuned("attention.block_n", chip), num_warps=tuned("attention.cached_warps", chip), **sink_flag,
        **pdl_launch(q))
    return out


def varlen_attention_triton(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                            lse: Tensor | None = None, window: int = 0, sinks: Tensor | None = None) -> Tensor:
    """Causal attention of packed sequences: q [T, Hq, D], k/v [T, Hkv, D]; sequence s is tokens
    cu_seqlens[s] .. cu_seqlens[s+1] - 1 (int32, on the device: no host read), none longer than max_seqlen.
    lse (fp32 [Hq, T], optional): filled with each row's log-sum-exp of its scaled scores, flash attention's
    layout (with sinks, counting them); the outputs are the same with or without it. window, sinks: as
    `attention_triton`'s."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    chip = chip_for(q)
    G, rows, tokens = _tile(Hq, Hkv, chip)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    if T == 0:
        return out
    if lse is not None and (lse.shape != (Hq, T) or lse.dtype != torch.float32 or lse.stride(1) != 1):
        raise ValueError(f"lse must be a row-major fp32 [{Hq}, {T}] tensor, got {lse.dtype} {tuple(lse.shape)}")
    tiles = triton.cdiv(max_seqlen, tokens)
    sink, sink_flag = _sink_args(sinks, out)
    _attn_kernel[((cu_seqlens.shape[0] - 1) * tiles, Hkv)](
        q, k, v, out, cu_seqlens, cu_seqlens, cu_seqlens,
        q.stride(0), q.stride(1), 0, k.stride(0), k.stride(1), 0, out.stride(0), out.stride(1), D ** -0.5, tiles,
        out, out, out if lse is None else lse, 0 if lse is None else lse.stride(0), window, sink,
        PAGED=False, G=G, ROWS=rows, TOKENS=tokens, D=D, BS=1, BLOCK_N=tuned("attention.block_n", chip),
        STORE_LSE=lse is not None, num_warps=tuned("attention.warps", chip), **sink_flag, **pdl_launch(q))
    return out
