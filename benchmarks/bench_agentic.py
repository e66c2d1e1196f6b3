"""Multi-turn episodes on one GPU (#42): sampled tokens/s of the same episodes three ways.

- kv_reuse: monorl's request-level engine (`Engine`): each turn pauses holding its KV, the environment's
  tokens are appended and only they are prefilled, then decoding goes on; `--turn-prefill` names how the appended
  tokens attend their cached prefix (`ModelRunner.prefill_cached`), comma-separated: auto (the engine's default:
  paged on CUDA), paged (the Triton kernel reads the keys through the block tables), varlen (keys gathered, flash),
  decode (the oldest form, one paged-decode row per token); the first is row kv_reuse, the others kv_reuse_<form>;
- reprefill: a request per turn, as a client of an engine without prefix caching does: every turn prefills the
  whole conversation so far (`Generator.generate` on prompt + history), then decodes the turn;
- single_turn: one decode of the same sampled length per episode (turns x turn tokens), no environment;
- single_turn_total: the same, its prompt the episode's prompt followed by every token the environment inserts: one
  decode of the same total and sampled lengths (the issue's "single-turn decoding of the same total length"), whose
  steps read as many cached keys as the episode's do on average or more.

A scripted environment forces the turn structure on random weights (Qwen3-0.6B shapes): every turn samples exactly
`--turn-tokens` (ignore_eos), the environment answers with `--inserted` fixed tokens. After the timed runs, one more
run of each kv_reuse form times its turn boundaries' `prefill_cached` calls alone (a device sync before and after
each). Prints a table last and writes JSON (benchmarks/results/agentic.json).

    python benchmarks/bench_agentic.py --episodes 64 --turns 4 --turn-tokens 128 --inserted 64
    python benchmarks/bench_agentic.py --tiny     # a tiny model and workload: seconds on a CPU
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from monorl.compile import CompileConfig
from monorl.generate import Engine, Generator, GeneratorConfig, SamplingParams
from monorl.generate.runner import TURN_PREFILLS
from monorl.model import build_model, model_shape


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kv_reuse(gen: Generator, prompts: list[list[int]], env: list[list[int]], sp: SamplingParams, turns: int,
             turn_prefill: str) -> float:
    engine = Engine(gen, max_tokens=gen.max_model_len, turn_prefill=turn_prefill)
    for i, p in enumerate(prompts):
        engine.add(i, p, sp)
    done_turns = dict.fromkeys(range(len(prompts)), 0)
    t = time.perf_counter()
    while engine.has_work():
        for ev in engine.step():
            done_turns[ev.request_id] += 1
            if done_turns[ev.request_id] == turns:
                engine.finish(ev.request_id)
            else:
                engine.resume(ev.request_id, env[ev.request_id])
    sync()
    return time.perf_counter() - t


def reprefill(gen: Generator, prompts: list[list[int]], env: list[list[int]], sp: SamplingParams,
              turns: int) -> float:
    history = [list(p) for p in prompts]
    t = time.perf_counter()
    for turn in range(turns):
        outs = gen.generate(history, sp, n=1)
        for h, comps, e in zip(history, outs, env, strict=True):
            h += list(comps[0].token_ids) + (e if turn + 1 < turns else [])
    sync()
    return time.perf_counter() - t


def timed_turn_prefills(gen: Generator, run: Callable[[], float]) -> list[dict]:
    """`run()` with each `prefill_cached` call timed alone (a device sync before and after): its seconds, sequences
    and appended tokens."""
    runner, calls = gen.runner, []
    plain = runner.prefill_cached

    def timed(chunks: list[list[int]], *args: Any, **kwargs: Any) -> torch.Tensor:
        sync()
        t = time.perf_counter()
        out = plain(chunks, *args, **kwargs)
        sync()
        calls.append({"s": time.perf_counter() - t, "sequences": len(chunks), "tokens": sum(map(len, chunks))})
        return out

    runner.prefill_cached = timed
    try:
        run()
    finally:
        del runner.prefill_cached  # the instance attribute: the method again
    return calls


def single_turn(gen: Generator, prompts: list[list[int]], sp: SamplingParams, turns: int) -> float:
    long = SamplingParams(**{**sp.__dict__, "max_new_tokens": sp.max_new_tokens * turns})
    t = time.perf_counter()
    gen.generate(prompts, long, n=1)
    sync()
    return time.perf_counter() - t


def single_turn_total(gen: Generator, prompts: list[list[int]], env: list[list[int]], sp: SamplingParams,
                      turns: int) -> float:
    return single_turn(gen, [p + e * (turns - 1) for p, e in zip(prompts, env, strict=True)], sp, turns)


def workload(shape: str, device: str, episodes: int, turns: int, turn_tokens: int, inserted: int,
             prompt_tokens: int) -> tuple[Generator, list[list[int]], list[list[int]], SamplingParams]:
    """The scripted workload on random weights of `shape`: a generator holding the episodes, their prompts, the
    tokens the environment inserts after each turn, and a turn's sampling (exactly `turn_tokens`, EOS ignored)."""
    cfg = model_shape(shape)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, cfg.vocab_size - 10) for _ in range(prompt_tokens)] for _ in range(episodes)]
    env = [[rng.randrange(10, cfg.vocab_size - 10) for _ in range(inserted)] for _ in range(episodes)]
    model = build_model(cfg, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32, seed=0)
    gen = Generator(model, GeneratorConfig(max_num_seqs=episodes,
                                           max_model_len=prompt_tokens + turns * (turn_tokens + inserted) + 16),
                    compile=CompileConfig(backend="none"))
    return gen, prompts, env, SamplingParams(max_new_tokens=turn_tokens, temperature=1.0, ignore_eos=True, seed=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=128)
    ap.add_argument("--inserted", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="benchmarks/results/agentic.json")
    ap.add_argument("--turn-prefill", default="auto",
                    help="kv_reuse's prefill of appended tokens, comma-separated, of auto, paged, varlen, decode: the "
                         "first is row kv_reuse, the others kv_reuse_<form>")
    ap.add_argument("--tiny", action="store_true",
                    help="the tiny model, 4 episodes x 3 turns x 8 sampled + 4 inserted, 8-token prompts, 1 run")
    ap.add_argument("--profile", action="store_true", help="cProfile one kv_reuse run: where its host time goes")
    a = ap.parse_args()
    if a.tiny:
        a.shape, a.episodes, a.turns, a.turn_tokens, a.inserted, a.prompt_tokens, a.runs = "tiny", 4, 3, 8, 4, 8, 1
    turn_prefills = a.turn_prefill.split(",")
    if not turn_prefills or any(tp not in TURN_PREFILLS for tp in turn_prefills):
        ap.error(f"--turn-prefill: a comma-separated list of {TURN_PREFILLS}, got {a.turn_prefill!r}")
    gen, prompts, env, sp = workload(a.shape, a.device, a.episodes, a.turns, a.turn_tokens, a.inserted,
                                     a.prompt_tokens)
    sampled = a.episodes * a.turns * a.turn_tokens
    reuse = {tp: f"kv_reuse_{tp}" if i else "kv_reuse" for i, tp in enumerate(turn_prefills)}
    ways = {name: functools.partial(kv_reuse, gen, prompts, env, sp, a.turns, tp) for tp, name in reuse.items()}
    ways |= {"reprefill": lambda: reprefill(gen, prompts, env, sp, a.turns),
             "single_turn": lambda: single_turn(gen, prompts, sp, a.turns),
             "single_turn_total": lambda: single_turn_total(gen, prompts, env, sp, a.turns)}
    for fn in ways.values():  # warm-up: graphs captured, kernels compiled
        fn()
    results = {}
    for name, fn in ways.items():
        times = [fn() for _ in range(a.runs)]
        best = min(times)
        results[name] = {"seconds": times, "best_s": best, "sampled_tokens_per_s": sampled / best}
    boundaries = {name: timed_turn_prefills(gen, ways[name]) for name in reuse.values()}
    for name, calls in boundaries.items():
        results[name]["turn_prefills"] = calls
        results[name]["turn_prefill_s"] = sum(c["s"] for c in calls)
    first = reuse[turn_prefills[0]]
    if a.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(ways[first])
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    peak = torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else None
    # the prefill graphs the runs left (`ModelRunner.prefill`, `prefill_cached`; PREFILL_GRAPHS at most): whether the
    # turn boundaries were replayed or ran eagerly
    graphs = list(gen.runner.prefill_graphs)
    graph_counts = {"prefill_graphs": len(graphs), "turn_boundary_graphs": sum(k[0] == "cached" for k in graphs)}
    out = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
           "args": vars(a), "sampled_tokens": sampled, "peak_gib": peak, "results": results, **graph_counts,
           "kv_reuse_vs_single_turn": results[first]["sampled_tokens_per_s"]
           / results["single_turn"]["sampled_tokens_per_s"],
           "kv_reuse_vs_single_turn_total": results[first]["sampled_tokens_per_s"]
           / results["single_turn_total"]["sampled_tokens_per_s"],
           "kv_reuse_vs_reprefill": results[first]["sampled_tokens_per_s"]
           / results["reprefill"]["sampled_tokens_per_s"]}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"{a.episodes} episodes x {a.turns} turns x {a.turn_tokens} sampled + {a.inserted} inserted, {a.shape}, "
          f"{out['device']}, peak {peak if peak is None else round(peak, 1)} GiB, prefill graphs "
          f"{graph_counts['prefill_graphs']} ({graph_counts['turn_boundary_graphs']} of turn boundaries)")
    print(f"{'way':<17} {'best s':>8} {'sampled tok/s':>14} {'turn prefills s (calls: seqs x tokens)':>40}")
    for name, r in results.items():
        calls = r.get("turn_prefills")
        what = "" if calls is None else (f"{r['turn_prefill_s']:.3f} ("
                                         + ", ".join(f"{c['s'] * 1e3:.1f} ms: {c['sequences']}x{c['tokens']}"
                                                     for c in calls[:4]) + (", ..." if len(calls) > 4 else "") + ")")
        print(f"{name:<17} {r['best_s']:>8.3f} {r['sampled_tokens_per_s']:>14.0f} {what:>40}")
    print(f"{first} / single_turn = {out['kv_reuse_vs_single_turn']:.2f}x, / single_turn_total = "
          f"{out['kv_reuse_vs_single_turn_total']:.2f}x (target >= 0.9); "
          f"{first} / reprefill = {out['kv_reuse_vs_reprefill']:.2f}x (target >= 2)")


if __name__ == "__main__":
    main()
