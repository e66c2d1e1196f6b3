"""Recycled sliding-window blocks (`monorl.generate.window_cache.RecycledWindowKV`, #57): a tiny Gemma 3 (window 8,
blocks of 4) decoding far past its window holds at most blocks_for(W) + 1 window blocks per sequence at every step,
prompt groups longer than the window share their prompt, and its log-probs are the trainer's (bit for bit in
batch-invariant mode); an episode's turns longer than a ring equal a re-prefill, preempted episodes recompute the
same tokens, a prefill writes each ring slot once; the cache allocates what the plan counts."""

from __future__ import annotations

import random

import pytest
import torch

from monorl.generate import cache as cache_mod
from monorl.generate.attention import PrefillContext
from monorl.generate.engine import Engine
from monorl.generate.episodes import run_episodes
from monorl.generate.generator import Generator, GeneratorConfig
from monorl.generate.sampling import SamplingParams
from monorl.generate.window_cache import RecycledWindowKV, ring_size
from monorl.model.attention import VarlenContext
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import ModelConfig
from monorl.train.packing import TrainSequence
from tests.test_episodes import TURNS, reprefilled_turn, turn_starts
from tests.test_families import prompts_of, scaled_model, trainer_logprobs

WINDOW, BS = 8, 4
TIGHT_BLOCKS = 40  # blocks of the shared table (the full layer's) in the preemption test
CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=16, rope_theta=10000.0, max_position_embeddings=512,
                  tie_word_embeddings=True).with_family("gemma3_text").replace(
    layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=WINDOW,
    rope_local_theta=100.0, query_pre_attn_scalar=16.0)


def window_kind(gen: Generator) -> RecycledWindowKV:
    return next(k for k in gen.cache.kinds if isinstance(k, RecycledWindowKV))


def run(model, prompts, sp, n, invariant, **kw):
    gen = Generator(model, GeneratorConfig(max_num_seqs=4, max_model_len=128, block_size=BS, stop_check_interval=1,
                                           **kw), eos_token_ids=())
    if invariant:
        make_batch_invariant_(gen.model)
    engine = Engine(gen)
    for i, p in enumerate(prompts):
        for j in range(n):
            engine.add((i, j), p, sp, one_turn=True, group=i)
    kind, R, steps, out = window_kind(gen), ring_size(WINDOW, BS), 0, {}
    while engine.has_work():
        for ev in engine.step():
            out[ev.request_id] = ev
        steps += 1
        live = [r for r in engine.requests.values() if r.state != "finished"]
        for r in live:  # count each sequence's window blocks
            assert kind.held(r.cache) <= R
        holders = sum(1 for r in live if kind.held(r.cache)) + len(kind.prefix_rings)
        assert kind.pool.usable_blocks - kind.pool.num_free() <= holders * R
    assert steps > 1
    seqs = [TrainSequence(prompts[i], list(out[(i, j)].token_ids), list(out[(i, j)].logprobs), 0.0)
            for i in range(len(prompts)) for j in range(n)]
    return gen, seqs


@pytest.mark.parametrize("invariant", [True, False])
def test_long_decode_holds_a_ring_and_equals_the_trainer(invariant):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = scaled_model(CFG, seed=3)
        if invariant:
            model = make_batch_invariant_(model)
        prompts = prompts_of([3, 21, 10], CFG.vocab_size, seed=2)  # 21: a group's prompt past the window
        sp = SamplingParams(max_new_tokens=48, temperature=0.9, seed=1)
        _, seqs = run(model, prompts, sp, n=2, invariant=invariant)
        assert min(len(s.completion_ids) for s in seqs) > 3 * WINDOW  # far past the window
        for s, lp in zip(seqs, trainer_logprobs(model, seqs, 0.9), strict=True):
            got = torch.tensor(s.old_logprobs, dtype=torch.float32)
            if invariant:
                assert torch.equal(got, lp)
            else:
                torch.testing.assert_close(got, lp, atol=1e-5, rtol=0)
    finally:
        torch.set_num_threads(threads)


def test_allocated_bytes_are_the_planned_bytes():
    gen = Generator(scaled_model(CFG), GeneratorConfig(max_num_seqs=4, max_model_len=128, block_size=BS))
    assert gen.cache.allocated_bytes() == gen.kv_bytes_needed()
    # the window layers cost R blocks a sequence row, not blocks_for(max_model_len)
    kind = window_kind(gen)
    assert kind.kv.shape[2] == cache_mod.sequence_rows(4) * ring_size(WINDOW, BS)
    full_length = cache_mod.kv_cache_bytes_needed(CFG.replace(layer_types=(), sliding_window=0), 4, 128, BS,
                                                  gen.dtype)
    assert gen.kv_bytes_needed() < full_length


def long_inserts(ids, seed: int) -> tuple[dict, dict]:
    """Prompts past the window and environment turns longer than a ring (R * block_size = 12 positions): a turn's
    new tokens would overwrite ring slots its own earlier queries read."""
    rng = random.Random(seed)
    prompts = {i: [rng.randrange(2, CFG.vocab_size) for _ in range(rng.randint(9, 20))] for i in ids}
    inserts = {i: [[rng.randrange(2, CFG.vocab_size) for _ in range(rng.randint(13, 20))] for _ in range(TURNS - 1)]
               for i in ids}
    return prompts, inserts


