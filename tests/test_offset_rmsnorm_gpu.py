"""The (1 + w) norm's kernel on a GPU in bf16 (`monorl.ops.offset_rmsnorm`), against the module's own math, and a
Gemma 3 generator's CUDA copy running it (`use_fused_norms_`)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")]


@pytest.mark.parametrize("shape", [(64, 640), (40, 4, 256), (3, 1024)])
def test_kernel_equals_the_module_in_bf16(shape):
    from monorl.ops.offset_rmsnorm import offset_rms_norm, offset_rms_norm_reference

    torch.manual_seed(0)
    x = (torch.randn(shape, device="cuda") * 4).bfloat16()
    w = torch.randn(shape[-1], device="cuda").bfloat16()
    got, want = offset_rms_norm(x, w, 1e-6), offset_rms_norm_reference(x, w, 1e-6)
    assert got.dtype == torch.bfloat16
    # the row sum's order differs from torch's mean: at most one bf16 step apart
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-2)


def test_gemma_generator_copy_runs_the_kernel():
    from monorl.generate.generator import Generator, GeneratorConfig
    from monorl.generate.sampling import SamplingParams
    from monorl.model.layers import FusedOffsetRMSNorm
    from tests.test_families import scaled_model
    from tests.test_gemma3_generate import GEMMA_TINY

    model = scaled_model(GEMMA_TINY, 0).cuda()
    gen = Generator(model, GeneratorConfig(max_num_seqs=4, max_model_len=64))
    assert any(type(m) is FusedOffsetRMSNorm for m in gen.model.modules())
    out = gen.generate([[3, 4, 5, 6], [7, 8]], SamplingParams(max_new_tokens=8, temperature=0.0), n=2)
    assert all(len(c.token_ids) == 8 for cs in out for c in cs)
