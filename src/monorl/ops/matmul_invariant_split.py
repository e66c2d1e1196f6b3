"""The batch-invariant GEMM's K parts: one K split for every row count, so a decode step's few rows can run more
programs than its output tiles and still reduce exactly as the trainer's many rows do.

Why: at 40 rows `matmul_invariant`'s decode tiling runs cdiv(N, BLOCK_N) programs, one K loop each, 64-128 of an
H100's 132 SMs for Qwen3-0.6B's layer products (issue #62: ~2.8x the weight's bytes floor). The default mode splits
K by the rows (`decode_gemm`); the invariant mode may not, since a row's value must not depend on the batch.

The split: a product over K columns has `k_parts` parts -- a pure function of K and the chip (`matmul_split.parts`,
never of N or M: a fused [q | k | v] or [gate | up] weight then splits exactly as its pieces do, and the trainer's
unfused projections as the generator's fused ones). Part p is an fp32 sum, from zero, over its own run of whole
`matmul_split.part_align` columns (every tiling's BLOCK_K divides it, so each part is whole K blocks whatever the
tiling), and the parts are added ((p0 + p1) + p2) + ... in fp32 before the one rounding to the output dtype. One
part is the single K loop the kernels always ran. Two kernels compute it, bitwise alike:

- many rows (`matmul_invariant._mm_kernel`, and `_mm_silu_kernel`): one program per output tile walks the parts
  itself, a fresh accumulator each, added into the total at each part's end; no extra memory;
- few rows (`partials`, here: `decode_gemm._split_k_kernel`, a program per (tile, part)): each part's fp32 sums to
  memory; the next kernel adds them as it loads them (the block's residual add + norm takes them as they are,
  `fused_kernels.project`), or `decode_gemm.sum_parts` does (one launch).

`partials_pay` chooses between them by M and by whether the one-loop tiling leaves SMs idle; the values are the same
either way (tests/test_matmul_invariant_split.py under Triton's interpreter, tests/test_matmul_invariant_split_gpu.py
on CUDA). The CPU path (`matmul_invariant._mm_cpu`) does not split: its fixed pairwise tree is invariant already.
"""

from __future__ import annotations

import torch
from torch import Tensor

from monorl.ops import HAS_TRITON, custom_op, pdl_launch, sm_count, use_triton
from monorl.ops.tunables import HOPPER, chip_of, threshold_pick, tuned

if HAS_TRITON:
    import triton

    from monorl.ops.decode_gemm import _split_k_kernel


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch_chip(x: Tensor) -> str:
    """The table's chip for a launch on x: its GPU's; CPU tensors (Triton's interpreter, in tests) take Hopper's."""
    return chip_of(x.device.index or 0) if x.is_cuda else HOPPER


def k_parts(K: int, chip: str = HOPPER, parts: int | None = None) -> tuple[int, int]:
    """(parts, part length) of a product over K columns on `chip`: `matmul_split.parts`' count for K (1 where it
    has none), or `parts` where given (tests, tuning), each part `matmul_split.part_align`-aligned; parts that would
    start past K are dropped (K = 300 in 4 parts of 128: 3 parts)."""
    requested = parts if parts is not None else dict(tuned("matmul_split.parts", chip)).get(K, 1)
    if requested < 1:
        raise ValueError(f"matmul_split.parts: {requested} parts for K = {K}; set a count of at least 1")
    align = tuned("matmul_split.part_align", chip)
    length = max(1, _cdiv(_cdiv(K, requested), align)) * align
    return max(1, _cdiv(K, length)), length


