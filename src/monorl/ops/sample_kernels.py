"""The generator's sampler as Triton kernels (CUDA): greedy, temperature and top-p sampling with each token's
log-prob, in three launches instead of the ~40 passes over [B, vocab] of `monorl.generate.sampling.sample`'s
PyTorch ops (~0.7 ms of a 2.9 ms Qwen3-0.6B decode step of 40 sequences replayed from a CUDA graph, H200).

It computes exactly what that function does, and picks the same tokens:
- the Gumbel noise is the same integer hash of (key, position, token id) (32-bit arithmetic wraps as the
  masked int64 one does), the logits are scaled as ATen scales them (times the fp32 reciprocal of T) and
  perturbed with libdevice's logf, the CUDA math library PyTorch's kernels call;
- the top-p nucleus is the same integer fixed-point count over the logits sorted by `torch.sort`: exact integer
  sums, so the threshold does not depend on the order they are added in;
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
    def _nucleus_kernel(srt_ptr, thresh_ptr, top_p_ptr, inv_t, scale, V: tl.constexpr, BLOCK: tl.constexpr):
        """One row of logits sorted descending -> its nucleus threshold (`sampling._nucleus_threshold`)."""
        b = tl.program_id(0).to(tl.int64)
        row = srt_ptr + b * V
        top = tl.load(row).to(tl.float32) * inv_t
        total = tl.zeros([], dtype=tl.int64)
        for off in range(0, V, BLOCK):
            v = off + tl.arange(0, BLOCK)
            s = tl.load(row + v, mask=v < V, other=float("-inf")).to(tl.float32) * inv_t
            total += tl.sum((libdevice.exp(s - top) * scale).to(tl.int64), axis=0)
        limit = libdevice.ceil(total.to(tl.float64) * tl.load(top_p_ptr)).to(tl.int64)
        before = tl.zeros([], dtype=tl.int64)  # mass of the blocks already scanned
        keep = tl.zeros([], dtype=tl.int64)
        for off in range(0, V, BLOCK):
            v = off + tl.arange(0, BLOCK)
            s = tl.load(row + v, mask=v < V, other=float("-inf")).to(tl.float32) * inv_t
            q = (libdevice.exp(s - top) * scale).to(tl.int64)
            keep += tl.sum(((before + tl.cumsum(q, axis=0) - q) < limit).to(tl.int64), axis=0)
            before += tl.sum(q, axis=0)
        last = tl.load(row + keep - 1).to(tl.float32)
        tl.store(thresh_ptr + b, last * inv_t)

    @triton.jit
    def _sample_chunk_kernel(logits_ptr, stride_b, keys_ptr, pos_ptr, thresh_ptr, best_val_ptr, best_idx_ptr,
                             max_ptr, sum_ptr, V, inv_t, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                             GREEDY: tl.constexpr, NUCLEUS: tl.constexpr):
        """One chunk of one row: the chunk's best perturbed logit (and its lowest token id) and its share of
        logsumexp(logits / T) (max and sum of exponentials below it)."""
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        nch = tl.num_programs(1)
        if not GREEDY:
            key = tl.load(keys_ptr + b).to(tl.uint32)
            pos = tl.load(pos_ptr + b).to(tl.uint32)
            rowhash = _mix32(key ^ (pos * 0x61C88647))
        if NUCLEUS:
            thresh = tl.load(thresh_ptr + b)
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
    thresh = torch.empty(B, dtype=torch.float32, device=dev)
    if nucleus and B:
        srt = torch.sort(logits, dim=-1, descending=True).values.contiguous()
        scale = float(2 ** (62 - V.bit_length()))  # as `sampling._nucleus_threshold`: n * scale < 2**62
        _nucleus_kernel[(B,)](srt, thresh, torch.full((1,), top_p, dtype=torch.float64, device=dev), inv_t, scale, V=V,
                              BLOCK=_BLOCK, num_warps=8)
    nch = triton.cdiv(V, _CHUNK)
    best_val = torch.empty(B, nch, dtype=torch.float32, device=dev)
    best_idx = torch.empty(B, nch, dtype=torch.int32, device=dev)
    part_max, part_sum = torch.empty_like(best_val), torch.empty_like(best_val)
    tokens = torch.empty(B, dtype=torch.int64, device=dev)
    lps = torch.empty(B, dtype=torch.float32, device=dev)
    if B:
        _sample_chunk_kernel[(B, nch)](logits, logits.stride(0), keys, positions, thresh, best_val, best_idx,
                                       part_max, part_sum, V, inv_t, CHUNK=_CHUNK, BLOCK=_BLOCK, GREEDY=greedy,
                                       NUCLEUS=nucleus, num_warps=8)
        _sample_combine_kernel[(B,)](logits, logits.stride(0), best_val, best_idx, part_max, part_sum, tokens, lps,
                                     inv_t, NCH=nch, NCH_P=triton.next_power_of_2(nch), GREEDY=greedy, num_warps=1)
    return tokens, lps


@sample.register_fake
def _(logits, keys, positions, temperature, top_p):
    B = logits.shape[0]
    return logits.new_empty(B, dtype=torch.int64), logits.new_empty(B, dtype=torch.float32)
