"""The engine's cache interface (`monorl.generate.cache`) and the request engine's use of it: sizing asks each layer
cache kind, per-sequence operations keep refcounts right, prompt groups share blocks, one-turn requests free theirs
in the step that ends them. Tiny random model, CPU."""

from __future__ import annotations

import pytest
import torch

import monorl.generate.cache as cache_mod
from monorl.generate.cache import Cache, PagedKV, SequenceState, blocks_for, bytes_per_block, kv_cache_bytes_needed
from monorl.generate.engine import Engine
from monorl.generate.generator import Generator, GeneratorConfig
from monorl.generate.sampling import SamplingParams
from monorl.model.config import model_shape
from monorl.model.decoder import build_model


@pytest.fixture(scope="module")
def model():
    return build_model(model_shape("tiny"), seed=3)


class RecurrentState(PagedKV):
    """A stand-in second kind: a fixed per-sequence state beside the paged KV of the same layers."""

    def bytes_per_sequence(self, dtype: torch.dtype) -> int:
        return 1000


def test_kv_sizing_asks_each_kind(model, monkeypatch):
    cfg, dtype = model.config, torch.float32
    elem = 4
    per_block = cfg.num_layers * 2 * 8 * cfg.num_kv_heads * cfg.head_dim * elem
    assert bytes_per_block(cfg, 8, dtype) == per_block
    assert kv_cache_bytes_needed(cfg, 3, 20, 8, dtype) == (3 * blocks_for(20, 8) + 1) * per_block
    monkeypatch.setattr(cache_mod, "cache_kinds", lambda c: [PagedKV(c, list(range(c.num_layers))),
                                                             RecurrentState(c, [])])
    assert kv_cache_bytes_needed(cfg, 3, 20, 8, dtype) == (3 * blocks_for(20, 8) + 1) * per_block + (2 * 3 + 1) * 1000


def test_sequence_operations_keep_refcounts(model):
    cache = Cache(model.config, 10, 4, torch.device("cpu"), torch.float32)
    pool = cache.blocks
    assert len(cache.layers) == model.config.num_layers and cache.kv.shape[2] == 10
    a, b = SequenceState(), SequenceState()
    cache.extend(a, 3)
    cache.kv[:, :, a.table[2]] = 1.0
    cache.share(b, a.table[:2])  # a prompt's full blocks, shared
    [own] = cache.extend(b, 1)
    cache.copy_blocks([(a.table[2], own)])  # its partial block, copied
    assert torch.equal(cache.kv[:, :, own], cache.kv[:, :, a.table[2]])
    assert pool.num_free() == 9 - 4
    cache.free(a)
    assert pool.num_free() == 9 - 3 and pool.refs[b.table[0]] == 1  # b's shared blocks stay
    cache.trim(b, 5)  # positions 0..4: two blocks
    assert len(b.table) == 2 and pool.num_free() == 9 - 2
    cache.free(b)
    assert pool.num_free() == pool.usable_blocks and b.table == [] and b.cached == 0


def test_groups_share_the_prompt_and_one_turn_requests_free_their_cache(model):
    gen = Generator(model, GeneratorConfig(max_num_seqs=8, max_model_len=64, block_size=4), eos_token_ids=())
    pool = gen.cache.blocks
    engine = Engine(gen)
    prompt = list(range(2, 12))  # 10 tokens: 2 full blocks, a partial one
    sp = SamplingParams(max_new_tokens=3, temperature=1.0, seed=0, stop_token_ids=(0,))  # a stop: one-step chunks
    for j in range(2):
        engine.add((0, j), prompt, sp, one_turn=True)  # one group: its prompt
    engine.add((1, 0), prompt, sp, one_turn=True, group="apart")  # the same tokens, its own group
    events = engine.step()
    assert not events and len(engine.running) == 3
    tables = [r.cache.table for r in engine.running]
    assert tables[0][:2] == tables[1][:2] and not set(tables[2]) & set(tables[0])
    while engine.has_work():
        events += engine.step()
    assert {ev.request_id for ev in events} == {(0, 0), (0, 1), (1, 0)}
    assert all(ev.finished for ev in events)
    assert pool.num_free() == pool.usable_blocks and not engine.groups  # freed in the step, before finish()
    first = {ev.request_id: ev.token_ids for ev in events}
    assert first[(0, 0)] != first[(0, 1)]  # own sampling keys
    for ev in events:
        engine.finish(ev.request_id)
    assert not engine.requests


def test_close_frees_every_request(model):
    gen = Generator(model, GeneratorConfig(max_num_seqs=2, max_model_len=64, block_size=4), eos_token_ids=())
    engine = Engine(gen)
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, seed=0, stop_token_ids=(0,))  # a stop: one-step chunks
    for i in range(4):
        engine.add(i, [2 + i] * 6, sp)
    engine.step()
    assert engine.running and engine.queue
    engine.close()
    assert gen.cache.blocks.num_free() == gen.cache.blocks.usable_blocks and not engine.requests and not engine.groups


def test_a_prefill_that_raises_reaches_the_caller_and_frees_every_block(model, monkeypatch):
    """Admission takes requests off the queue before their prefill runs; when the prefill raises (a CUDA error, an
    out-of-memory), `generate` must raise that error, not one from its cleanup, and leave no block held."""
    gen = Generator(model, GeneratorConfig(max_num_seqs=4, max_model_len=64, block_size=4), eos_token_ids=())
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0)

    def broken(*args, **kwargs):
        raise RuntimeError("prefill failed")

    monkeypatch.setattr(gen.runner, "prefill", broken)
    with pytest.raises(RuntimeError, match="prefill failed"):
        gen.generate([[2, 3, 4, 5, 6], [7, 8, 9]], sp, n=2)
    assert gen.cache.blocks.num_free() == gen.cache.blocks.usable_blocks
    monkeypatch.undo()
    out = gen.generate([[2, 3, 4, 5, 6]], sp, n=2)  # the generator still serves
    assert [len(c.token_ids) for c in out[0]] == [4, 4]
