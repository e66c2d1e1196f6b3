"""The batch-invariant GEMM's K parts (`monorl.ops.matmul_invariant_split`, issue #62) under Triton's interpreter,
fp32: the many-rows kernel (a program per output tile walking the parts, `matmul_invariant._mm_kernel`) equals the
few-rows one (a program per (tile, part) writing fp32 partials, then their sum in order, or the residual add + norm
summing them as it loads), bitwise, at 1 to 300 rows and 1, 2 or 4 parts of a K that is no multiple of the part
length; a row alone equals it in a batch; one part is the one-loop kernel the GEMM ran before.

Both kernels run the same tile (64 x 32 x 128) here: the interpreter's dot is numpy's matmul a K block at a time,
whose rounding follows the block's shape, so the tilings' independence is the GPU's property (checked on CUDA by
tests/test_batch_invariant_gpu.py and tests/test_matmul_invariant_split_gpu.py); what is checked here is the parts:
where each starts, that each sums from zero, the order they are added in."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.triton_interpreter import cases, interpreter_patches, outer, run_this_file_interpreted  # noqa: E402

TILE = (64, 32, 128, 4, 1)  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of both kernels here
K, N = 1000, 48  # K: 2 parts of 512, 4 of 256 (the last part short); N: a partial column tile


@outer
def test_split_kernels_under_the_interpreter():
    run_this_file_interpreted(__file__)


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    from monorl.ops import block_kernels, decode_gemm
    yield from interpreter_patches(monkeypatch, block_kernels, decode_gemm)


def _data(M: int = 300, k: int = K, n: int = N, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5


def _tile_walks_parts(x: torch.Tensor, w: torch.Tensor, parts: int) -> torch.Tensor:
    from monorl.ops import matmul_invariant
    return matmul_invariant._mm_triton(x, w, TILE, parts=parts)


def _partials_then_sum(x: torch.Tensor, w: torch.Tensor, parts: int) -> torch.Tensor:
    from monorl.ops import decode_gemm, matmul_invariant_split
    p = matmul_invariant_split.partials(x, w, parts=parts, config=TILE)
    out = decode_gemm._sum_parts_triton(p, x.dtype)  # the one-launch sum a CUDA product runs
    assert torch.equal(out, decode_gemm.sum_parts(p, x.dtype))  # = the PyTorch order
    return out


def test_part_lengths_are_whole_aligned_runs_of_k():
    from monorl.ops.matmul_invariant_split import k_parts
    assert k_parts(1000, parts=1) == (1, 1024) and k_parts(1000, parts=2) == (2, 512)
    assert k_parts(1000, parts=4) == (4, 256) and k_parts(300, parts=4) == (3, 128)  # a part past K is dropped
    assert k_parts(1024) == (1, 1024)  # the table's default: one K loop
    with pytest.raises(ValueError, match="matmul_split.parts: 0 parts for K = 64"):
        k_parts(64, parts=0)


@cases
@pytest.mark.parametrize("parts", [1, 2, 4])
@pytest.mark.parametrize("M", [1, 7, 40, 300])
def test_a_program_a_tile_equals_a_program_a_part(parts, M):
    x, w = _data()
    assert torch.equal(_tile_walks_parts(x[:M], w, parts), _partials_then_sum(x[:M], w, parts))


@cases
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_rows_alone_equal_the_rows_of_a_batch(parts):
    """The trainer's many rows (one kernel) and the generator's few (either): a row's value is the same."""
    x, w = _data()
    full = _tile_walks_parts(x, w, parts)
    for M in (1, 7, 40):
        assert torch.equal(_tile_walks_parts(x[:M], w, parts), full[:M]), M
        assert torch.equal(_partials_then_sum(x[:M], w, parts), full[:M]), M
    torch.testing.assert_close(full, x @ w.t(), atol=1e-4, rtol=1e-4)


@cases
def test_a_fused_weight_splits_as_its_pieces():
    """Parts are a function of K alone: [q | k]'s product is q's and k's, column for column (tile-aligned)."""
    x, w = _data(40, n=64)
    for parts in (2, 4):
        fused = _tile_walks_parts(x, w, parts)
        assert torch.equal(fused, torch.cat([_tile_walks_parts(x, w[:32].contiguous(), parts),
                                             _tile_walks_parts(x, w[32:].contiguous(), parts)], dim=1))
        assert torch.equal(_partials_then_sum(x, w, parts), fused)


if __import__("os").environ.get("TRITON_INTERPRET") == "1":
    import triton
    import triton.language as tl

    @triton.jit
    def _one_loop_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """`matmul_invariant._mm_kernel` as it was before K parts (commit d143caf), verbatim but for PDL."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # one fixed K order: no split-K
            kk = k0 + offs_k
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + kk[None, :],
                        mask=(offs_m[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(b_ptr + offs_n[:, None] * stride_bn + kk[None, :],
                        mask=(offs_n[:, None] < N) & (kk[None, :] < K), other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@cases
def test_one_part_is_the_one_loop_kernel():
    x, w = _data()
    bm, bn, bk = TILE[:3]
    before = torch.empty(x.shape[0], N)
    _one_loop_kernel[(triton.cdiv(x.shape[0], bm), triton.cdiv(N, bn))](
        x, w, before, x.shape[0], N, K, x.stride(0), w.stride(0), before.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    assert torch.equal(_tile_walks_parts(x, w, 1), before)
    assert not torch.equal(_tile_walks_parts(x, w, 2), before)  # two parts do round differently (else 1 == 2 proves
    # nothing above)


@cases
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_the_next_add_and_norm_sums_the_parts_as_the_product(parts):
    """The generator's o/down parts, summed by the residual add + norm as it loads them (`add_parts_rms_norm`'s
    kernel), give the trainer's h and norm from the product (`add_rms_norm`'s), bitwise."""
    from monorl.ops import block_kernels, matmul_invariant_split

    x, w = _data(40)
    h, ln = torch.randn(40, N), torch.rand(N)
    fused = block_kernels._add_rms_norm_triton(h, matmul_invariant_split.partials(x, w, parts=parts, config=TILE),
                                               ln, 1e-6, parts=matmul_invariant_split.k_parts(K, parts=parts)[0])
    plain = block_kernels._add_rms_norm_triton(h, _tile_walks_parts(x, w, parts), ln, 1e-6, parts=0)
    assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])


@cases
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_silu_epilogue_walks_the_same_parts(parts):
    """The fused gate/up GEMM with SiLU * up (`_mm_silu_kernel`) equals the GEMM with the same parts, then the SiLU
    kernel, bitwise: its gate and up sums are the unfused products' (64 intermediate columns: two 32-column tiles)."""
    from monorl.ops import block_kernels, matmul_invariant

    inter = 64
    x, w = _data(40, n=2 * inter)
    out = torch.empty(40, inter)
    fused = matmul_invariant._mm_silu_triton(x, w, out, (64, 64, 128, 4, 1), parts=parts)  # halved to 32 columns
    gate_up = _tile_walks_parts(x, w, parts)
    ref = torch.empty(40, inter)
    block_kernels._silu_mul_kernel[(40, 1)](gate_up, gate_up[:, inter:], ref, inter, gate_up.stride(0),
                                            gate_up.stride(0), BLOCK=64)
    assert torch.equal(fused, ref)
