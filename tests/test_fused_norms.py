"""The generator-side conversion of the (1 + w) norms (`monorl.model.fused_kernels.use_fused_norms_`, the generator's
CUDA copy of Gemma 3 and Qwen3.5: one kernel a norm, tests/test_offset_rmsnorm.py), which the mode's conversion must
undo (the trainer has the module's own norm)."""

from __future__ import annotations

import torch

from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.fused_kernels import use_fused_norms_
from monorl.model.layers import BatchInvariantOffsetRMSNorm, FusedOffsetRMSNorm, OffsetRMSNorm
from tests.test_families import scaled_model
from tests.test_gemma3_generate import GEMMA_TINY


def test_conversion_takes_the_offset_norms_and_the_mode_takes_them_back() -> None:
    model = scaled_model(GEMMA_TINY, 0)
    before = sum(type(m) is OffsetRMSNorm for m in model.modules())
    x = torch.randn(5, GEMMA_TINY.hidden_size)
    norm = model.model.layers[0].input_layernorm
    want = norm(x)
    use_fused_norms_(model)
    assert before > 0 and sum(type(m) is FusedOffsetRMSNorm for m in model.modules()) == before
    assert torch.equal(norm(x), want)  # off CUDA the op runs the module's math
    make_batch_invariant_(model)
    assert sum(type(m) is BatchInvariantOffsetRMSNorm for m in model.modules()) == before
