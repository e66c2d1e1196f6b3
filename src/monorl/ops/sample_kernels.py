"""The generator's sampler as Triton kernels (CUDA): greedy, temperature and top-p sampling with each token's
log-prob, in a few launches instead of the ~40 passes over [B, vocab] of `monorl.generate.sampling.sample`'s
PyTorch ops (~0.7 ms of a 2.9 ms Qwen3-0.6B decode step of 40 sequences replayed from a CUDA graph, H200).

It computes exactly what that function does, and picks the same tokens:
- the Gumbel noise is the same integer hash of (key, position, token id) (32-bit arithmetic wraps as the
  masked int64 one does), the logits are scaled as ATen scales them (times the fp32 reciprocal of T) and
  perturbed with libdevice's logf, the CUDA math library PyTorch's kernels call;
- the top-p nucleus is the same integer fixed-point count: exact integer sums, so the threshold does not depend
  on the order they are added in. For bf16 logits (the generator's) it is found without sorting, by a search over
  the 16-bit order key (`_nucleus_bisect`), and only for the rows whose Gumbel-max over the whole vocabulary is
  not in the nucleus (`sample`: in expectation at least top_p of rows are, and there the token is the same); other
  dtypes scan the logits sorted by `torch.sort`;
- argmax ties go to the lowest token id, as `torch.argmax`'s do.
The log-prob, `log_softmax(logits / T)` at the token, sums its exponentials in another order than PyTorch's
(a few fp32 ulps apart). Top-k sampling stays on the PyTorch path.

`sample_kernels.sample` is one custom op (opaque to `torch.compile`), capturable in a CUDA graph.
"""

from __future__ import annotations

import struct

import torch
from torch import Tensor

from monorl.ops import HAS_TRITON, custom_op, pdl_launch, sm_count, unit_stride
from monorl.ops.tunables import chip_for, chip_of, tuned

