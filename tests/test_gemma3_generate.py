"""Gemma 3's sliding-window layers through the generator (CPU): its prefill, decode and cached-prefill contexts
attend the same last `sliding_window` keys as the trainer's packed forward, with prompts and generations longer than
the window (bit for bit in batch-invariant mode), and an episode resumed over its cached prefix past the window equals
the same conversation prefilled anew."""

from __future__ import annotations

import pytest
import torch

from monorl.generate.cache import SequenceState, slot_mapping
from monorl.generate.engine import Engine
from monorl.generate.episodes import run_episodes
from monorl.generate.sampling import SamplingParams
from monorl.model.attention import VarlenContext
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import ModelConfig
from tests.test_episodes import TURNS, generator, reprefilled_turn, scripted, turn_starts
from tests.test_families import prompts_of, rollouts, scaled_model, trainer_logprobs

WINDOW = 5
GEMMA_TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                         num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=512,
                         tie_word_embeddings=True).with_family("gemma3_text").replace(
    layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=WINDOW,
    rope_local_theta=100.0, query_pre_attn_scalar=16.0)


def gemma_model(seed: int = 0) -> torch.nn.Module:
    return scaled_model(GEMMA_TINY, seed)


def test_greedy_tokens_are_the_trainers_argmax():
    model = gemma_model()
    prompts = prompts_of([3, 17, 9], GEMMA_TINY.vocab_size, seed=1)  # 17 > the window; every generation passes it
    seqs = rollouts(model, prompts, SamplingParams(max_new_tokens=12, temperature=0.0, seed=0))
    assert len({tuple(s.completion_ids) for s in seqs}) > 1
    for s in seqs:
        ids = s.prompt_ids + s.completion_ids
        (logits,) = model.logits_for([ids])
        assert logits[len(s.prompt_ids) - 1:-1].argmax(-1).tolist() == s.completion_ids


def test_generator_logprobs_equal_the_trainers():
    model = gemma_model()
    prompts = prompts_of([3, 17, 1], GEMMA_TINY.vocab_size, seed=1)
    sp = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=3)
    seqs = rollouts(model, prompts, sp)
    assert len({tuple(s.completion_ids) for s in seqs}) > 3
    for s, lp in zip(seqs, trainer_logprobs(model, seqs, 0.9), strict=True):
        torch.testing.assert_close(torch.tensor(s.old_logprobs), lp, atol=1e-5, rtol=0)


def test_batch_invariant_generator_equals_the_trainer_bitwise():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see tests/test_parity_everywhere.py: tiny tensors, shared CPU
    try:
        model = make_batch_invariant_(gemma_model(seed=2))
        prompts = prompts_of([5, 9], GEMMA_TINY.vocab_size, seed=4)
        seqs = rollouts(model, prompts, SamplingParams(max_new_tokens=6, temperature=0.9, seed=1), batch_invariant=True)
        for s, lp in zip(seqs, trainer_logprobs(model, seqs, 0.9), strict=True):
            assert torch.equal(torch.tensor(s.old_logprobs, dtype=torch.float32), lp)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("invariant", [True, False])
def test_turns_resumed_past_the_window_equal_reprefill(invariant):
    """An episode's later turns prefill only their inserted tokens over the cached prefix (already longer than the
    window); each equals the turn of an episode whose whole conversation is its prompt."""
    m = make_batch_invariant_(gemma_model(seed=4)) if invariant else gemma_model(seed=4)
    gen = generator(m, block_size=4)
    engine = Engine(gen, max_tokens=80)
    prompts, inserts = scripted(0, [0, 1, 2], GEMMA_TINY.vocab_size)
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


def test_cached_prefill_past_the_window_equals_prefill_bitwise():
    """The runner's piece: a prompt's last logits from one prefill, and from a prefill of its first part then of
    the rest over the cached prefix (which ends past the window), are equal bit for bit (invariant mode)."""
    gen = generator(make_batch_invariant_(gemma_model(seed=5)), block_size=4)
    runner, bs = gen.runner, gen.cache.block_size
    p = prompts_of([19], GEMMA_TINY.vocab_size, seed=6)[0]
    s1, s2 = SequenceState(), SequenceState()  # through `Cache`: a window kind maps its blocks to its rings
    t1, t2 = gen.cache.extend(s1, 5), gen.cache.extend(s2, 5)
    whole = runner.prefill([p], [slot_mapping(t1, 0, len(p), bs)])
    runner.prefill([p[:11]], [slot_mapping(t2, 0, 11, bs)])
    part = runner.prefill_cached([p[11:]], [11], [t2])
    assert torch.equal(whole, part)
    # and the window is in force there: the last logits differ from those of a model without it
    for layer in gen.model.model.layers:
        layer.self_attn.window = 0
    ctx = VarlenContext.from_lengths([len(p)], "cpu")
    with torch.no_grad():
        full = gen.model.compute_logits(gen.model(torch.tensor(p), ctx.positions, ctx))[-1]
    assert not torch.allclose(full, whole[0], atol=1e-3)
