"""Gemma 3's fused generator layers on a GPU in bf16 (`monorl.model.gemma3_fused`): each kernel against the eager
ops it replaces, and a CUDA generator (graphs on, windows recycled) whose converted copy is as close to the trainer
as the eager copy is."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")]

BF16_STEP = dict(rtol=8e-3, atol=2e-2)  # one bf16 rounding apart (the row sums' order differs from torch's)


def test_add_norm_in_bf16():
    from monorl.ops.offset_rmsnorm import offset_add_norm, offset_rms_norm_reference

    torch.manual_seed(0)
    x = (torch.randn(64, 640, device="cuda") * 20).bfloat16()
    a = (torch.randn(64, 2 * 640, device="cuda") * 50).bfloat16()[:, 640:]
    wa, wh = torch.randn(2, 640, device="cuda").bfloat16()
    h, n = offset_add_norm(x, a, wa, wh, 1e-6)
    ref_h = x + offset_rms_norm_reference(a, wa, 1e-6)
    torch.testing.assert_close(h.float(), ref_h.float(), **BF16_STEP)
    torch.testing.assert_close(n.float(), offset_rms_norm_reference(ref_h, wh, 1e-6).float(), **BF16_STEP)


@pytest.mark.parametrize("tokens", [64, 300])
def test_qk_norm_rope_write_kv_in_bf16(tokens):
    from monorl.ops.block_kernels import offset_qk_norm_rope_write_kv
    from monorl.ops.offset_rmsnorm import offset_rms_norm_reference
    from monorl.ops.rope import apply_rope

    torch.manual_seed(1)
    T, Hq, Hkv, D = tokens, 4, 1, 256
    qkv = (torch.randn(T, (Hq + 2 * Hkv) * D, device="cuda") * 3).bfloat16()
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    qw, kw = torch.randn(2, D, device="cuda").bfloat16()
    ang = torch.rand(T, D // 2, device="cuda") * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).bfloat16(), torch.cat([ang.sin()] * 2, -1).bfloat16()
    cache = torch.zeros(2, 40, 16, Hkv, D, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(640, device="cuda")[:T]
    got_q, got_k = offset_qk_norm_rope_write_kv(q, k, v, qw, kw, cos, sin, 1e-6, cache, slots)
    want_q = apply_rope(offset_rms_norm_reference(q.reshape(T, Hq, D), qw, 1e-6), cos, sin)
    want_k = apply_rope(offset_rms_norm_reference(k.reshape(T, Hkv, D), kw, 1e-6), cos, sin)
    torch.testing.assert_close(got_q.float(), want_q.float(), **BF16_STEP)
    torch.testing.assert_close(got_k.float(), want_k.float(), **BF16_STEP)
    assert torch.equal(cache[0].view(-1, Hkv, D)[slots], got_k)
    assert torch.equal(cache[1].view(-1, Hkv, D)[slots], v.reshape(T, Hkv, D))


def test_gelu_tanh_mul_in_bf16():
    from monorl.ops.block_kernels import gelu_tanh_mul

    torch.manual_seed(2)
    gate_up = (torch.randn(64, 2 * 2048, device="cuda") * 3).bfloat16()
    gate, up = gate_up.split([2048, 2048], dim=-1)
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(gelu_tanh_mul(gate, up).float(), want.float(), **BF16_STEP)


def test_a_converted_cuda_generator_is_as_close_to_the_trainer_as_the_eager_one():
    from monorl.generate.generator import Generator, GeneratorConfig
    from monorl.generate.sampling import SamplingParams
    from monorl.model.gemma3_fused import FusedGemma3Block
    from monorl.train.packing import TrainSequence
    from tests.test_families import prompts_of, trainer_logprobs
    from tests.test_gemma3_fused import gemma
    from tests.test_window_recycling import CFG

    model, on_cpu = gemma(7).cuda(), gemma(7)  # the trainer's reference: fp32, on CPU
    prompts = prompts_of([3, 21, 10, 30], CFG.vocab_size, seed=3)  # past the window of 8
    sp = SamplingParams(max_new_tokens=40, temperature=0.9, seed=2)
    gaps = {}
    for fused in (True, False):
        gen = Generator(model, GeneratorConfig(max_num_seqs=8, max_model_len=128, block_size=4,
                                               fused_kernels=fused), eos_token_ids=())
        assert any(type(m) is FusedGemma3Block for m in gen.model.modules()) == fused
        out = gen.generate(prompts, sp, n=2)
        seqs = [TrainSequence(p, list(c.token_ids), list(c.logprobs), 0.0) for p, cs in zip(prompts, out, strict=True)
                for c in cs]
        assert min(len(s.completion_ids) for s in seqs) > 3 * CFG.sliding_window
        ref = trainer_logprobs(on_cpu, seqs, 0.9)
        gaps[fused] = torch.cat([(torch.tensor(s.old_logprobs) - r).abs() for s, r in zip(seqs, ref, strict=True)])
    print(f"|generator - trainer| log-prob, mean / max: fused {gaps[True].mean():.4f} / {gaps[True].max():.4f}, "
          f"eager {gaps[False].mean():.4f} / {gaps[False].max():.4f}")
    assert gaps[True].mean() <= 1.5 * gaps[False].mean() + 2e-3
