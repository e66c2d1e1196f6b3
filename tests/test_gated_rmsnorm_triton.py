"""Qwen3.5's gated RMSNorm in one Triton kernel (`monorl.ops.gated_rmsnorm`), run on CPU tensors by Triton's
interpreter against the module's PyTorch ops (`GatedRMSNorm`): rows of a fused projection's width (strided) and
contiguous ones, a head width that is not a power of two. fp32 only (the interpreter computes bf16 wrongly); bf16
on CUDA: tests/test_qwen3_5_gpu.py's generator test runs the fused copy."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.triton_interpreter import cases, interpreter_patches, outer, run_this_file_interpreted  # noqa: E402


@outer
def test_gated_rms_kernel_under_the_interpreter():
    run_this_file_interpreted(__file__)


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    from monorl.ops import gated_rmsnorm
    yield from interpreter_patches(monkeypatch, gated_rmsnorm)


@cases
@pytest.mark.parametrize("rows, d, strided", [(7, 128, False), (5, 96, True), (1, 64, True)])
def test_the_kernel_equals_the_modules_ops(rows, d, strided):
    from monorl.ops.gated_rmsnorm import gated_rms_norm_reference, launch

    g = torch.Generator().manual_seed(d)
    wide = torch.randn(rows, 3 * d, generator=g)
    x = wide[:, d:2 * d] if strided else wide[:, :d].contiguous()  # a column slice: rows of stride 3d
    gate = torch.randn(rows, d, generator=g) * 3
    w = torch.randn(d, generator=g)
    torch.testing.assert_close(launch(x, gate, w, 1e-6), gated_rms_norm_reference(x, gate, w, 1e-6),
                               rtol=1e-5, atol=1e-6)
