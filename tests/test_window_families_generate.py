"""The sliding-window families through the generator (CPU), Gemma 3 and GPT-OSS alike: the prefill, decode and
cached-prefill contexts attend the same last `sliding_window` keys (and GPT-OSS's sinks) as the trainer's packed
forward, with prompts and generations longer than the window (bit for bit in batch-invariant mode), and an episode
resumed over its cached prefix past the window equals the same conversation prefilled anew. Each family's own
cached-prefill check is in tests/test_gemma3_generate.py / tests/test_gpt_oss_generate.py."""

from __future__ import annotations

import pytest
import torch

from monorl.generate.engine import Engine
from monorl.generate.episodes import run_episodes
from monorl.generate.sampling import SamplingParams
from monorl.model.batch_invariant import make_batch_invariant_
from tests.test_episodes import TURNS, generator, reprefilled_turn, scripted, turn_starts
from tests.test_families import prompts_of, rollouts, trainer_logprobs
from tests.test_gemma3_generate import GEMMA_TINY, WINDOW, gemma_model
from tests.test_gpt_oss_generate import GPT_OSS_TINY, gpt_oss_model

assert GEMMA_TINY.vocab_size == GPT_OSS_TINY.vocab_size and GEMMA_TINY.sliding_window == GPT_OSS_TINY.sliding_window
VOCAB = GEMMA_TINY.vocab_size
MODELS = {"gemma3_text": gemma_model, "gpt_oss": gpt_oss_model}
FAMILIES = pytest.mark.parametrize("family", sorted(MODELS))


@FAMILIES
def test_greedy_tokens_are_the_trainers_argmax(family):
    model = MODELS[family]()
    prompts = prompts_of([3, 17, 9], VOCAB, seed=1)  # 17 > the window; every generation passes it
    seqs = rollouts(model, prompts, SamplingParams(max_new_tokens=12, temperature=0.0, seed=0))
    assert len({tuple(s.completion_ids) for s in seqs}) > 1
    for s in seqs:
        ids = s.prompt_ids + s.completion_ids
        (logits,) = model.logits_for([ids])
        assert logits[len(s.prompt_ids) - 1:-1].argmax(-1).tolist() == s.completion_ids


@FAMILIES
def test_generator_logprobs_equal_the_trainers(family):
    model = MODELS[family]()
    prompts = prompts_of([3, 17, 1], VOCAB, seed=1)
    sp = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=3)
    seqs = rollouts(model, prompts, sp)
    assert len({tuple(s.completion_ids) for s in seqs}) > 3
    diffs = []
    for s, lp in zip(seqs, trainer_logprobs(model, seqs, 0.9), strict=True):
        torch.testing.assert_close(torch.tensor(s.old_logprobs), lp, atol=1e-5, rtol=0)
        diffs.append((torch.tensor(s.old_logprobs) - lp).abs().max().item())
    print(f"{family}: max |generator - trainer| log-prob: {max(diffs):.2e}")


@FAMILIES
def test_batch_invariant_generator_equals_the_trainer_bitwise(family):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see tests/test_parity_everywhere.py: tiny tensors, shared CPU
    try:
        model = make_batch_invariant_(MODELS[family](seed=2))
        prompts = prompts_of([5, 9], VOCAB, seed=4)
        seqs = rollouts(model, prompts, SamplingParams(max_new_tokens=6, temperature=0.9, seed=1), batch_invariant=True)
        for s, lp in zip(seqs, trainer_logprobs(model, seqs, 0.9), strict=True):
            assert torch.equal(torch.tensor(s.old_logprobs, dtype=torch.float32), lp)
    finally:
        torch.set_num_threads(threads)


@FAMILIES
@pytest.mark.parametrize("invariant", [True, False])
def test_turns_resumed_past_the_window_equal_reprefill(family, invariant):
    """An episode's later turns prefill only their inserted tokens over the cached prefix (already longer than the
    window); each equals the turn of an episode whose whole conversation is its prompt."""
    m = make_batch_invariant_(MODELS[family](seed=4)) if invariant else MODELS[family](seed=4)
    gen = generator(m, block_size=4)
    engine = Engine(gen, max_tokens=80)
    prompts, inserts = scripted(0, [0, 1, 2], VOCAB)
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
