"""Qwen3.5's layer seams on fused kernels (`monorl.model.qwen3_5_fused`) on a GPU in bf16: the residual add + (1 + w)
norm kernel against the eager ops, and a CUDA generator whose copy runs them (with the gated attention's kernels) as
close to the trainer as the eager copy is, dense and MoE. The interpreted CPU tests: tests/test_qwen3_5_fused.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")]


def test_residual_norm_in_bf16():
    from monorl.ops.offset_rmsnorm import offset_residual_norm, offset_rms_norm_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(40, 1024, generator=g, device="cuda") * 3).bfloat16()
    a = torch.randn(40, 3072, generator=g, device="cuda").bfloat16()[:, :1024]  # a column slice
    w = (torch.randn(1024, generator=g, device="cuda") * 0.5).bfloat16()
    h, n = offset_residual_norm(x, a, w, 1e-6)
    assert torch.equal(h, x + a)  # one rounding of the fp32 sum, as eager's add
    torch.testing.assert_close(n.float(), offset_rms_norm_reference(x + a, w, 1e-6).float(), rtol=8e-3, atol=2e-2)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_converted_cuda_generator_is_as_close_to_the_trainer_as_the_eager_one(monkeypatch, moe):
    from monorl.model import qwen3_5_fused
    from monorl.ops import attention_gate
    from tests.test_gated_attention_kernel_gpu import generator_trainer_gaps
    from tests.test_recurrent_state import HYBRID, HYBRID_MOE

    monkeypatch.setattr(qwen3_5_fused, "ENABLED", True)
    monkeypatch.setattr(attention_gate, "ENABLED", True)

    def converted(gen, fused):
        assert (type(gen.model.model.layers[0]) is qwen3_5_fused.FusedQwen3_5Block) == fused

    gaps = generator_trainer_gaps((HYBRID_MOE if moe else HYBRID).replace(head_dim=32), converted)
    assert gaps[True].mean() <= 1.5 * gaps[False].mean() + 2e-3
