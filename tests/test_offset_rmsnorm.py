"""`monorl.ops.offset_rmsnorm`: the (1 + w) norm's kernel (the generator's CUDA copy of Gemma 3 and Qwen3.5) against
the module's own math, run on CPU tensors by Triton's interpreter (fp32 only: tests/triton_interpreter.py); without
triton (CPU CI) everything skips."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.triton_interpreter import cases, interpreter_patches, outer, run_this_file_interpreted  # noqa: E402


@outer
def test_offset_norm_kernel_under_the_interpreter():
    run_this_file_interpreted(__file__)


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    from monorl.ops import offset_rmsnorm
    yield from interpreter_patches(monkeypatch, offset_rmsnorm)


@cases
@pytest.mark.parametrize("layout", ["rows", "column slice", "heads"])
def test_kernel_equals_the_module(monkeypatch, layout):
    from monorl.ops import offset_rmsnorm

    monkeypatch.setattr(offset_rmsnorm, "use_triton", lambda t: True)  # CPU tensors through the kernel
    torch.manual_seed(0)
    D = 48  # not a power of two: the masked tail
    w = torch.randn(D)
    x = {"rows": torch.randn(7, D) * 3, "column slice": torch.randn(7, 3 * D)[:, D:2 * D],
         "heads": torch.randn(5, 4, D)}[layout]
    got = offset_rmsnorm.offset_rms_norm(x, w, 1e-6)
    assert got.shape == x.shape
    torch.testing.assert_close(got, offset_rmsnorm.offset_rms_norm_reference(x, w, 1e-6), rtol=1e-6, atol=1e-6)
    bad = offset_rmsnorm.offset_rms_norm(x, w + 0.01, 1e-6)  # a 1% weight change shows
    assert not torch.allclose(bad, got, rtol=1e-4, atol=1e-4)
