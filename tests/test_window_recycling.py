"""Recycled sliding-window blocks (`monorl.generate.window_cache.RecycledWindowKV`, #57): a tiny Gemma 3 (window 8,
blocks of 4) decoding far past its window holds at most blocks_for(W) + 1 window blocks per sequence at every step,
prompt groups longer than the window share their prompt, and its log-probs are the trainer's (bit for bit in
batch-invariant mode); the cache allocates what the plan counts."""

from __future__ import annotations

import pytest
import torch

from monorl.generate import cache as cache_mod
from monorl.generate.engine import Engine
from monorl.generate.generator import Generator, GeneratorConfig
from monorl.generate.sampling import SamplingParams
from monorl.generate.window_cache import RecycledWindowKV, ring_size
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import ModelConfig
from monorl.train.packing import TrainSequence
from tests.test_families import prompts_of, scaled_model, trainer_logprobs

WINDOW, BS = 8, 4
CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=16, rope_theta=10000.0, max_position_embeddings=512,
                  tie_word_embeddings=True).with_family("gemma3_text").replace(
    layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=WINDOW,
    rope_local_theta=100.0, query_pre_attn_scalar=16.0)


@pytest.fixture(autouse=True)
def recycled(monkeypatch):
    monkeypatch.setitem(cache_mod.CACHE_KINDS, "sliding_attention", RecycledWindowKV)


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