def episodes(model, inserts, prompts, sp, invariant, **kw):
    gen = Generator(model, GeneratorConfig(max_num_seqs=4, max_model_len=128, block_size=BS, **kw),
                    eos_token_ids=())
    if invariant:
        make_batch_invariant_(gen.model)
    engine = Engine(gen, max_tokens=128)
    kind, held = window_kind(gen), []

    def environment(ep, ev):
        held.append(kind.pool.usable_blocks - kind.pool.num_free())
        return inserts[ep.id][ev.turn] if ev.turn < TURNS - 1 else None

    done = run_episodes(engine, prompts, sp, environment)
    assert kind.pool.num_free() == kind.pool.usable_blocks  # every ring handed back
    return engine, done, held


@pytest.mark.parametrize("invariant", [True, False])
def test_turns_longer_than_the_ring_equal_reprefill(invariant):
    """An episode's resumed turns (their inserted tokens past a ring's length, over a cached prefix past the window,
    decoding up to 7 tokens past their stops between checks, overwriting kept keys: `keeps` frees those) equal the
    turn of an episode whose whole conversation is its prompt."""
    model = scaled_model(CFG, seed=4)
    if invariant:
        model = make_batch_invariant_(model)
    prompts, inserts = long_inserts(range(3), seed=1)
    sp = SamplingParams(max_new_tokens=10, temperature=0.9, seed=5, stop_token_ids=tuple(range(2, 24)))
    engine, done, _ = episodes(model, inserts, prompts, sp, invariant, stop_check_interval=8)
    for i, ep in done.items():
        starts = turn_starts(ep)
        assert len(starts) == TURNS
        for t, s in enumerate(starts[1:], start=1):
            end = starts[t + 1] - len(inserts[i][t]) if t + 1 < TURNS else len(ep.tokens)
            ref = reprefilled_turn(engine, ep, s, sp)
            assert ref.token_ids == ep.tokens[s:end], (i, t)
            if invariant:
                assert ref.logprobs == ep.logprobs[s:end], (i, t)
            else:
                torch.testing.assert_close(torch.tensor(ref.logprobs), torch.tensor(ep.logprobs[s:end]),
                                           rtol=0, atol=1e-5)


def test_preempted_window_episodes_recompute_the_same_tokens():
    """Too few window rings for every paused episode: turns preempt paused ones (their conversation prefilled again
    later, rings and all), and every episode is the one an ample cache gives, bit for bit."""
    model = make_batch_invariant_(scaled_model(CFG, seed=6))
    prompts, inserts = long_inserts(range(4), seed=2)
    sp = SamplingParams(max_new_tokens=6, temperature=0.9, seed=2, ignore_eos=True)
    ample, done, _ = episodes(model, inserts, prompts, sp, True)
    per_block = cache_mod.bytes_per_block(CFG, BS, torch.float32)
    tight, small, _ = episodes(model, inserts, prompts, sp, True, kv_cache_bytes=TIGHT_BLOCKS * per_block
                               + cache_mod.sequence_rows(4) * cache_mod.bytes_per_sequence(CFG, torch.float32,
                                                                                          True, BS))
    assert tight.preemptions > 0
    for i in prompts:
        assert small[i].tokens == done[i].tokens
        assert small[i].logprobs == done[i].logprobs


def test_a_prefill_writes_each_ring_slot_once():
    """A prompt (or a resumed turn) longer than its ring writes only its last W - 1 positions to the ring, the rest
    to the scratch block: no two of its tokens map to one ring slot."""
    c = cache_mod.Cache(CFG, num_blocks=32, block_size=BS, device=torch.device("cpu"), dtype=torch.float32,
                        max_num_seqs=2)
    state = cache_mod.SequenceState()
    c.extend(state, 10)
    n = 37
    ctx = PrefillContext(VarlenContext.from_lengths([n], "cpu"), torch.tensor(cache_mod.slot_mapping(state.table, 0,
                                                                                                     n, BS)))
    slots = c.layers[0].window_context(ctx).slot_mapping
    ring = slots[slots >= BS]  # the scratch block 0 holds slots 0 .. BS - 1
    assert ring.numel() == WINDOW - 1
    assert ring.unique().numel() == ring.numel()


def test_cpu_default_budget_holds_the_rings_beside_its_blocks(monkeypatch):
    """The CPU default KV budget is that many bytes of blocks beside the per-sequence rows every cache allocates
    (gemma3-270m's window rings for 128 sequences alone pass 256 MiB: its preset stopped with "holds 0 blocks")."""
    from monorl.generate import generator as generator_mod

    per_block = cache_mod.bytes_per_block(CFG, BS, torch.float32)
    rows = cache_mod.sequence_rows(8) * cache_mod.bytes_per_sequence(CFG, torch.float32, False, BS)
    assert rows > 4 * per_block
    monkeypatch.setattr(generator_mod, "_CPU_DEFAULT_KV_BYTES", 4 * per_block)  # less than the rings alone
    gen = Generator(scaled_model(CFG, seed=1), GeneratorConfig(max_num_seqs=8, max_model_len=128, block_size=BS),
                    eos_token_ids=())
    assert gen.cache.num_blocks == 4
