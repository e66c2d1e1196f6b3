"""Recycled sliding-window rings on CUDA (#57): a small Gemma 3 (window 40, blocks of 16: rings of 4 blocks) whose
episodes' turns are longer than a ring, decoded from CUDA graphs, their turn boundaries prefilled by the Triton
paged kernel through the temporary window buffer (`TurnWindow`), captured and replayed: in batch-invariant mode each
turn equals its conversation re-prefilled bit for bit (eager and compiled), and in bf16 a replayed boundary equals
the eager one's."""

from __future__ import annotations

import random

import pytest
import torch

from monorl.compile import CompileConfig
from monorl.generate.engine import Engine
from monorl.generate.episodes import run_episodes
from monorl.generate.generator import Generator, GeneratorConfig
from monorl.generate.sampling import SamplingParams
from monorl.generate.window_cache import RecycledWindowKV, ring_size
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import ModelConfig
from monorl.model.decoder import build_model
from tests.test_episodes import reprefilled_turn, turn_starts

pytestmark = pytest.mark.gpu
TURNS, WINDOW, BS = 3, 40, 16
CFG = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=64, rope_theta=1e6, max_position_embeddings=1024,
                  tie_word_embeddings=True).with_family("gemma3_text").replace(
    layer_types=("sliding_attention", "full_attention", "sliding_attention", "sliding_attention"),
    sliding_window=WINDOW, rope_local_theta=10000.0, query_pre_attn_scalar=64.0)


def gemma(dtype: torch.dtype) -> torch.nn.Module:
    model = build_model(CFG, device="cuda", dtype=dtype, seed=0)
    with torch.no_grad():  # O(1) logits, so sampling is not degenerate
        for n, p in model.named_parameters():
            if not n.endswith("norm.weight"):
                p.mul_(5.0)
    return model.eval()


def scripted(seed: int, n: int) -> tuple[dict, dict]:
    """Prompts past the window, inserts past a ring (R * BS = 64 positions)."""
    rng = random.Random(seed)
    prompts = {i: [rng.randrange(2, CFG.vocab_size) for _ in range(rng.randint(45, 120))] for i in range(n)}
    inserts = {i: [[rng.randrange(2, CFG.vocab_size) for _ in range(rng.randint(65, 100))] for _ in range(TURNS - 1)]
               for i in range(n)}
    return prompts, inserts


def episodes(gen: Generator, prompts: dict, inserts: dict, sp: SamplingParams) -> tuple[Engine, dict]:
    engine = Engine(gen, max_tokens=800)
    done = run_episodes(engine, prompts, sp, lambda ep, ev: inserts[ep.id][ev.turn] if ev.turn < TURNS - 1 else None)
    kind = next(k for k in gen.cache.kinds if isinstance(k, RecycledWindowKV))
    assert kind.R == ring_size(WINDOW, BS) and kind.pool.num_free() == kind.pool.usable_blocks
    return engine, done


@pytest.mark.parametrize("compile", [False, True])
def test_turns_past_a_ring_equal_reprefill_bitwise_in_invariant_mode(compile):
    model = gemma(torch.float32)
    gen = Generator(model, GeneratorConfig(max_num_seqs=8, max_model_len=800, block_size=BS, stop_check_interval=8),
                    compile=CompileConfig(backend="inductor" if compile else "none"))
    make_batch_invariant_(model)
    make_batch_invariant_(gen.model)
    prompts, inserts = scripted(0, 6)
    # ~4% of the vocabulary stops a turn: turns end mid-chunk, decodes run past their stops (`keeps`)
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, seed=7, stop_token_ids=tuple(range(2, 22)))
    engine, done = episodes(gen, prompts, inserts, sp)
    for i, ep in done.items():
        starts = turn_starts(ep)
        for t, s in enumerate(starts[1:], start=1):
            end = starts[t + 1] - len(inserts[i][t]) if t + 1 < TURNS else len(ep.tokens)
            ref = reprefilled_turn(engine, ep, s, sp)
            assert ref.token_ids == ep.tokens[s:end], (i, t)
            assert ref.logprobs == ep.logprobs[s:end], (i, t)


def test_replayed_turn_boundaries_equal_eager_ones():
    """bf16, the Triton paged turn prefill: a boundary captured at its third run and replayed in the fourth gives
    the first (eager) run's tokens and log-probs bit for bit."""
    gen = Generator(gemma(torch.bfloat16), GeneratorConfig(max_num_seqs=8, max_model_len=800, block_size=BS),
                    compile=CompileConfig(backend="none"))
    assert gen.runner.turn_prefill_form("auto") == "paged"
    prompts, inserts = scripted(2, 6)
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    runs = []
    for _ in range(4):
        _, done = episodes(gen, prompts, inserts, sp)
        runs.append({i: (ep.tokens, ep.logprobs) for i, ep in done.items()})
    cached = [k for k in gen.runner.prefill_graphs if k[0] == "cached"]
    assert cached and all(gen.runner.prefill_seen[k] == 3 for k in cached)
    assert runs[1] == runs[0] and runs[2] == runs[0] and runs[3] == runs[0]
