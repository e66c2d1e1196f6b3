"""`monorl.ops.gated_delta_decode`'s decode-step kernels (the conv step and the rule step, each row's states updated
in place in its cache row) against the plain-PyTorch path the model runs elsewhere (`causal_conv`, then
`recurrent_gated_delta_rule` on the gathered states, written back), run on CPU tensors by Triton's interpreter.

The interpreter has to be switched on before triton is imported, so `test_decode_kernels_under_the_interpreter`
runs this file again in a subprocess with TRITON_INTERPRET=1; without triton (CPU CI) everything skips. fp32 only:
the interpreter computes bf16 wrongly (tests/test_sinks_triton.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from tests.triton_interpreter import cases, interpreter_patches, outer, run_this_file_interpreted  # noqa: E402


@outer
def test_decode_kernels_under_the_interpreter():
    run_this_file_interpreted(__file__)


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    from monorl.ops import gated_delta_decode
    yield from interpreter_patches(monkeypatch, gated_delta_decode)


@cases
@pytest.mark.parametrize("hk, hv", [(2, 4), (4, 4)])  # grouped values; one value head per key head
def test_decode_step_in_place_equals_the_gathered_reference(hk, hv):
    from monorl.ops.gated_delta import causal_conv, recurrent_gated_delta_rule
    from monorl.ops.gated_delta_decode import conv_step, in_place_decode, rule_step

    torch.manual_seed(0)
    dk, dv, K, R = 16, 16, 4, 7
    C = 2 * hk * dk + hv * dv
    rows = torch.tensor([3, 1, 5])  # three sequences' cache rows, out of order
    N = rows.shape[0]
    x, a, b = torch.randn(N, C), torch.randn(N, hv), torch.randn(N, hv)
    weight, a_log, dt_bias = torch.randn(C, K), torch.randn(hv) * 0.5, torch.randn(hv)
    conv, ssm = torch.randn(R, K - 1, C), torch.randn(R, hv, dk, dv)
    cu = torch.arange(N + 1, dtype=torch.int32)

    # the model's path elsewhere: gather, conv, rule, scatter
    mixed_ref, conv_final = causal_conv(x, weight, cu, conv[rows])
    q, k, v = mixed_ref.split([hk * dk, hk * dk, hv * dv], dim=-1)
    g = -a_log.exp() * F.softplus(a + dt_bias)
    o_ref, ssm_final = recurrent_gated_delta_rule(q.view(N, hk, dk), k.view(N, hk, dk), v.view(N, hv, dv), g,
                                                  b.sigmoid(), cu, ssm[rows])

    assert not in_place_decode(x)  # CPU tensors: the model keeps its plain path; the kernels run here all the same
    conv_after, ssm_after = conv.clone(), ssm.clone()
    mixed = conv_step(x, weight, conv_after, rows)
    o = rule_step(mixed, a, b, a_log, dt_bias, ssm_after, rows, hk, dk)
    torch.testing.assert_close(mixed, mixed_ref)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv_after[rows], conv_final)
    torch.testing.assert_close(ssm_after[rows], ssm_final, atol=1e-5, rtol=1e-5)
    others = torch.tensor([r for r in range(R) if r not in rows.tolist()])
    assert torch.equal(conv_after[others], conv[others]) and torch.equal(ssm_after[others], ssm[others])


@cases
def test_generator_with_the_in_place_decode_equals_the_trainer_forward(monkeypatch):
    """The model's CUDA decode path (the kernels on each layer's cache rows, `covered` counted once a step) forced on
    for CPU tensors: a prompt group's samples (each from its own copy of the prompt's state) and a second group whose
    rows were freed and reused, each sampled token's log-prob equal to the trainer's forward over the sequence."""
    from monorl.generate.sampling import SamplingParams
    from monorl.model import qwen3_5
    from monorl.model.decoder import build_model
    from tests.test_episodes import generator
    from tests.test_recurrent_state import HYBRID, trainer_logprobs

    steps = []
    rule_step = qwen3_5.rule_step
    monkeypatch.setattr(qwen3_5, "in_place_decode", lambda x: True)
    monkeypatch.setattr(qwen3_5, "rule_step", lambda *a, **k: steps.append(1) or rule_step(*a, **k))
    model = build_model(HYBRID, seed=None).init_weights(3, std=0.2)
    gen = generator(model, max_num_seqs=3)
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    for prompts in ([[5 + i % 100 for i in range(13)]], [[7, 9, 11], list(range(20, 90))]):
        for prompt, samples in zip(prompts, gen.generate(prompts, sp, n=2), strict=True):
            for c in samples:
                _, lps = trainer_logprobs(model, prompt + c.token_ids, len(prompt))
                torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(lps), rtol=0, atol=1e-4)
            assert samples[0].token_ids != samples[1].token_ids
    assert steps  # the decode steps ran the kernels
