"""The generator's sampler as Triton kernels (CUDA): greedy, temperature and top-p sampling with each token's
log-prob, in a few launches instead of the ~40 passes over [B, vocab] of `monorl.generate.sampling.sample`'s
PyTorch ops (~0.7 ms of a 2.9 ms Qwen3-0.6B decode step of 40 sequences replayed from a CUDA graph, H200).

It computes exactly what that function does, and picks the same tokens:
- the Gumbel noise is the same integer hash of (key, position, token id) (32-bit arithmetic wraps as the
  masked int64 one does), the logits are scaled as ATen scales them (times the fp32 reciprocal of T) and
  perturbed with libdevice's logf, the CUDA math library PyTorch's kernels call;
- the top-p nucleus is the same integer fixed-point count, found without sorting: a radix select over the
  logits' bits, 4 bits a level from the top, each level a histogram of the masses (and counts) of the keys under
  the prefix chosen so far, by their next digit (`_nucleus_level_kernel`, `_descend`). Integer sums are exact, so
  the threshold (the smallest logit whose strictly larger logits hold < top_p of the mass) does not depend on the
  order they are added in; a full-vocabulary `torch.sort` cost ~0.3 ms of a 2.5 ms decode step;
- argmax ties go to the lowest token id, as `torch.argmax`'s do.
The log-prob, `log_softmax(logits / T)` at the token, sums its exponentials in another order than PyTorch's
(a few fp32 ulps apart). Top-k sampling stays on the PyTorch path.

`sample_kernels.sample` is one custom op (opaque to `torch.compile`), capturable in a CUDA graph.
"""

from __future__ import annotations

import struct

import torch
from torch import Tensor

