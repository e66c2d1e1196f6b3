"""Engine on CUDA: with the decode step replayed from CUDA graphs and the appended tokens prefilled by the
Triton paged attention over the cached prefix, an episode equals its conversation re-prefilled at every turn, bit
for bit in batch-invariant mode; in the default mode its log-probs are an eager full forward's over its tokens."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from monorl.compile import CompileConfig
from monorl.generate.engine import Engine
from monorl.generate.episodes import run_episodes
from monorl.generate.generator import Generator, GeneratorConfig
from monorl.generate.requests import Request, TurnEvent
from monorl.generate.sampling import SamplingParams
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from tests.conftest import full_forward_logprobs
from tests.test_episodes import reprefilled_turn, turn_starts
from tests.test_generate_gpu import tiny_cuda_model

pytestmark = pytest.mark.gpu
TURNS = 3


def scripted(seed: int, n: int, vocab: int, longest: int) -> tuple[dict, dict]:
    rng = random.Random(seed)
    prompts = {i: [rng.randrange(2, vocab) for _ in range(rng.randint(3, longest))] for i in range(n)}
    inserts = {i: [[rng.randrange(2, vocab) for _ in range(rng.randint(1, longest // 3))] for _ in range(TURNS - 1)]
               for i in range(n)}
    return prompts, inserts


@pytest.mark.parametrize("compile", [False, True])
def test_kv_reuse_equals_reprefill_bitwise_in_invariant_mode(compile):
    cfg = dataclasses.replace(model_shape("qwen3-0.6b"), num_layers=4)  # Qwen3-0.6B width, 4 layers
    model = build_model(cfg, "cuda", torch.float32, seed=0)
    gcfg = GeneratorConfig(max_num_seqs=8, max_model_len=512, kv_cache_bytes=1 << 30, stop_check_interval=3)
    gen = Generator(model, gcfg, compile=CompileConfig(backend="inductor" if compile else "none"))
    make_batch_invariant_(model)
    make_batch_invariant_(gen.model)
    assert gen.runner.use_graphs
    engine = Engine(gen, max_tokens=400)
    prompts, inserts = scripted(0, 6, cfg.vocab_size, 150)
    # ~2% of the vocabulary stops a turn: some turns end on a stop token, mid-way through a decode chunk
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, seed=7, stop_token_ids=tuple(range(2, 3000)))
    done = run_episodes(engine, prompts, sp,
                        lambda ep, ev: inserts[ep.id][ev.turn] if ev.turn < TURNS - 1 else None)
    assert gen.cache.blocks.num_free() == gen.cache.blocks.usable_blocks
    for i, ep in done.items():
        starts = turn_starts(ep)
        for t, s in enumerate(starts[1:], start=1):
            end = starts[t + 1] - len(inserts[i][t]) if t + 1 < TURNS else len(ep.tokens)
            ref = reprefilled_turn(engine, ep, s, sp)
            assert ref.token_ids == ep.tokens[s:end], (i, t)
            assert ref.logprobs == ep.logprobs[s:end], (i, t)


@pytest.mark.parametrize("compile", [False, True])
def test_default_mode_episode_is_the_models(compile):
    """bf16, fused kernels, decode graphs; one episode resumes with no tokens (a single-token prefill)."""
    model = tiny_cuda_model()
    gen = Generator(model, GeneratorConfig(max_num_seqs=4, max_model_len=256),
                    compile=CompileConfig(backend="inductor" if compile else "none"))
    engine = Engine(gen, max_tokens=200)
    prompts, inserts = scripted(1, 5, model.config.vocab_size, 40)
    inserts[0][0] = []
    sp = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.95, seed=3, ignore_eos=True)

    def environment(ep: Request, ev: TurnEvent) -> list[int] | None:
        return inserts[ep.id][ev.turn] if ev.turn < TURNS - 1 else None

    done = run_episodes(engine, prompts, sp, environment)
    assert gen.cache.blocks.num_free() == gen.cache.blocks.usable_blocks
    for ep in done.values():
        ref = full_forward_logprobs(model, ep.tokens[:1], ep.tokens[1:], sp.temperature)
        mask = torch.tensor(ep.sampled[1:])
        assert int(mask.sum()) == TURNS * 16
        torch.testing.assert_close(torch.tensor(ep.logprobs[1:])[mask], ref[mask], atol=0.1, rtol=0)


@pytest.mark.parametrize("invariant", [False, True])
def test_turn_boundaries_replay_their_graphs(invariant):
    """The same episodes four times: a turn boundary's shape is captured at its third run (PREFILL_CAPTURE_AT) and
    replayed in the fourth, whose tokens and log-probs are the first's (eager) bit for bit: the graph runs the eager
    run's kernels on the same static layout. In batch-invariant mode the first run is the re-prefilled conversation's
    (the test above), so the replayed one is too."""
    model = tiny_cuda_model()
    gen = Generator(model, GeneratorConfig(max_num_seqs=8, max_model_len=256), compile=CompileConfig(backend="none"))
    if invariant:
        make_batch_invariant_(model)
        make_batch_invariant_(gen.model)
    prompts, inserts = scripted(2, 6, model.config.vocab_size, 40)
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    runs = []
    for _ in range(4):
        done = run_episodes(Engine(gen, max_tokens=200), prompts, sp,
                            lambda ep, ev: inserts[ep.id][ev.turn] if ev.turn < TURNS - 1 else None)
        runs.append({i: (ep.tokens, ep.logprobs) for i, ep in done.items()})
    cached = [k for k in gen.runner.prefill_graphs if k[0] == "cached"]
    assert cached and all(gen.runner.prefill_seen[k] == 3 for k in cached)  # captured, then replayed
    assert runs[1] == runs[0] and runs[2] == runs[0] and runs[3] == runs[0]
