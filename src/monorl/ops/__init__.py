"""Kernels monorl owns, one file per kernel family. Most are batch-invariant: a row's result depends
neither on the other rows of the batch nor on the layout (decode step vs full-sequence forward).
`monorl.model.batch_invariant` converts a model to them; nothing here knows the model.

- `matmul_invariant`: x @ w^T, tiles and K order a function of the weight's shape only.
- `rmsnorm_invariant`, `logprob_invariant`: one fixed reduction order per row.
- `attention.kernel`: the one Triton attention kernel (varlen-causal and paged decode); the generator's
  ordinary paged decode runs it too.
- `attention.invariant`: the invariant attention ops (that kernel on CUDA, an exact CPU path elsewhere).
- `tree_sum`: the fixed-order sum every CPU path is built from.
- `rope`: RoPE's formula (the model's, and the fused kernels' CPU path).
- `block_kernels`, `sample_kernels`: the generator's fused Triton kernels (a block's elementwise work; the
  sampler), so its CUDA-graph decode step is fast without `torch.compile`. Row-local, rounding as eager.

On CUDA the ops run Triton kernels; on CPU, fixed-order tree reductions. Every op is defined through `custom_op`
(below), so that calling one does not import torch._dynamo in a run that compiles nothing.

The forward kernels launch with programmatic dependent launch on Hopper and later (`pdl_launch`): the GPU may
start a kernel while the one before it in the stream finishes, and the kernel's first act (`pdl_start`) is to wait
for that one's completion and memory, then let the next one start. In a decode step of ~300 small kernels the
gaps between them are a visible part of the step (benchmarks/RESULTS.md, 2026-11-24).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from monorl.speedups.private_apis import HAS_TRITON, disable_dynamo_lazily_

if HAS_TRITON:
    import triton
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def pdl_start():
        """A kernel launched by `pdl_launch` calls this before touching memory: wait until the kernel before it
        has completed and its writes are visible, then allow the next one to be launched (it waits the same way,
        so a chain of such kernels stays ordered)."""
        gdc_wait()
        gdc_launch_dependents()


def custom_op(name: str, mutates_args: tuple[str, ...] | str) -> Callable[[Callable], Any]:
    """`torch.library.custom_op(name, mutates_args=...)` as a decorator, its implementation's call made without
    importing torch._dynamo while nothing else has (`monorl.speedups.private_apis.disable_dynamo_lazily_`): every
    monorl op is defined through it."""

    def define(fn: Callable) -> Any:
        return disable_dynamo_lazily_(torch.library.custom_op(name, mutates_args=mutates_args)(fn))

    return define


@functools.cache
def _pdl_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9  # griddepcontrol is sm_90+ PTX


def pdl_launch(t: Tensor) -> dict:
    """Launch keywords for a kernel whose first statement is `if PDL: pdl_start()`, launching on t's device: on
    Hopper and later, the kernel's PDL flag and Triton's launch_pdl; elsewhere none (PDL stays False)."""
    if not t.is_cuda:
        return {}
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return {"PDL": True, "launch_pdl": True} if _pdl_capable(index) else {}


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def use_triton(t: Tensor) -> bool:
    return HAS_TRITON and t.is_cuda


def unit_stride(x: Tensor) -> Tensor:
    """x with a unit last-dim stride, copied only if needed: the kernels take row strides as arguments, so a fused
    GEMM's column slices pass as they are."""
    return x if x.stride(-1) == 1 else x.contiguous()


def sequence_of_rows(cu_seqlens: Tensor, rows: Tensor) -> Tensor:
    """Which sequence of a pack each of `rows` (>= 0) lies in, cu_seqlens [S + 1] starting at 0 (a row past the last
    end gets S). Searched over the whole cu_seqlens, not `cu_seqlens[1:]`: Inductor cannot lower a search whose
    boundaries are a slice view (torch 2.11: NotImplementedError: SliceView, in a compiled batch-invariant layer)."""
    return torch.searchsorted(cu_seqlens, rows, right=True) - 1