from monorl.ops import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def _mix32(x):
        """`monorl.generate.sampling._mix32` in uint32 (its products masked to 32 bits are these wrapping ones)."""
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x2C1B3C6D
        x = x ^ (x >> 16)
        x = x * 0x297A2D39
        return x ^ (x >> 15)

    @triton.jit
    def _order_key(x, KEY_BITS: tl.constexpr):
        """Float logits -> int64 keys (KEY_BITS wide) in the floats' order: sign-magnitude to offset binary."""
        if KEY_BITS == 16:
            bits = x.to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF
        else:
            bits = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        sign: tl.constexpr = 1 << (KEY_BITS - 1)
        ones: tl.constexpr = (1 << KEY_BITS) - 1
        return tl.where((bits & sign) != 0, bits ^ ones, bits | sign)

    @triton.jit
    def _key_value(key, dtype: tl.constexpr, KEY_BITS: tl.constexpr):
        """`_order_key`'s inverse: the logit (fp32) whose key this is."""
        sign: tl.constexpr = 1 << (KEY_BITS - 1)
        ones: tl.constexpr = (1 << KEY_BITS) - 1
        bits = tl.where((key & sign) != 0, key ^ sign, key ^ ones)
        if KEY_BITS == 16:
            return bits.to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
        return bits.to(tl.int32).to(dtype, bitcast=True).to(tl.float32)

    @triton.jit
    def _row_top(part_max_ptr, b, NCH: tl.constexpr, NCH_P: tl.constexpr):
        c = tl.arange(0, NCH_P)
        return tl.max(tl.load(part_max_ptr + b * NCH + c, mask=c < NCH, other=float("-inf")), axis=0)

    @triton.jit
    def _descend(hist_ptr, cnt_ptr, top_p_ptr, b, B, LEVELS: tl.constexpr):
        """Replay the first LEVELS digit choices of row b from their histograms: (key prefix, mass of the keys
        above the prefix's range, the nucleus's mass limit). Digit d of a level is valid if the largest key in
        its bin is kept (the mass strictly above it, `above` plus the bins above d, is < limit); the choice is
        the lowest valid non-empty bin, which holds the smallest kept key."""
        d = tl.arange(0, 16)
        h0 = tl.load(hist_ptr + b * 16 + d)
        limit = libdevice.ceil(tl.sum(h0, axis=0).to(tl.float64) * tl.load(top_p_ptr)).to(tl.int64)
        prefix = tl.zeros([], dtype=tl.int64)
        above = tl.zeros([], dtype=tl.int64)
        for level in tl.static_range(LEVELS):
            h = tl.load(hist_ptr + (level * B + b) * 16 + d)
            n = tl.load(cnt_ptr + (level * B + b) * 16 + d)
            over = above + tl.sum(h, axis=0) - tl.cumsum(h, axis=0)  # mass of the keys above bin d's range
            pick = tl.min(tl.where((n > 0) & (over < limit), d, 16), axis=0)
            above = tl.sum(tl.where(d == pick, over, 0), axis=0)
            prefix = prefix * 16 + pick
        return prefix, above, limit

    @triton.jit
    def _max_chunk_kernel(logits_ptr, stride_b, part_max_ptr, V, inv_t, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        for i in range(0, CHUNK, BLOCK):
            v = c * CHUNK + i + tl.arange(0, BLOCK)
            x = tl.load(logits_ptr + b * stride_b + v, mask=v < V, other=float("-inf")).to(tl.float32)
            m = tl.maximum(m, x * inv_t)
        tl.store(part_max_ptr + b * tl.num_programs(1) + c, tl.max(m, axis=0))

    @triton.jit
    def _nucleus_level_kernel(logits_ptr, stride_b, part_max_ptr, hist_ptr, cnt_ptr, top_p_ptr, V, B, inv_t, scale,
                              NCH: tl.constexpr, NCH_P: tl.constexpr, LEVEL: tl.constexpr, KEY_BITS: tl.constexpr,
                              CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """One chunk of one row, one radix level (4 bits of the key, from the top): the mass and count of the
        row's keys under the prefix chosen so far, by their next digit, added to the level's histogram (integer
        atomics: exact, so the sums do not depend on the order the chunks add them in)."""
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        top = _row_top(part_max_ptr, b, NCH, NCH_P)
        if LEVEL == 0:
            prefix = tl.zeros([], dtype=tl.int64)
        else:
            prefix, _, _ = _descend(hist_ptr, cnt_ptr, top_p_ptr, b, B, LEVEL)
        SHIFT: tl.constexpr = KEY_BITS - 4 * (LEVEL + 1)
        d = tl.arange(0, 16)
        mass = tl.zeros([16], dtype=tl.int64)
        count = tl.zeros([16], dtype=tl.int32)
        for i in range(0, CHUNK, BLOCK):
            v = c * CHUNK + i + tl.arange(0, BLOCK)
            mask = v < V
            x = tl.load(logits_ptr + b * stride_b + v, mask=mask, other=0.0)
            q = (libdevice.exp(x.to(tl.float32) * inv_t - top) * scale).to(tl.int64)
            key = _order_key(x, KEY_BITS)
            hit = (((key >> SHIFT) & 15)[:, None] == d[None, :]) & (mask & ((key >> (SHIFT + 4)) == prefix))[:, None]
            mass += tl.sum(tl.where(hit, q[:, None], 0), axis=0)
            count += tl.sum(hit.to(tl.int32), axis=0)
        tl.atomic_add(hist_ptr + (LEVEL * B + b) * 16 + d, mass)
        tl.atomic_add(cnt_ptr + (LEVEL * B + b) * 16 + d, count)

    @triton.jit
    def _sample_chunk_kernel(logits_ptr, stride_b, keys_ptr, pos_ptr, hist_ptr, cnt_ptr, top_p_ptr, best_val_ptr,
                             best_idx_ptr, max_ptr, sum_ptr, V, B, inv_t, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                             GREEDY: tl.constexpr, NUCLEUS: tl.constexpr, KEY_BITS: tl.constexpr):
        """One chunk of one row: the chunk's best perturbed logit (and its lowest token id) and its share of
        logsumexp(logits / T) (max and sum of exponentials below it)."""
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        nch = tl.num_programs(1)
        if not GREEDY:
            key = tl.load(keys_ptr + b).to(tl.uint32)
            pos = tl.load(pos_ptr + b).to(tl.uint32)
            rowhash = _mix32(key ^ (pos * 0x61C88647))
        if NUCLEUS:  # the smallest kept logit, scaled
            last, _, _ = _descend(hist_ptr, cnt_ptr, top_p_ptr, b, B, KEY_BITS // 4)
            thresh = _key_value(last, logits_ptr.dtype.element_ty, KEY_BITS) * inv_t
        best_val = tl.full([], float("-inf"), tl.float32)
        best_idx = tl.zeros([], tl.int32)
        m = tl.full([], float("-inf"), tl.float32)
        acc = tl.zeros([], tl.float32)
        for i in range(0, CHUNK, BLOCK):
            v = c * CHUNK + i + tl.arange(0, BLOCK)
            mask = v < V
            x = tl.load(logits_ptr + b * stride_b + v, mask=mask, other=float("-inf")).to(tl.float32)
            if GREEDY:
                s = x
                val = x
            else:
                s = x * inv_t
                h = _mix32(rowhash + v.to(tl.uint32) * 0x6A09E667)
                u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
                val = s + -libdevice.log(-libdevice.log(u))
                if NUCLEUS:
                    val = tl.where(s < thresh, float("-inf"), val)
            val = tl.where(mask, val, float("-inf"))
            bm = tl.max(val, axis=0)
            bi = tl.min(tl.where(val == bm, v, 2147483647), axis=0)
            take = bm > best_val  # strictly: an earlier block (lower ids) keeps a tie
            best_idx = tl.where(take, bi, best_idx)
            best_val = tl.where(take, bm, best_val)
            new_m = tl.maximum(m, tl.max(s, axis=0))
            acc = acc * libdevice.exp(m - new_m) + tl.sum(libdevice.exp(s - new_m), axis=0)
            m = new_m
        tl.store(best_val_ptr + b * nch + c, best_val)
        tl.store(best_idx_ptr + b * nch + c, best_idx)
        tl.store(max_ptr + b * nch + c, m)
        tl.store(sum_ptr + b * nch + c, acc)

    @triton.jit
    def _sample_combine_kernel(logits_ptr, stride_b, best_val_ptr, best_idx_ptr, max_ptr, sum_ptr, tok_ptr, lp_ptr,
                               inv_t, NCH: tl.constexpr, NCH_P: tl.constexpr, GREEDY: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, NCH_P)
        mask = c < NCH
        val = tl.load(best_val_ptr + b * NCH + c, mask=mask, other=float("-inf"))
        idx = tl.load(best_idx_ptr + b * NCH + c, mask=mask, other=2147483647)
        bm = tl.max(val, axis=0)
        tok = tl.min(tl.where(val == bm, idx, 2147483647), axis=0)
        mx = tl.load(max_ptr + b * NCH + c, mask=mask, other=float("-inf"))
        sm = tl.load(sum_ptr + b * NCH + c, mask=mask, other=0.0)
        top = tl.max(mx, axis=0)
        lse = top + libdevice.log(tl.sum(sm * libdevice.exp(mx - top), axis=0))
        x = tl.load(logits_ptr + b * stride_b + tok).to(tl.float32)
        s = x * inv_t
        tl.store(tok_ptr + b, tok.to(tl.int64))
        tl.store(lp_ptr + b, s - lse)


def _fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


_BLOCK = 2048
_CHUNK = 8 * _BLOCK  # a row of 151,936 logits: 10 chunks, so 40 rows fill ~400 programs
_LEVEL_BLOCK = 256  # the radix levels' tile: [256, 16] one-hot sums


@torch.library.custom_op("monorl::fused_sample", mutates_args=())
def sample(logits: Tensor, keys: Tensor, positions: Tensor, temperature: float, top_p: float) -> tuple[Tensor, Tensor]:
    """logits [B, V] (CUDA) -> (tokens int64 [B], log-probs fp32 [B]); temperature 0 is greedy (log-probs at
    T = 1). The same tokens as `monorl.generate.sampling.sample` with top_k 0 (module docstring)."""
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    greedy = temperature == 0.0
    # PyTorch divides a CUDA tensor by a Python scalar as a product with the scalar's fp32 reciprocal (ATen's
    # div_true_kernel_cuda); the same product here gives the same scaled logits. The fp32 quotient is the float64
    # one rounded to fp32 (float64 carries more than twice fp32's bits), so no tensor is built per call.
    inv_t = 1.0 if greedy else _fp32(1.0 / _fp32(temperature))
    nucleus = not greedy and top_p < 1.0
    dev = logits.device
    nch = triton.cdiv(V, _CHUNK)
    key_bits = 8 * logits.element_size()
    hist = torch.zeros(key_bits // 4, B, 16, dtype=torch.int64, device=dev) if nucleus else logits
    count = torch.zeros(key_bits // 4, B, 16, dtype=torch.int32, device=dev) if nucleus else logits
    top_p_t = torch.full((1,), top_p, dtype=torch.float64, device=dev)
    if nucleus and B:
        row_max = torch.empty(B, nch, dtype=torch.float32, device=dev)
        _max_chunk_kernel[(B, nch)](logits, logits.stride(0), row_max, V, inv_t, CHUNK=_CHUNK, BLOCK=_BLOCK,
                                    num_warps=8)
        scale = float(2 ** (62 - V.bit_length()))  # as `sampling._nucleus_threshold`: n * scale < 2**62
        for level in range(key_bits // 4):
            _nucleus_level_kernel[(B, nch)](logits, logits.stride(0), row_max, hist, count, top_p_t, V, B, inv_t,
                                            scale, NCH=nch, NCH_P=triton.next_power_of_2(nch), LEVEL=level,
                                            KEY_BITS=key_bits, CHUNK=_CHUNK, BLOCK=_LEVEL_BLOCK, num_warps=8)
    best_val = torch.empty(B, nch, dtype=torch.float32, device=dev)
    best_idx = torch.empty(B, nch, dtype=torch.int32, device=dev)
    part_max, part_sum = torch.empty_like(best_val), torch.empty_like(best_val)
    tokens = torch.empty(B, dtype=torch.int64, device=dev)
    lps = torch.empty(B, dtype=torch.float32, device=dev)
    if B:
        _sample_chunk_kernel[(B, nch)](logits, logits.stride(0), keys, positions, hist, count, top_p_t, best_val,
                                       best_idx, part_max, part_sum, V, B, inv_t, CHUNK=_CHUNK, BLOCK=_BLOCK,
                                       GREEDY=greedy, NUCLEUS=nucleus, KEY_BITS=key_bits, num_warps=8)
        _sample_combine_kernel[(B,)](logits, logits.stride(0), best_val, best_idx, part_max, part_sum, tokens, lps,
                                     inv_t, NCH=nch, NCH_P=triton.next_power_of_2(nch), GREEDY=greedy, num_warps=1)
    return tokens, lps


@sample.register_fake
def _(logits, keys, positions, temperature, top_p):
    B = logits.shape[0]
    return logits.new_empty(B, dtype=torch.int64), logits.new_empty(B, dtype=torch.float32)
