"""Kernels monorl owns, one file per kernel family. Most are batch-invariant: a row's result depends
neither on the other rows of the batch nor on the layout (decode step vs full-sequence forward).
`monorl.model.batch_invariant` converts a model to them; nothing here knows the model.

- `matmul_invariant`: x @ w^T, tiles and K order a function of the weight's shape only.
- `rmsnorm_invariant`, `logprob_invariant`: one fixed reduction order per row.
- `attention_triton`: the one Triton attention kernel (varlen-causal and paged decode); the generator's
  ordinary paged decode runs it too.
- `attention_invariant`: the invariant attention ops (that kernel on CUDA, an exact CPU path elsewhere).
- `tree_sum`: the fixed-order sum every CPU path is built from.
- `block_kernels`, `sample_kernels`: the generator's fused Triton kernels (a block's elementwise work; the
  sampler), so its CUDA-graph decode step is fast without `torch.compile`. Row-local, rounding as eager.

On CUDA the ops run Triton kernels; on CPU, fixed-order tree reductions.
"""

from __future__ import annotations

from torch import Tensor

try:  # triton only exists on the GPU machines
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU CI
    HAS_TRITON = False


def use_triton(t: Tensor) -> bool:
    return HAS_TRITON and t.is_cuda


def unit_stride(x: Tensor) -> Tensor:
    """x with a unit last-dim stride, copied only if needed: the kernels take row strides as arguments, so a fused
    GEMM's column slices pass as they are."""
    return x if x.stride(-1) == 1 else x.contiguous()
