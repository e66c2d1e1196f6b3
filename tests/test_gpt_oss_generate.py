"""GPT-OSS through the generator (CPU): its prefill, decode and cached-prefill contexts attend with the layers' sinks
and windows as the trainer's packed forward does (prompts and generations longer than the window; bit for bit in
batch-invariant mode), and an episode resumed over its cached prefix equals the same conversation prefilled anew."""

from __future__ import annotations

import pytest
import torch

from monorl.generate.cache import SequenceState, slot_mapping
from monorl.generate.engine import Engine
from monorl.generate.episodes import run_episodes
from monorl.generate.sampling import SamplingParams
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import ModelConfig
from monorl.model.yarn import YarnRopeScaling
from tests.test_episodes import TURNS, generator, reprefilled_turn, scripted, turn_starts
from tests.test_families import prompts_of, rollouts, scaled_model, trainer_logprobs

WINDOW = 5
GPT_OSS_TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=48, num_layers=3, num_heads=4,
                           num_kv_heads=2, head_dim=16, rope_theta=1000.0, max_position_embeddings=512,
                           tie_word_embeddings=False).with_family(
    "gpt_oss", attention_bias=True, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48).replace(
    layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=WINDOW,
    rope_scaling=YarnRopeScaling(8.0, 32.0, 1.0, 16, False, 1.2), swiglu_limit=3.0)


def gpt_oss_model(seed: int = 0) -> torch.nn.Module:
    model = scaled_model(GPT_OSS_TINY, seed)
    for layer in model.model.layers:  # x5 weights: O(1) sinks next to the scores
        layer.self_attn.sinks.data.mul_(20.0)
    return model


def test_greedy_tokens_are_the_trainers_argmax():
    model = gpt_oss_model()
    prompts = prompts_of([3, 17, 9], GPT_OSS_TINY.vocab_size, seed=1)  # 17 > the window; every generation passes it
    seqs = rollouts(model, prompts, SamplingParams(max_new_tokens=12, temperature=0.0, seed=0))
    assert len({tuple(s.completion_ids) for s in seqs}) > 1
    for s in seqs:
        ids = s.prompt_ids + s.completion_ids
        (logits,) = model.logits_for([ids])
        assert logits[len(s.prompt_ids) - 1:-1].argmax(-1).tolist() == s.completion_ids


def test_generator_logprobs_equal_the_trainers():
    model = gpt_oss_model()
    prompts = prompts_of([3, 17, 1], GPT_OSS_TINY.vocab_size, seed=1)
    sp = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=3)
    seqs = rollouts(model, prompts, sp)
    assert len({tuple(s.completion_ids) for s in seqs}) > 3
    diffs = []
    for s, lp in zip(seqs, trainer_logprobs(model, seqs, 0.9), strict=True):
        diffs.append((torch.tensor(s.old_logprobs) - lp).abs().max().item())
        torch.testing.assert_close(torch.tensor(s.old_logprobs), lp, atol=1e-5, rtol=0)
    print(f"max |generator - trainer| log-prob: {max(diffs):.2e}")


def test_batch_invariant_generator_equals_the_trainer_bitwise():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see tests/test_parity_everywhere.py: tiny tensors, shared CPU
    try:
        model = make_batch_invariant_(gpt_oss_model(seed=2))
        prompts = prompts_of([5, 9], GPT_OSS_TINY.vocab_size, seed=4)
        seqs = rollouts(model, prompts, SamplingParams(max_new_tokens=6, temperature=0.9, seed=1), batch_invariant=True)
        for s, lp in zip(seqs, trainer_logprobs(model, seqs, 0.9), strict=True):
            assert torch.equal(torch.tensor(s.old_logprobs, dtype=torch.float32), lp)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("invariant", [True, False])
def test_turns_resumed_past_the_window_equal_reprefill(invariant):
    """An episode's later turns prefill only their inserted tokens over the cached prefix (already longer than the
    window); each equals the turn of an episode whose whole conversation is its prompt."""
    m = make_batch_invariant_(gpt_oss_model(seed=4)) if invariant else gpt_oss_model(seed=4)
    gen = generator(m, block_size=4)
    engine = Engine(gen, max_tokens=80)
    prompts, inserts = scripted(0, [0, 1, 2], GPT_OSS_TINY.vocab_size)
    sp = SamplingParams(max_new_tokens=6, temperature=0.9, seed=5)
    done = run_episodes(engine, prompts, sp,
                        lambda ep, ev: inserts[ep.id][ev.turn] if ev.turn < TURNS - 1 else None)
    for i, ep in done.items():
        starts = turn_starts(ep)
        assert starts[1] > WINDOW
        for t, s in enumerate(starts[1:], start=1):
            end = starts[t + 1] - len(inserts[i][t]) if t + 1 < TURNS else len(ep.tokens)
            ref = reprefilled_turn(engine, ep, s, sp)
            assert ref.token_ids == ep.tokens[s:end], (i, t)
            if invariant:
                assert ref.logprobs == ep.logprobs[s:end], (i, t)
            else:
                torch.testing.assert_close(torch.tensor(ref.logprobs), torch.tensor(ep.logprobs[s:end]),
                                           rtol=0, atol=1e-5)


def test_cached_prefill_equals_prefill_bitwise():
    """The runner's piece: a prompt's last logits from one prefill, and from a prefill of its first part then of
    the rest over the cached prefix, are equal bit for bit (invariant mode), with the sinks in force."""
    gen = generator(make_batch_invariant_(gpt_oss_model(seed=5)), block_size=4)
    runner, bs = gen.runner, gen.cache.block_size
    p = prompts_of([19], GPT_OSS_TINY.vocab_size, seed=6)[0]
    # through `Cache`: a window kind maps its blocks to its rings
    t1, t2, t3 = (gen.cache.extend(SequenceState(), 5) for _ in range(3))
    whole = runner.prefill([p], [slot_mapping(t1, 0, len(p), bs)])
    runner.prefill([p[:11]], [slot_mapping(t2, 0, 11, bs)])
    part = runner.prefill_cached([p[11:]], [11], [t2])
    assert torch.equal(whole, part)
    for layer in gen.model.model.layers:
        layer.self_attn.sinks.data.fill_(-1e9)
    assert not torch.allclose(runner.prefill([p], [slot_mapping(t3, 0, len(p), bs)]), whole, atol=1e-3)