def partials_config(M: int, N: int, parts: int, sms: int, chip: str = HOPPER) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of `partials`: the decode tiling's 64-row tiles on 4 warps (the
    wgmma every invariant tiling runs), the narrowest column tile whose (tile, part) programs fit the SMs once (up
    to `matmul_split.max_block_n`), and the decode tiling's pipeline depth for that many waves."""
    bm, bk, warps = tuned("matmul.decode_tile", chip)
    widest, bn = tuned("matmul_split.max_block_n", chip), 16
    tiles = _cdiv(M, bm)
    while parts * tiles * _cdiv(N, bn) > sms and bn < widest:
        bn *= 2
    stages = threshold_pick(tuned("matmul.decode_stages", chip), _cdiv(parts * tiles * _cdiv(N, bn), sms))
    return bm, bn, bk, warps, stages


def partials_pay(M: int, N: int, one_loop_tiles: int, parts: int, sms: int, chip: str = HOPPER) -> bool:
    """Whether a product of M rows runs as `partials` rather than the one-program-a-tile kernel: more than one part,
    at most `matmul_split.partials_rows` rows, on a GPU whose tiling may follow M (both tilings compute each element
    alike there: tests/test_batch_invariant_gpu.py), and where the one-loop tiling's `one_loop_tiles` programs leave
    SMs idle (an LM head's thousand tiles gain nothing from writing its parts out)."""
    return (parts > 1 and M <= tuned("matmul_split.partials_rows", chip) and one_loop_tiles < sms
            and tuned("matmul.tiling_follows_m", chip))


def partials(x: Tensor, w: Tensor, parts: int | None = None,
             config: tuple[int, int, int, int, int] | None = None, chip: str | None = None) -> Tensor:
    """x [M, K] @ w [N, K]^T as its `k_parts` parts' fp32 sums [P, M, N], a program per (column tile, part, row
    tile); `decode_gemm.sum_parts` of them is the product (Triton; `parts` / `config` / `chip` given by tests and
    tuning, else the table's for x's GPU)."""
    x, w = x.contiguous(), w.contiguous()
    M, K = x.shape
    N = w.shape[0]
    chip = chip or launch_chip(x)
    P, ks = k_parts(K, chip, parts)
    out = torch.empty(P, M, N, dtype=torch.float32, device=x.device)
    if M == 0:
        return out
    bm, bn, bk, nw, ns = config or partials_config(M, N, P, sm_count(x.device.index or 0), chip)
    if ks % bk:
        raise ValueError(f"matmul_split.part_align: parts of {ks} columns are not whole {bk}-column K blocks")
    _split_k_kernel[(triton.cdiv(N, bn), P, triton.cdiv(M, bm))](
        x, w, out, M, N, K, ks, x.stride(0), w.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=True,
        num_warps=nw, num_stages=ns, **pdl_launch(x))
    return out


def partials_fit(x: Tensor, w: Tensor) -> bool:
    """Whether `fused_kernels.project` hands the next add + norm this product's parts (`partials`): on the GPU path
    where `partials_pay` chooses them (a decode step's rows of a product with parts, e.g. o_proj, down_proj)."""
    if not (HAS_TRITON and use_triton(x) and x.dim() == 2):
        return False
    index = x.device.index or 0
    chip, sms = chip_of(index), sm_count(index)
    M, K = x.shape
    N = w.shape[0]
    P = k_parts(K, chip)[0]
    if P == 1:
        return False
    from monorl.ops.matmul_invariant import _mm_config  # (it imports this module)

    bm, bn = _mm_config(M, N, K, sms, chip=chip)[:2]
    return partials_pay(M, N, _cdiv(M, bm) * _cdiv(N, bn), P, sms, chip)


@custom_op("monorl::invariant_partials", mutates_args=())
def invariant_partials(x: Tensor, w: Tensor) -> Tensor:
    """`partials` with the table's parts, as an op (opaque to torch.compile), for `fused_kernels.project`: a decode
    step's o_proj / down_proj parts, which the next add + norm sums as it loads them. No backward: decode steps."""
    return partials(x, w)


@invariant_partials.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    P = k_parts(x.shape[1], launch_chip(x))[0]
    return x.new_empty(P, x.shape[0], w.shape[0], dtype=torch.float32)
