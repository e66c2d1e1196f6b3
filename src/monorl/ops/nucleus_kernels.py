"""The sampler's top-p nucleus as Triton kernels (CUDA), launched by `sample_kernels`: a row's threshold from its
sorted logits (`_nucleus_kernel`), or, for bf16 logits, without sorting by a search over the 16-bit order key
(`_row_max_kernel`, `_nucleus_check_kernel` for the rows whose Gumbel-max token is outside the nucleus, then
`_nucleus_plan_kernel`, `_nucleus_level_kernel` a level of bits at a time, `_nucleus_final_kernel`), each an exact
integer fixed-point count as `monorl.generate.sampling._nucleus_threshold` computes it."""

from __future__ import annotations

from monorl.ops import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from monorl.ops import pdl_start

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
    def _load_block(row, start, i, V, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Logits i .. i + BLOCK - 1 of the chunk at row (the chunk's first logit is the row's `start`-th) as fp32,
        -inf past the chunk or the row. The passes below load block i + 1 before they work on block i (the loop's
        loads are otherwise issued one at a time: each waits out its latency with nothing else in flight)."""
        v = i + tl.arange(0, BLOCK)
        return tl.load(row + v, mask=(v < CHUNK) & (start + v < V), other=float("-inf")).to(tl.float32)

    @triton.jit
    def _order_key(x):
        """An fp32 holding a bf16 value -> the bf16's 16-bit order key (int32 in [0, 65535], ordered as the values)."""
        b = (x.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
        return tl.where(b >= 0x8000, 0xFFFF - b, b + 0x8000)

    @triton.jit
    def _row_max_kernel(logits_ptr, stride_b, pmax_ptr, V, inv_t, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr = False):
        """One chunk of one row: max(logits * inv_t) over the chunk."""
        if PDL:  # wait for the kernel before (programmatic dependent launch)
            pdl_start()
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        for i in range(0, CHUNK, BLOCK):
            v = c * CHUNK + i + tl.arange(0, BLOCK)
            x = tl.load(logits_ptr + b * stride_b + v, mask=v < V, other=float("-inf")).to(tl.float32)
            m = tl.maximum(m, x * inv_t)
        tl.store(pmax_ptr + b * tl.num_programs(1) + c, tl.max(m, axis=0))

    @triton.jit
    def _nucleus_choice(parts_ptr, cur_ptr, top_p_ptr, b, level, BITS: tl.constexpr, NCH: tl.constexpr,
                        NCH_P: tl.constexpr):
        """The smallest-key bound after `level` (>= 1) levels: the previous level's range start plus its pick of
        2**BITS sub-ranges, from the masses at or above each sub-range's start (slot j: keys > start + j * width
        - 1; slot 0 of level 0 is the row's total, and every level's slot 0 reaches the limit)."""
        LEVELS: tl.constexpr = 16 // BITS
        W: tl.constexpr = 1 << BITS
        ch = tl.arange(0, NCH_P)
        j = tl.arange(0, W)
        row = parts_ptr + b * (LEVELS * NCH * W)
        total = tl.sum(tl.load(row + ch * W, mask=ch < NCH, other=0), axis=0)
        limit = libdevice.ceil(total.to(tl.float64) * tl.load(top_p_ptr)).to(tl.int64)
        prev = tl.load(row + (level - 1) * NCH * W + ch[:, None] * W + j[None, :], mask=ch[:, None] < NCH, other=0)
        below = tl.sum((tl.sum(prev, axis=0) >= limit).to(tl.int32), axis=0) - 1
        return tl.load(cur_ptr + b * LEVELS + level - 1) + (below << (16 - BITS * level))

    @triton.jit
    def _nucleus_check_kernel(logits_ptr, stride_b, pmax_ptr, tok_ptr, check_ptr, V, inv_t, scale, NCH: tl.constexpr,
                              NCH_P: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """One chunk of one row: the masses q of `_nucleus_level_kernel`, summed in all and above the order key of the
        row's unrestricted token (its Gumbel-max over every logit)."""
        if PDL:  # wait for the kernel before (programmatic dependent launch)
            pdl_start()
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        ch = tl.arange(0, NCH_P)
        top = tl.max(tl.load(pmax_ptr + b * NCH + ch, mask=ch < NCH, other=float("-inf")), axis=0)
        cut = _order_key(tl.load(logits_ptr + b * stride_b + tl.load(tok_ptr + b)).to(tl.float32))
        t = tl.zeros([BLOCK], tl.int64)
        a = tl.zeros([BLOCK], tl.int64)
        row = logits_ptr + b * stride_b + c * CHUNK
        x_next = _load_block(row, c * CHUNK, 0, V, CHUNK, BLOCK)
        for i in range(0, CHUNK, BLOCK):
            x = x_next
            x_next = _load_block(row, c * CHUNK, i + BLOCK, V, CHUNK, BLOCK)  # in flight while x is summed
            q = (libdevice.exp(x * inv_t - top) * scale).to(tl.int64)
            t += q
            a += tl.where(_order_key(x) > cut, q, 0)
        tl.store(check_ptr + (b * NCH + c) * 2, tl.sum(t, axis=0))
        tl.store(check_ptr + (b * NCH + c) * 2 + 1, tl.sum(a, axis=0))

    @triton.jit
    def _nucleus_plan_kernel(check_ptr, top_p_ptr, plan_ptr, B, NCH: tl.constexpr, RB: tl.constexpr,
                             PDL: tl.constexpr = False):
        """One program: the rows whose unrestricted token is not in the nucleus (`_nucleus_check_kernel`'s masses:
        the mass above its key reaches the limit), as plan_ptr [1 + 2B] int32 = (their count, the rows in order, a
        0/1 flag a row), so that the search's programs go to those rows alone."""
        if PDL:  # wait for the kernel before (programmatic dependent launch)
            pdl_start()
        n = tl.zeros([], tl.int32)
        for r0 in range(0, B, RB):
            r = r0 + tl.arange(0, RB)
            m = r < B
            total = tl.zeros([RB], tl.int64)
            above = tl.zeros([RB], tl.int64)
            for c in range(NCH):  # exact integer sums, in any order
                total += tl.load(check_ptr + (r * NCH + c) * 2, mask=m, other=0)
                above += tl.load(check_ptr + (r * NCH + c) * 2 + 1, mask=m, other=0)
            limit = libdevice.ceil(total.to(tl.float64) * tl.load(top_p_ptr)).to(tl.int64)
            need = ((above >= limit) & m).to(tl.int32)
            tl.store(plan_ptr + 1 + n + tl.cumsum(need, axis=0) - need, r, mask=need > 0)
            tl.store(plan_ptr + 1 + B + r, need, mask=m)
            n += tl.sum(need, axis=0)
        tl.store(plan_ptr, n)

    @triton.jit
    def _nucleus_level_kernel(logits_ptr, stride_b, pmax_ptr, parts_ptr, cur_ptr, top_p_ptr, plan_ptr, V, inv_t,
                              scale, LEVEL: tl.constexpr, BITS: tl.constexpr, NCH: tl.constexpr,
                              NCH_P: tl.constexpr, NS: tl.constexpr, NS_P: tl.constexpr, SCHUNK: tl.constexpr,
                              BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Level LEVEL of the nucleus search over one SCHUNK of one planned row of bf16 logits: the fixed-point masses
        q of `_nucleus_kernel` (exact integers) summed at or above each start of the 2**BITS sub-ranges the level
        splits its key range into. The programs walk the (planned row, chunk) pairs, NS chunks a row; pmax: the
        row's NCH chunk maxima."""
        if PDL:  # wait for the kernel before (programmatic dependent launch)
            pdl_start()
        LEVELS: tl.constexpr = 16 // BITS
        W: tl.constexpr = 1 << BITS
        for it in range(tl.program_id(0), tl.load(plan_ptr) * NS, tl.num_programs(0)):
            b = tl.load(plan_ptr + 1 + it // NS).to(tl.int64)
            c = it % NS
            ch = tl.arange(0, NCH_P)
            top = tl.max(tl.load(pmax_ptr + b * NCH + ch, mask=ch < NCH, other=float("-inf")), axis=0)
            if LEVEL == 0:
                cur = 0
            else:
                cur = _nucleus_choice(parts_ptr, cur_ptr, top_p_ptr, b, LEVEL, BITS, NS, NS_P)
            if c == 0:
                tl.store(cur_ptr + b * LEVELS + LEVEL, cur)
            starts = cur + tl.arange(0, W)[None, :] * (1 << (16 - BITS * (LEVEL + 1))) - 1
            acc = tl.zeros([BLOCK, W], tl.int64)
            row = logits_ptr + b * stride_b + c * SCHUNK
            x_next = _load_block(row, c * SCHUNK, 0, V, SCHUNK, BLOCK)
            for i in range(0, SCHUNK, BLOCK):
                x = x_next
                x_next = _load_block(row, c * SCHUNK, i + BLOCK, V, SCHUNK, BLOCK)  # in flight while x is summed
                q = (libdevice.exp(x * inv_t - top) * scale).to(tl.int64)
                acc += tl.where(_order_key(x)[:, None] > starts, q[:, None], 0)
            tl.store(parts_ptr + ((b * LEVELS + LEVEL) * NS + c) * W + tl.arange(0, W), tl.sum(acc, axis=0))

    @triton.jit
    def _nucleus_threshold(parts_ptr, cur_ptr, top_p_ptr, b, inv_t, BITS: tl.constexpr, NS: tl.constexpr,
                           NS_P: tl.constexpr):
        """The smallest key K with mass(keys > K) < limit is the nucleus' smallest logit (see `_nucleus_bisect`):
        that logit times inv_t."""
        k = _nucleus_choice(parts_ptr, cur_ptr, top_p_ptr, b, 16 // BITS, BITS, NS, NS_P)
        bits = tl.where(k >= 0x8000, k - 0x8000, 0xFFFF - k) << 16
        return bits.to(tl.float32, bitcast=True) * inv_t

    @triton.jit
    def _nucleus_final_kernel(parts_ptr, cur_ptr, top_p_ptr, thresh_ptr, plan_ptr, inv_t, B, BITS: tl.constexpr,
                              NS: tl.constexpr, NS_P: tl.constexpr, PDL: tl.constexpr = False):
        """Program b: the planned row b's threshold (`_nucleus_threshold`) to thresh_ptr."""
        if PDL:  # wait for the kernel before (programmatic dependent launch)
            pdl_start()
        b = tl.program_id(0).to(tl.int64)
        if tl.load(plan_ptr + 1 + B + b) != 0:
            tl.store(thresh_ptr + b, _nucleus_threshold(parts_ptr, cur_ptr, top_p_ptr, b, inv_t, BITS, NS, NS_P))
