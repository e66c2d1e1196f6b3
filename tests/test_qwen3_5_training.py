"""Qwen3.5 hybrids in the rest of the run: LoRA (the full-attention and MLP projections adapted, the merged
generator copy computing the adapted model, a LoRA generator's log-probs the trainer's), the batch-invariant
conversion, and tensor parallelism refused in one line. Tiny hybrid, CPU."""

from __future__ import annotations

import copy

import pytest
import torch

from monorl.distributed.weight_sync import sync_weights_
from monorl.generate import Generator, GeneratorConfig, SamplingParams
from monorl.generate.tensor_parallel import check_tensor_parallel
from monorl.model.batch_invariant import is_batch_invariant, make_batch_invariant_
from monorl.model.decoder import build_model
from monorl.model.lora import LoRAConfig, LoRALinear, apply_lora_
from tests.test_recurrent_state import HYBRID, trainer_logprobs

LORA = LoRAConfig(rank=4, alpha=8.0)


def _lora_hybrid():
    ours = apply_lora_(build_model(HYBRID, seed=None).init_weights(2, std=0.2), LORA)
    with torch.no_grad():  # adapters that change the model
        for m in ours.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_(0, 0.2, generator=torch.Generator().manual_seed(1))
    return ours


def _logits(model, tokens: list[int]) -> torch.Tensor:
    return model.logits_for([tokens])[0]


def test_lora_adapts_a_hybrid_and_the_merged_copy_is_the_adapted_model():
    ours = _lora_hybrid()
    adapted = {n.rpartition(".lora_A")[0] for n, _ in ours.named_parameters() if ".lora_A" in n}
    assert {"model.layers.1.self_attn.q_proj", "model.layers.0.mlp.gate_proj"} <= adapted
    assert not any("linear_attn" in n for n in adapted)  # Gated DeltaNet's projections have other names
    tokens = list(range(3, 80))
    ours.compute_logits(ours(torch.tensor(tokens), *_ctx(len(tokens)))).logsumexp(-1).mean().backward()
    grads = {n for n, p in ours.named_parameters() if p.grad is not None}
    assert grads and all(".lora_" in n for n in grads)  # the base is frozen, linear layers included
    merged = build_model(HYBRID, seed=None, fused=True)
    sync_weights_(merged, ours)
    torch.testing.assert_close(_logits(merged, tokens), _logits(ours, tokens), atol=1e-4, rtol=1e-4)


def _ctx(n: int):
    from monorl.model.attention import VarlenContext

    ctx = VarlenContext.from_lengths([n], "cpu")
    return ctx.positions, ctx


def test_a_lora_hybrid_generator_samples_the_trainers_logprobs():
    ours = _lora_hybrid()
    gen = Generator(ours, GeneratorConfig(max_num_seqs=4, max_model_len=128, block_size=8), eos_token_ids=(),
                    lora=LORA)
    prompt = [5 + i % 90 for i in range(70)]
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    (c,) = gen.generate([prompt], sp)[0]
    with torch.no_grad():
        _, lps = trainer_logprobs(ours, prompt + c.token_ids, len(prompt))
    torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(lps), rtol=0, atol=1e-4)


def test_batch_invariant_conversion_of_a_hybrid():
    """A family with its own decoder layer has no fused-kernel form: the conversion skips it (it raised before)."""
    inv = make_batch_invariant_(copy.deepcopy(build_model(HYBRID, seed=None).init_weights(2)))
    assert is_batch_invariant(inv)


def test_tensor_parallelism_refuses_a_hybrid_in_one_line():
    check_tensor_parallel(HYBRID, 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: Gated DeltaNet \(linear_attention\) layers are "
                                         "not sharded yet"):
        check_tensor_parallel(HYBRID, 2)
