"""`monorl.ops.offset_rmsnorm`: the (1 + w) norm's kernel (the generator's CUDA copy of Gemma 3 and Qwen3.5), and
Gemma 3's other fused kernels (`monorl.model.gemma3_fused`: the seam's add + norms, the q/k norm + RoPE + KV
write, GeGLU) against the module's own math, run on CPU tensors by Triton's interpreter (fp32 only:
tests/triton_interpreter.py); without triton (CPU CI) everything skips."""

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
    from monorl.ops import block_kernels, offset_rmsnorm
    yield from interpreter_patches(monkeypatch, offset_rmsnorm, block_kernels)


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


@cases
def test_add_norm_kernel_equals_the_eager_ops(monkeypatch):
    """Gemma 3's seam (`offset_add_norm`): post-norm, residual add and the next pre-norm in one kernel."""
    from monorl.ops import offset_rmsnorm

    monkeypatch.setattr(offset_rmsnorm, "use_triton", lambda t: True)
    torch.manual_seed(1)
    D = 48
    x, wa, wh = torch.randn(6, D) * 4, torch.randn(D), torch.randn(D)
    a = torch.randn(6, 2 * D)[:, :D] * 30  # a column slice: the kernel reads its row stride
    h, n = offset_rmsnorm.offset_add_norm(x, a, wa, wh, 1e-6)
    ref_h = x + offset_rmsnorm.offset_rms_norm_reference(a, wa, 1e-6)
    torch.testing.assert_close(h, ref_h, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(n, offset_rmsnorm.offset_rms_norm_reference(ref_h, wh, 1e-6), rtol=1e-6, atol=1e-6)
    _, swapped = offset_rmsnorm.offset_add_norm(x, a, wh, wa, 1e-6)  # the two weights are not interchangeable
    assert not torch.allclose(swapped, n, rtol=1e-3, atol=1e-3)


@cases
@pytest.mark.parametrize("tokens", [3, 70])  # q and k heads in separate programs (a decode step's few) or one
def test_offset_qk_norm_rope_kernel_equals_the_eager_ops(monkeypatch, tokens):
    """The (1 + w) q/k norm + RoPE + KV write (`offset_qk_norm_rope_write_kv`) against the module's own math
    (`offset_rms_norm_reference`, `apply_rope`, `write_kv`), on a fused q/k/v GEMM's column slices."""
    from monorl.ops import block_kernels
    from monorl.ops.offset_rmsnorm import offset_rms_norm_reference
    from monorl.ops.rope import apply_rope

    monkeypatch.setattr(block_kernels, "use_triton", lambda t: True)
    torch.manual_seed(2)
    T, Hq, Hkv, D = tokens, 4, 2, 16
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D) * 3
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    qw, kw = torch.randn(D), torch.randn(D)
    ang = torch.rand(T, D // 2) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    cache = torch.zeros(2, 40, 4, Hkv, D)
    slots = torch.randperm(160)[:T]
    got_q, got_k = block_kernels.offset_qk_norm_rope_write_kv(q, k, v, qw, kw, cos, sin, 1e-6, cache, slots)
    want_q = apply_rope(offset_rms_norm_reference(q.reshape(T, Hq, D), qw, 1e-6), cos, sin)
    want_k = apply_rope(offset_rms_norm_reference(k.reshape(T, Hkv, D), kw, 1e-6), cos, sin)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache[0].view(-1, Hkv, D)[slots], want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache[1].view(-1, Hkv, D)[slots], v.reshape(T, Hkv, D))
    assert int((cache[0].view(-1, Hkv * D).abs().sum(-1) > 0).sum()) == T  # nothing written elsewhere


@cases
def test_gelu_tanh_mul_kernel_equals_the_eager_ops(monkeypatch):
    from monorl.ops import block_kernels

    monkeypatch.setattr(block_kernels, "use_triton", lambda t: True)
    torch.manual_seed(3)
    gate_up = torch.randn(5, 2 * 300) * 4
    gate, up = gate_up.split([300, 300], dim=-1)
    gate[0, :4] = torch.tensor([-60.0, 60.0, 0.0, -3.0])  # the tanh saturating both ways
    got = block_kernels.gelu_tanh_mul(gate, up)
    torch.testing.assert_close(got, torch.nn.functional.gelu(gate, approximate="tanh") * up, rtol=1e-5, atol=1e-5)
