"""The generator's bookkeeping around a decode step, in two launches on CUDA instead of ~25 ATen ones.

Before the model: each row's KV slot (its block table at position // block_size), its sequence length, the position
its sampled token will have and its RoPE cos / sin rows, gathered from tables `rope_cos_sin` computed once for every
position (the same op on the same positions: the same values). After the sampler: the token and log-prob written
to the ring row, the row's token and position advanced, the ring index moved on.

A decode step of Qwen3-0.6B at 40 rows ran ~35 ATen kernels besides the model's (~45 us of kernel time alone, and
ATen kernels do not start early under programmatic dependent launch; `benchmarks/profile_decode_step.py`, H200).
Elsewhere (CPU) the same arithmetic runs as ATen ops, and the model computes its own RoPE.
"""

from __future__ import annotations

import torch
from torch import Tensor

from monorl.ops import HAS_TRITON, pdl_launch, use_triton
from monorl.ops.tunables import chip_for, tuned

if HAS_TRITON:
    import triton
    import triton.language as tl

    from monorl.ops import pdl_start

    @triton.jit
    def _step_inputs_kernel(pos_ptr, bt_ptr, stride_bt, width, slots_ptr, lens_ptr, next_ptr, cos_t_ptr, sin_t_ptr,
                            cos_ptr, sin_ptr, positions, off_ptr, BS: tl.constexpr, D: tl.constexpr,
                            ROPE: tl.constexpr, OFFSET: tl.constexpr = False, PDL: tl.constexpr = False):
        if PDL:  # wait for the kernel before (programmatic dependent launch)
            pdl_start()
        b = tl.program_id(0).to(tl.int64)
        p = tl.load(pos_ptr + b)
        blk = tl.load(bt_ptr + b * stride_bt + tl.minimum(p // BS, width - 1)).to(tl.int64)
        tl.store(slots_ptr + b, blk * BS + p % BS)
        tl.store(lens_ptr + b, (p + 1).to(tl.int32))
        tl.store(next_ptr + b, p + 1)
        if ROPE:  # padded rows' positions run on between host checks: clamped, as their block index is
            d = tl.arange(0, D)
            q = p - tl.load(off_ptr + b) if OFFSET else p  # the RoPE position: the index less the row's offset
            row = tl.minimum(q, positions - 1) * D
            tl.store(cos_ptr + b * D + d, tl.load(cos_t_ptr + row + d))
            tl.store(sin_ptr + b * D + d, tl.load(sin_t_ptr + row + d))

    @triton.jit
    def _commit_kernel(tok_in_ptr, lp_in_ptr, ring_tok_ptr, ring_lp_ptr, stride_ring_tok, stride_ring_lp, ring_idx_ptr,
                       tok_ptr, pos_ptr, B, ring_size, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:
            pdl_start()
        r = tl.load(ring_idx_ptr)
        b = tl.arange(0, BLOCK)
        m = b < B
        t = tl.load(tok_in_ptr + b, mask=m)
        tl.store(ring_tok_ptr + r * stride_ring_tok + b, t, mask=m)
        tl.store(ring_lp_ptr + r * stride_ring_lp + b, tl.load(lp_in_ptr + b, mask=m), mask=m)
        tl.store(tok_ptr + b, t, mask=m)
        tl.store(pos_ptr + b, tl.load(pos_ptr + b, mask=m) + 1, mask=m)
        tl.debug_barrier()  # every thread has read the ring index before it moves
        tl.store(ring_idx_ptr, tl.minimum(r + 1, ring_size))


def step_inputs(pos: Tensor, block_tables: Tensor, block_size: int, rope_tables: tuple[Tensor, Tensor] | None,
                offset: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """pos int64 [B] (each row's current token's position), block_tables int32 [B, W] -> (KV slots int64 [B],
    sequence lengths int32 [B] (with the current token), the sampled token's positions int64 [B], (cos, sin)
    [B, D] from `rope_tables` (each [positions, D]) or None without them). A row's table index is clamped to W - 1
    (a padded row's position runs on between host checks; its writes stay in range). offset int64 [B]: each row's
    index less its RoPE position (M-RoPE of a prompt with images): the cos / sin rows are gathered at pos - offset."""
    B, W = block_tables.shape
    if rope_tables is None or not use_triton(pos) or B == 0:
        blk = block_tables.gather(1, (pos // block_size).clamp_(max=W - 1)[:, None])[:, 0]
        rope = None
        if rope_tables is not None:
            rows = (pos if offset is None else pos - offset).clamp(max=rope_tables[0].shape[0] - 1)
            rope = rope_tables[0][rows], rope_tables[1][rows]
        return blk.long() * block_size + pos % block_size, (pos + 1).to(torch.int32), pos + 1, rope
    cos_t, sin_t = rope_tables
    D = cos_t.shape[1]
    slots, nxt = torch.empty_like(pos), torch.empty_like(pos)
    lens = torch.empty(B, dtype=torch.int32, device=pos.device)
    cos, sin = cos_t.new_empty(B, D), sin_t.new_empty(B, D)
    _step_inputs_kernel[(B,)](pos, block_tables, block_tables.stride(0), W, slots, lens, nxt, cos_t, sin_t, cos,
                              sin, cos_t.shape[0], pos if offset is None else offset, BS=block_size, D=D, ROPE=True,
                              OFFSET=offset is not None,
                              num_warps=tuned("decode_state.step_warps", chip_for(pos)), **pdl_launch(pos))
    return slots, lens, nxt, (cos, sin)


def commit_step(tokens: Tensor, logprobs: Tensor, ring_tok: Tensor, ring_lp: Tensor, ring_idx: Tensor, tok: Tensor,
                pos: Tensor) -> None:
    """After sampling B rows: ring_tok[i, :B] = tokens and ring_lp[i, :B] = logprobs at i = ring_idx, tok[:B] =
    tokens, pos[:B] += 1, ring_idx = min(i + 1, the ring's last (overflow) row)."""
    B = tokens.shape[0]
    ring_size = ring_tok.shape[0] - 1
    if not use_triton(tokens) or B == 0:
        ring_tok[:, :B].index_copy_(0, ring_idx, tokens[None])
        ring_lp[:, :B].index_copy_(0, ring_idx, logprobs[None])
        ring_idx.add_(1).clamp_(max=ring_size)
        tok[:B].copy_(tokens)
        pos[:B].add_(1)
        return
    _commit_kernel[(1,)](tokens, logprobs, ring_tok, ring_lp, ring_tok.stride(0), ring_lp.stride(0), ring_idx, tok,
                         pos, B, ring_size, BLOCK=max(16, triton.next_power_of_2(B)),
                         num_warps=tuned("decode_state.commit_warps", chip_for(tokens)),
                         **pdl_launch(tokens))