if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from monorl.ops import pdl_start
    from monorl.ops.nucleus_kernels import (
        _load_block,
        _nucleus_check_kernel,
        _nucleus_final_kernel,
        _nucleus_kernel,
        _nucleus_level_kernel,
        _nucleus_plan_kernel,
        _nucleus_threshold,
        _row_max_kernel,
    )

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
    def _sample_chunk_kernel(logits_ptr, stride_b, keys_ptr, pos_ptr, thresh_ptr, best_val_ptr, best_idx_ptr,
                             max_ptr, sum_ptr, V, inv_t, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                             GREEDY: tl.constexpr, NUCLEUS: tl.constexpr, PDL: tl.constexpr = False):
        """One chunk of one row: the chunk's best perturbed logit (and its lowest token id) and its share of
        logsumexp(logits / T) (max and sum of exponentials below it)."""
        if PDL:  # wait for the kernel before (programmatic dependent launch)
            pdl_start()
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        nch = tl.num_programs(1)
        thresh = 0.0
        if NUCLEUS:
            thresh = tl.load(thresh_ptr + b)
        best_val, best_idx, m, acc = _sample_chunk(logits_ptr, stride_b, keys_ptr, pos_ptr, V, inv_t, thresh, b, c,
                                                   CHUNK, BLOCK, GREEDY, NUCLEUS)
        tl.store(best_val_ptr + b * nch + c, best_val)
        tl.store(best_idx_ptr + b * nch + c, best_idx)
        tl.store(max_ptr + b * nch + c, m)
        tl.store(sum_ptr + b * nch + c, acc)

    @triton.jit
    def _nucleus_sample_kernel(logits_ptr, stride_b, keys_ptr, pos_ptr, parts_ptr, cur_ptr, top_p_ptr, plan_ptr,
                               best_val_ptr, best_idx_ptr, V, inv_t, BITS: tl.constexpr, NS: tl.constexpr,
                               NS_P: tl.constexpr, SCHUNK: tl.constexpr, BLOCK: tl.constexpr,
                               PDL: tl.constexpr = False):
        """The masked sampling pass of the planned rows, over the search's (row, chunk) pairs: each pair's best
        perturbed logit among those at or above the row's nucleus threshold, and its lowest token id."""
        if PDL:  # wait for the kernel before (programmatic dependent launch)
            pdl_start()
        for it in range(tl.program_id(0), tl.load(plan_ptr) * NS, tl.num_programs(0)):
            b = tl.load(plan_ptr + 1 + it // NS).to(tl.int64)
            c = it % NS
            thresh = _nucleus_threshold(parts_ptr, cur_ptr, top_p_ptr, b, inv_t, BITS, NS, NS_P)
            best_val, best_idx, _, _ = _sample_chunk(logits_ptr, stride_b, keys_ptr, pos_ptr, V, inv_t, thresh, b,
                                                     c, SCHUNK, BLOCK, False, True)
            tl.store(best_val_ptr + b * NS + c, best_val)
            tl.store(best_idx_ptr + b * NS + c, best_idx)

    @triton.jit
    def _sample_chunk(logits_ptr, stride_b, keys_ptr, pos_ptr, V, inv_t, thresh, b, c, CHUNK: tl.constexpr,
                      BLOCK: tl.constexpr, GREEDY: tl.constexpr, NUCLEUS: tl.constexpr):
        if not GREEDY:
            key = tl.load(keys_ptr + b).to(tl.uint32)
            pos = tl.load(pos_ptr + b).to(tl.uint32)
            rowhash = _mix32(key ^ (pos * 0x61C88647))
        best_val = tl.full([], float("-inf"), tl.float32)
        best_idx = tl.zeros([], tl.int32)
        m = tl.full([], float("-inf"), tl.float32)
        acc = tl.zeros([], tl.float32)
        row = logits_ptr + b * stride_b + c * CHUNK
        x_next = _load_block(row, c * CHUNK, 0, V, CHUNK, BLOCK)
        for i in range(0, CHUNK, BLOCK):
            v = c * CHUNK + i + tl.arange(0, BLOCK)
            mask = v < V
            x = x_next
            x_next = _load_block(row, c * CHUNK, i + BLOCK, V, CHUNK, BLOCK)  # in flight while x is sampled
            if GREEDY:
                s = x
                val = x
            else:
                s = x * inv_t
                h = _mix32(rowhash + v.to(tl.uint32) * 0x6A09E667)
                u = ((h >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)  # `sampling.uniform_from_hash`
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
        return best_val, best_idx, m, acc

    @triton.jit
    def _best_token(best_val_ptr, best_idx_ptr, b, NCH: tl.constexpr, NCH_P: tl.constexpr):
        """Row b's token from its chunks' best values: the largest, the lowest token id on ties."""
        c = tl.arange(0, NCH_P)
        mask = c < NCH
        val = tl.load(best_val_ptr + b * NCH + c, mask=mask, other=float("-inf"))
        idx = tl.load(best_idx_ptr + b * NCH + c, mask=mask, other=2147483647)
        return tl.min(tl.where(val == tl.max(val, axis=0), idx, 2147483647), axis=0)

    @triton.jit
    def _sample_combine_kernel(logits_ptr, stride_b, best_val_ptr, best_idx_ptr, max_ptr, sum_ptr, tok_ptr, lp_ptr,
                               lse_ptr, inv_t, NCH: tl.constexpr, NCH_P: tl.constexpr, PDL: tl.constexpr = False):
        """Program b: row b's token, its log-prob, and the row's logsumexp(logits / T) (to lse_ptr)."""
        if PDL:  # wait for the kernel before (programmatic dependent launch)
            pdl_start()
        b = tl.program_id(0).to(tl.int64)
        tok = _best_token(best_val_ptr, best_idx_ptr, b, NCH, NCH_P)
        c = tl.arange(0, NCH_P)
        mask = c < NCH
        mx = tl.load(max_ptr + b * NCH + c, mask=mask, other=float("-inf"))
        sm = tl.load(sum_ptr + b * NCH + c, mask=mask, other=0.0)
        top = tl.max(mx, axis=0)
        lse = top + libdevice.log(tl.sum(sm * libdevice.exp(mx - top), axis=0))
        x = tl.load(logits_ptr + b * stride_b + tok).to(tl.float32)
        tl.store(tok_ptr + b, tok.to(tl.int64))
        tl.store(lp_ptr + b, x * inv_t - lse)
        tl.store(lse_ptr + b, lse)

    @triton.jit
    def _nucleus_combine_kernel(logits_ptr, stride_b, best_val_ptr, best_idx_ptr, lse_ptr, plan_ptr, tok_ptr, lp_ptr,
                                inv_t, B, NS: tl.constexpr, NS_P: tl.constexpr, PDL: tl.constexpr = False):
        """Program b: a planned row's token from the masked pass, its log-prob against the row's logsumexp (the
        first pass's: the same sums of the same logits); other rows keep the first pass's token."""
        if PDL:  # wait for the kernel before (programmatic dependent launch)
            pdl_start()
        b = tl.program_id(0).to(tl.int64)
        if tl.load(plan_ptr + 1 + B + b) != 0:
            tok = _best_token(best_val_ptr, best_idx_ptr, b, NS, NS_P)
            x = tl.load(logits_ptr + b * stride_b + tok).to(tl.float32)
            tl.store(tok_ptr + b, tok.to(tl.int64))
            tl.store(lp_ptr + b, x * inv_t - tl.load(lse_ptr + b))


def _fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


# The launch is ops/tunables.py's `sampler.*` (`benchmarks/tune_sampler.py` sweeps it): a program walks `chunk` logits
# of a row `block` at a time. The nucleus search (`bits` of a bf16's order key a level) and its masked pass run for the
# few rows whose first draw left the nucleus (`sample`), a (row, `search_chunk` logits) pair a program's work.


def _search_programs(B: int, V: int, device: torch.device) -> int:
    """Programs of a search level (they walk the planned rows' chunks): two an SM, or fewer where B rows' chunks
    are fewer. A function of B alone, so a CUDA graph keeps it."""
    chip, sms = chip_of(device.index or 0), sm_count(device.index or 0)
    return min(B * triton.cdiv(V, tuned("sampler.search_chunk", chip)),
               tuned("sampler.search_programs_per_sm", chip) * sms)


def _nucleus_search(logits: Tensor, top_p: Tensor, inv_t: float, scale: float, pmax: Tensor,
                    plan: Tensor) -> tuple[Tensor, Tensor]:
    """The 16 // `sampler.bits` levels of `_nucleus_bisect` over the rows of `plan` (`_nucleus_plan_kernel`'s layout);
    pmax: each first-pass chunk's max(logits * inv_t). -> (parts, cur): what `_nucleus_threshold` reads."""
    B, V = logits.shape
    chip = chip_for(logits)
    bits, schunk = tuned("sampler.bits", chip), tuned("sampler.search_chunk", chip)
    ns = triton.cdiv(V, schunk)
    levels = 16 // bits
    parts = torch.empty(B, levels, ns, 1 << bits, dtype=torch.int64, device=logits.device)
    cur = torch.empty(B, levels, dtype=torch.int32, device=logits.device)
    grid = (_search_programs(B, V, logits.device),)
    pdl = pdl_launch(logits)
    for level in range(levels):  # no FMA: q rounds as the PyTorch ops' separate product and difference do
        _nucleus_level_kernel[grid](logits, logits.stride(0), pmax, parts, cur, top_p, plan, V, inv_t, scale,
                                    LEVEL=level, BITS=bits, NCH=pmax.shape[1],
                                    NCH_P=triton.next_power_of_2(pmax.shape[1]), NS=ns,
                                    NS_P=triton.next_power_of_2(ns), SCHUNK=schunk,
                                    BLOCK=tuned("sampler.search_block", chip), num_warps=tuned("sampler.warps", chip),
                                    enable_fp_fusion=False, **pdl)
    return parts, cur


def _nucleus_bisect(logits: Tensor, thresh: Tensor, top_p: Tensor, inv_t: float, scale: float, nch: int) -> None:
    """The nucleus threshold of every row of bf16 logits without sorting them (a sort of 40 x 151,936 logits took ~0.3
    ms of a 2.2-2.6 ms decode step, H200). `sampling._nucleus_threshold` keeps the sorted prefix whose preceding mass is
    below limit = ceil(top_p * total); its last logit is the smallest present value v with mass(logits > v) < limit, and
    since mass(> key) only falls with the key, the smallest 16-bit order key K with mass(keys > K) < limit is that
    value's key. Found `sampler.bits` bits a level from the top: each level sums the masses at or above each of its
    2**bits sub-ranges' starts, chunk by chunk, and the next level's programs each add up those integer sums (exact, so
    in any order) and pick the sub-range (`_nucleus_search`). `sample` runs the levels for the rows that need them and
    reads the threshold in its masked pass; this function (its GPU test's) plans every row and writes them."""
    B, V = logits.shape
    dev = logits.device
    chip = chip_for(logits)
    pdl = pdl_launch(logits)
    pmax = torch.empty(B, nch, dtype=torch.float32, device=dev)
    _row_max_kernel[(B, nch)](logits, logits.stride(0), pmax, V, inv_t, CHUNK=tuned("sampler.chunk", chip),
                              BLOCK=tuned("sampler.nucleus_block", chip), num_warps=tuned("sampler.warps", chip),
                              **pdl)
    rows = torch.arange(B, dtype=torch.int32, device=dev)
    plan = torch.cat([rows.new_full((1,), B), rows, torch.ones_like(rows)])
    parts, cur = _nucleus_search(logits, top_p, inv_t, scale, pmax, plan)
    ns = triton.cdiv(V, tuned("sampler.search_chunk", chip))
    _nucleus_final_kernel[(B,)](parts, cur, top_p, thresh, plan, inv_t, B, BITS=tuned("sampler.bits", chip), NS=ns,
                                NS_P=triton.next_power_of_2(ns), num_warps=tuned("sampler.combine_warps", chip), **pdl)


_TOP_P: dict[tuple[float, torch.device], Tensor] = {}


def _top_p_tensor(top_p: float, device: torch.device) -> Tensor:
    """top_p as a float64 [1] tensor (the kernels' limit is ceil(total * top_p) in float64), kept per value and
    device so that a decode step launches no fill for it; one made during a CUDA graph capture is not kept (its
    memory is the graph's)."""
    t = _TOP_P.get((top_p, device))
    if t is None:
        t = torch.full((1,), top_p, dtype=torch.float64, device=device)
        if not torch.cuda.is_current_stream_capturing():
            _TOP_P[(top_p, device)] = t
    return t


@custom_op("monorl::fused_sample", mutates_args=())
def sample(logits: Tensor, keys: Tensor, positions: Tensor, temperature: float, top_p: float) -> tuple[Tensor, Tensor]:
    """logits [B, V] (CUDA) -> (tokens int64 [B], log-probs fp32 [B]); temperature 0 is greedy (log-probs at
    T = 1). The same tokens as `monorl.generate.sampling.sample` with top_k 0 (module docstring)."""
    B, V = logits.shape
    logits = unit_stride(logits)
    greedy = temperature == 0.0
    # PyTorch divides a CUDA tensor by a Python scalar as a product with the scalar's fp32 reciprocal (ATen's
    # div_true_kernel_cuda); the same product here gives the same scaled logits. The fp32 quotient is the float64
    # one rounded to fp32 (float64 carries more than twice fp32's bits), so no tensor is built per call.
    inv_t = 1.0 if greedy else _fp32(1.0 / _fp32(temperature))
    dev = logits.device
    chip = chip_for(logits)
    chunk, block, warps = tuned("sampler.chunk", chip), tuned("sampler.block", chip), tuned("sampler.warps", chip)
    combine_warps = tuned("sampler.combine_warps", chip)
    thresh = torch.empty(B, dtype=torch.float32, device=dev)
    nch, nch_p = triton.cdiv(V, chunk), triton.next_power_of_2(triton.cdiv(V, chunk))
    best_val = torch.empty(B, nch, dtype=torch.float32, device=dev)
    best_idx = torch.empty(B, nch, dtype=torch.int32, device=dev)
    part_max, part_sum = torch.empty_like(best_val), torch.empty_like(best_val)
    tokens = torch.empty(B, dtype=torch.int64, device=dev)
    lps = torch.empty(B, dtype=torch.float32, device=dev)
    if not B:
        return tokens, lps
    pdl = pdl_launch(logits)

    lse = torch.empty(B, dtype=torch.float32, device=dev)

    def sampling_pass(nucleus: bool) -> None:
        """The sampling pass over every row (masked by `thresh` if nucleus) and its combine."""
        _sample_chunk_kernel[(B, nch)](logits, logits.stride(0), keys, positions, thresh, best_val, best_idx,
                                       part_max, part_sum, V, inv_t, CHUNK=chunk, BLOCK=block, GREEDY=greedy,
                                       NUCLEUS=nucleus, num_warps=warps, **pdl)
        _sample_combine_kernel[(B,)](logits, logits.stride(0), best_val, best_idx, part_max, part_sum, tokens, lps,
                                     lse, inv_t, NCH=nch, NCH_P=nch_p, num_warps=combine_warps, **pdl)

    if greedy or top_p >= 1.0:
        sampling_pass(False)
        return tokens, lps
    scale = float(2 ** (62 - V.bit_length()))  # as `sampling._nucleus_threshold`: n * scale < 2**62
    top_p_t = _top_p_tensor(top_p, dev)
    if logits.dtype != torch.bfloat16:
        srt = torch.sort(logits, dim=-1, descending=True).values.contiguous()
        _nucleus_kernel[(B,)](srt, thresh, top_p_t, inv_t, scale, V=V, BLOCK=block,
                              num_warps=tuned("sampler.sort_path_warps", chip))
        sampling_pass(True)
        return tokens, lps
    # Gumbel-max over every logit first: where that token is in the nucleus, it is also the nucleus' Gumbel-max (a
    # subset's maximum, lowest id on ties, is the whole set's when the set's lies in it), so the row is done. A row's
    # draw is a sample of its own softmax, so in expectation at least top_p of rows are done; only the others (the
    # plan) run the search and a masked pass, their chunks spread over the GPU. The first pass's chunk maxima are the
    # search's row maxima, its logsumexp the planned rows' log-probs'.
    sampling_pass(False)
    check = torch.empty(B, nch, 2, dtype=torch.int64, device=dev)
    _nucleus_check_kernel[(B, nch)](logits, logits.stride(0), part_max, tokens, check, V, inv_t, scale, NCH=nch,
                                    NCH_P=nch_p, CHUNK=chunk, BLOCK=tuned("sampler.nucleus_block", chip),
                                    num_warps=warps, enable_fp_fusion=False, **pdl)
    plan = torch.empty(1 + 2 * B, dtype=torch.int32, device=dev)
    _nucleus_plan_kernel[(1,)](check, top_p_t, plan, B, NCH=nch, RB=tuned("sampler.plan_rows", chip),
                               num_warps=tuned("sampler.plan_warps", chip), **pdl)
    parts, cur = _nucleus_search(logits, top_p_t, inv_t, scale, part_max, plan)
    schunk = tuned("sampler.search_chunk", chip)
    ns = triton.cdiv(V, schunk)
    ns_p = triton.next_power_of_2(ns)
    best_val, best_idx = best_val.new_empty(B, ns), best_idx.new_empty(B, ns)
    _nucleus_sample_kernel[(_search_programs(B, V, dev),)](
        logits, logits.stride(0), keys, positions, parts, cur, top_p_t, plan, best_val, best_idx, V, inv_t,
        BITS=tuned("sampler.bits", chip), NS=ns, NS_P=ns_p, SCHUNK=schunk, BLOCK=min(block, schunk), num_warps=warps,
        **pdl)
    _nucleus_combine_kernel[(B,)](logits, logits.stride(0), best_val, best_idx, lse, plan, tokens, lps, inv_t, B,
                                  NS=ns, NS_P=ns_p, num_warps=combine_warps, **pdl)
    return tokens, lps


@sample.register_fake
def _(logits, keys, positions, temperature, top_p):
    B = logits.shape[0]
    return logits.new_empty(B, dtype=torch.int64), logits.new_empty(B, dtype=torch.float32)
