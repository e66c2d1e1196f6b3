"""Qwen3.5's decoder layer seams on fused kernels for the generator's CUDA copy (`monorl.model.qwen3_5_fused`), run
on CPU tensors by Triton's interpreter: the residual add + (1 + w) norm kernel (`offset_rmsnorm.offset_residual_norm`)
against the eager ops, Gemma 3's add-norm unchanged by its new switch, which layers a copy converts (and that the
batch-invariant mode takes them back), and a whole generator on them (the gated attention's kernels too) equal to
the trainer's forward, dense and MoE.

As tests/test_gated_attention_kernel.py: `test_kernels_under_the_interpreter` runs this file again with
TRITON_INTERPRET=1; without triton (CPU CI) everything skips. fp32 only."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from monorl.model import qwen3_5_fused  # noqa: E402
from monorl.ops import attention_gate, block_kernels, offset_rmsnorm  # noqa: E402
from monorl.ops.offset_rmsnorm import offset_rms_norm_reference  # noqa: E402
from tests.test_recurrent_state import HYBRID, HYBRID_MOE  # noqa: E402
from tests.triton_interpreter import cases, interpreter_patches, outer, run_this_file_interpreted  # noqa: E402

EPS = 1e-6


@outer
def test_kernels_under_the_interpreter():
    run_this_file_interpreted(__file__)


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    yield from interpreter_patches(monkeypatch, block_kernels, attention_gate, offset_rmsnorm)


@pytest.fixture
def kernels_on(monkeypatch):
    """The ops' CUDA branch (their kernels) for CPU tensors, and both switched-off paths on."""
    for module in (block_kernels, attention_gate, offset_rmsnorm):
        monkeypatch.setattr(module, "use_triton", lambda t: True)
    monkeypatch.setattr(attention_gate, "ENABLED", True)
    monkeypatch.setattr(qwen3_5_fused, "ENABLED", True)


@cases
@pytest.mark.parametrize("D", [64, 48])  # a power of two, and a row the block masks
def test_residual_norm_kernel_equals_the_eager_ops(kernels_on, D):
    g = torch.Generator().manual_seed(D)
    x = torch.randn(5, D, generator=g) * 3
    a = torch.randn(5, 2 * D, generator=g)[:, :D]  # a column slice: rows 2 * D apart
    w = torch.randn(D, generator=g) * 0.5
    h, n = offset_rmsnorm.offset_residual_norm(x, a, w, EPS)
    torch.testing.assert_close(h, x + a, rtol=0, atol=0)
    torch.testing.assert_close(n, offset_rms_norm_reference(x + a, w, EPS), rtol=1e-5, atol=1e-5)


@cases
def test_gemma3s_add_norm_is_unchanged(kernels_on):
    """The kernel's new switch leaves Gemma 3's seam (the norm of a before the add) as it was."""
    g = torch.Generator().manual_seed(1)
    x, a = torch.randn(2, 4, 64, generator=g)
    wa, wh = torch.randn(2, 64, generator=g) * 0.5
    h, n = offset_rmsnorm.offset_add_norm(x, a, wa, wh, EPS)
    want_h = x + offset_rms_norm_reference(a, wa, EPS)
    torch.testing.assert_close(h, want_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(n, offset_rms_norm_reference(h, wh, EPS), rtol=1e-5, atol=1e-5)


@cases
def test_which_layers_a_copy_converts(monkeypatch):
    from monorl.model.batch_invariant import make_batch_invariant_
    from monorl.model.decoder import build_model
    from monorl.model.fused_kernels import use_fused_norms_
    from monorl.model.mlp import MLP
    from monorl.model.qwen3_5 import Qwen3_5Block

    def kinds(model):
        return {type(m).__name__ for m in model.modules()}

    copy = build_model(HYBRID, seed=None, fused=True)
    use_fused_norms_(copy)  # switched off: the layers stay plain
    assert "FusedQwen3_5Block" not in kinds(copy)
    monkeypatch.setattr(qwen3_5_fused, "ENABLED", True)
    unfused = use_fused_norms_(build_model(HYBRID, seed=None))  # separate gate / up projections: not converted
    assert "FusedQwen3_5Block" not in kinds(unfused)
    for cfg in (HYBRID, HYBRID_MOE):
        copy = use_fused_norms_(build_model(cfg, seed=None, fused=True))
        assert all(type(m) is qwen3_5_fused.FusedQwen3_5Block for m in copy.model.layers)
        assert type(copy.model.norm) is qwen3_5_fused.FusedQwen3_5FinalNorm
        fused_mlps = [type(m.mlp) is qwen3_5_fused.FusedQwen3_5MLP for m in copy.model.layers]
        assert all(fused_mlps) if cfg is HYBRID else not any(fused_mlps)  # a sparse layer's MoE block stays
        make_batch_invariant_(copy)  # the mode takes the copy back to the plain layers
        assert all(type(m) is Qwen3_5Block for m in copy.model.layers)
        assert qwen3_5_fused.FusedQwen3_5MLP not in {type(m) for m in copy.modules()}
        assert cfg is HYBRID_MOE or all(type(m.mlp) is MLP for m in copy.model.layers)


@cases
@pytest.mark.parametrize("cfg", [HYBRID, HYBRID_MOE], ids=["dense", "moe"])
def test_a_generator_on_the_fused_layers_equals_the_trainer_forward(kernels_on, monkeypatch, cfg):
    """The tiny hybrid's generator copy converted as a CUDA generator's is (norms, gated attention, layer seams, all
    on their kernels, forced on for CPU tensors): each sampled token's log-prob equal to the trainer's forward."""
    from monorl.generate.sampling import SamplingParams
    from monorl.model.decoder import build_model
    from monorl.model.fused_kernels import use_fused_norms_
    from tests.test_episodes import generator
    from tests.test_recurrent_state import trainer_logprobs

    calls = []
    op = qwen3_5_fused.offset_residual_norm
    monkeypatch.setattr(qwen3_5_fused, "offset_residual_norm", lambda *a: calls.append(1) or op(*a))
    model = build_model(cfg, seed=None).init_weights(3, std=0.2)
    gen = generator(model, max_num_seqs=3)
    use_fused_norms_(gen.model)
    assert type(gen.model.model.layers[0]) is qwen3_5_fused.FusedQwen3_5Block
    sp = SamplingParams(max_new_tokens=5, temperature=1.0, seed=11, ignore_eos=True)
    prompts = [[7, 9, 11], list(range(20, 50))]
    for prompt, samples in zip(prompts, gen.generate(prompts, sp, n=2), strict=True):
        for c in samples:
            _, lps = trainer_logprobs(model, prompt + c.token_ids, len(prompt))
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(lps), rtol=0, atol=1e-4)
    assert len(calls) >= 5 * 2 * cfg.num_layers  # the prefill and every decode step ran the seams' kernel
