"""Async and disaggregated RL on one host (issue #44): tokens/s and GPU wait shares of one long-tailed workload
under several placements, each a real `monorl train` job of N ranks (torchrun) in its own run directory.

Workload (defaults: the issue's): random weights of a named shape (qwen3-1.7b; with --tokenizer DIR its tokenizer,
else the char tokenizer), 64 prompts x 8 samples per step, up to 1024 new tokens, EOS ignored and every SAMPLE
stopped after its own length, drawn from a seeded lognormal (median max/8, sigma 1, clipped to [32, max]) keyed by
its prompt and its index in the group, so every configuration trains on the same lengths (benchmarks/async_worker.py
says how). --workload completions (default): the sum_digits task, one completion per sample. --workload episodes:
guess_number multi-turn episodes (an unparsable guess gets an answer, so random weights play on), every turn cut at
--turn-tokens (128) sampled tokens, the drawn length (median max/4 here) being each episode's budget of sampled +
inserted tokens: a long tail of turns.

Configurations (--configs, comma-separated; default all):
  sync            colocated, K = 0 (today's on-policy loop)
  coloc_k1        colocated, rollout.max_staleness 1
  g1_k1           disaggregated 1 generator + N-1 trainers, K = 1
  g1_k2           1 + N-1, K = 2
  g2_k1           2 generators + N-2 trainers, K = 1
  g2_k2           2 + N-2, K = 2
  *_inflight      the same with in-flight weight updates, the generators making continuous batches
                  (`monorl.rl.rollouts.continuous`: the next batches' samples take the slots a batch's finished ones
                  free)

Per configuration, over the steady window (the steps after the first and before the last 2, 2 being the largest K
of the list: the same window for every configuration):
  tokens/s        trained tokens (prompt + completion, `num_tokens`) over the window's wall (its summed time/step_s)
  step s          the median step
  generate / train share of the wall (disaggregated: the generator ranks' time per batch; batches are made ahead,
                  so over a short window it may exceed 1)
  producer / consumer idle share: `time/producer_idle_s` (the generating side waiting for the trainers) and
                  `time/consumer_idle_s` (the trainers waiting for a batch); colocated K = 0 logs neither: there the
                  trainer waits for the whole generation and the generator for the whole train step, which is what
                  colocated K >= 1 logs too
  GPU wait share  GPU-seconds spent waiting for the other side over all GPU-seconds, (G x producer idle + T x
                  consumer idle) / N, for disaggregated; 0 for colocated, whose GPUs take turns (their tail decode
                  with few sequences left shows in tokens/s, not here)
  staleness mean / max, and the completions' mean / max length (the same in every row: a check on the draw)
Prints a table last and writes JSON (--out; the rows of configurations an earlier call ran with the same workload
are kept, so the list can be split over several calls).

    python benchmarks/bench_async.py --tokenizer DIR --configs sync,coloc_k1 --out /tmp/b44/async.json
    python benchmarks/bench_async.py --tiny      # CPU, gloo, 4 ranks, the tiny shape: proves the harness only

Anything else on the command line goes to every `monorl train` (e.g. --generator.max_num_seqs 512).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from async_worker import FORCED_LENGTHS_ENV, TURN_TOKENS_ENV, LengthDraw  # noqa: E402 -- the ranks' entry, beside this file

# name -> (generator ranks, max_staleness, in-flight updates)
CONFIGS: dict[str, tuple[int, int, bool]] = {
    "sync": (0, 0, False),
    "coloc_k1": (0, 1, False),
    "g1_k1": (1, 1, False),
    "g1_k1_inflight": (1, 1, True),
    "g1_k2": (1, 2, False),
    "g1_k2_inflight": (1, 2, True),
    "g2_k1": (2, 1, False),
    "g2_k1_inflight": (2, 1, True),
    "g2_k2": (2, 2, False),
    "g2_k2_inflight": (2, 2, True),
}
K_MAX = max(k for _, k, _ in CONFIGS.values())  # the steady window ends K_MAX steps before the last, for every row
TINY_NOTE = ("--tiny: a tiny model on CPU ranks sharing a few cores; its numbers say the harness runs end to end, "
             "nothing about speed")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--shape", default="qwen3-1.7b", help="random weights of this named shape")
    ap.add_argument("--tokenizer", default=None,
                    help="a directory with the shape's tokenizer.json (e.g. the Qwen3 tokenizer); default: the "
                         "char tokenizer")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--length-median", type=float, default=None,
                    help="default: max-new-tokens / 8 (episodes: / 4, an episode's budget spanning turns)")
    ap.add_argument("--length-sigma", type=float, default=1.0)
    ap.add_argument("--length-min", type=int, default=32)
    ap.add_argument("--length-seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="generator.max_num_seqs of every rank")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--work-dir", default=None, help="run directories go here (default: a fresh temp dir)")
    ap.add_argument("--out", default=None, help="the JSON to write (merged with its rows of the same workload)")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU smoke run: tiny shape, 4 gloo ranks, 8 prompts x 2, 32 tokens, 4 steps")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per configuration's job")
    ap.add_argument("--workload", choices=("completions", "episodes"), default="completions",
                    help="completions: sum_digits, one completion per sample; episodes: guess_number multi-turn "
                         "episodes, the drawn length being each episode's token budget")
    ap.add_argument("--turn-tokens", type=int, default=128, help="episodes: sampled tokens per turn")
    a, passthrough = ap.parse_known_args(argv)
    if a.tiny:
        a.shape, a.device, a.prompts, a.group, a.max_new_tokens, a.steps = "tiny", "cpu", 8, 2, 32, 4
        a.length_min, a.max_num_seqs, a.turn_tokens = 4, 64, 8
        if a.workload == "episodes":  # the char tokenizer's environment answers are ~60 tokens
            a.max_new_tokens = 256
    names = [c for c in a.configs.split(",") if c]
    if bad := [c for c in names if c not in CONFIGS]:
        ap.error(f"unknown configuration(s) {', '.join(bad)}; known: {', '.join(CONFIGS)}")
    for c in names:
        g = CONFIGS[c][0]
        if g and (a.nproc - g < 1 or a.prompts % g):
            ap.error(f"{c}: {g} generator rank(s) need --nproc > {g} and --prompts divisible by {g}")
    if not names:
        ap.error("--configs is empty")
    if a.steps < 2 + K_MAX:
        ap.error(f"--steps {a.steps} leaves no steady step (the first and the last {K_MAX} are excluded)")
    a.names = names
    return a, passthrough


def length_draw(a: argparse.Namespace) -> LengthDraw:
    median = a.length_median if a.length_median is not None else \
        a.max_new_tokens / (4 if a.workload == "episodes" else 8)
    return LengthDraw(median=median, sigma=a.length_sigma, min_len=a.length_min, seed=a.length_seed)


def model_flags(a: argparse.Namespace, work: Path) -> list[str]:
    """Random weights of the shape: with --tokenizer, a directory holding the shape's config.json beside the
    tokenizer files (`--model.path DIR --model.random_init true`); else `--model.shape` (the char tokenizer)."""
    if a.tokenizer is None:
        return ["--model.shape", a.shape]
    from monorl.model.config import model_shape

    src = Path(a.tokenizer)
    if not (src / "tokenizer.json").is_file():
        raise SystemExit(f"bench_async: --tokenizer {src} has no tokenizer.json")
    d = work / f"model-{a.shape}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(model_shape(a.shape).to_hf(), indent=2) + "\n")
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy(src / f, d / f)
    return ["--model.path", str(d), "--model.random_init", "true"]


def train_flags(a: argparse.Namespace, name: str, run_dir: Path, model: list[str]) -> list[str]:
    g, k, inflight = CONFIGS[name]
    base = (["--preset", "tiny", "--compile.backend", "none", "--compile.trainer_cuda_graphs", "false",
             "--compile.decode_cuda_graphs", "false", "--batch_invariant", "false"] if a.tiny
            # activation checkpointing on everywhere: the same trainer work in every configuration (a colocated
            # 1.7B run resolves auto to on), and a disaggregated trainer's auto probe trips on the plan's missing
            # KV row (`monorl plan ... --placement.generator_ranks 1 --nproc 4 --gpu_memory_gb 79.6`: StopIteration)
            else ["--preset", "qwen3_0_6b_sum_digits", "--generator.max_model_len", str(a.max_new_tokens + 512),
                  "--trainer.activation_checkpointing", "true"])
    if a.workload == "episodes":  # an unparsable guess gets an answer and the game goes on: the budget binds
        base += ["--task.name", "guess_number", "--task.args.max_turns", "1000",
                 *(["--generator.max_model_len", "512"] if a.tiny else [])]
    return [*base, *model, "--device", a.device, "--run_dir", str(run_dir), "--steps", str(a.steps),
            "--rollout.prompts_per_step", str(a.prompts), "--rollout.group_size", str(a.group),
            "--rollout.max_new_tokens", str(a.max_new_tokens), "--rollout.ignore_eos", "true",
            "--generator.max_num_seqs", str(a.max_num_seqs),
            "--warm_start.steps", "0", "--validation.num_prompts", "0", "--checkpoint.every", "0",
            "--checkpoint.final", "false", "--samples_per_step", "2",
            "--rollout.max_staleness", str(k), "--rollout.inflight_updates", str(inflight).lower(),
            "--placement.generator_ranks", str(g)]


def run_config(a: argparse.Namespace, name: str, work: Path, model: list[str], draw: LengthDraw,
               passthrough: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run one configuration's job; (its result fields, its step rows) -- an error row when it failed."""
    run_dir = work / f"{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}"  # a work dir reused by a later call
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(a.nproc),
           str(ROOT / "benchmarks" / "async_worker.py"), "train", *train_flags(a, name, run_dir, model), *passthrough]
    env = {**os.environ, FORCED_LENGTHS_ENV: draw.to_env(), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if a.workload == "episodes":
        env[TURN_TOKENS_ENV] = str(a.turn_tokens)
    if a.tiny:
        env["OMP_NUM_THREADS"] = "1"
    print(f"--- {name}: {' '.join(cmd[1:])}", flush=True)
    t = time.perf_counter()
    # its own process group: a job past --timeout ends with all its ranks (none left holding a GPU)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            log, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
        (work / f"{run_dir.name}.log").write_text(log)
        return {"error": f"timed out after {a.timeout:.0f} s", "log": str(work / f"{run_dir.name}.log")}, []
    wall = time.perf_counter() - t
    (work / f"{run_dir.name}.log").write_text(log)
    if proc.returncode != 0:
        print(f"--- {name} failed (exit {proc.returncode}):\n{log[-3000:]}", flush=True)
        why = next((line for line in log.splitlines() if "error:" in line or "Error" in line), "")
        return {"error": f"exit {proc.returncode}: {why[:300]}", "job_wall_s": wall,
                "log": str(work / f"{run_dir.name}.log")}, []
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"job_wall_s": wall, "startup_s": summary.get("startup_s"), "run_dir": str(run_dir)}, \
        [r for r in rows if "step" in r]


def steady_row(name: str, nproc: int, steps: list[dict[str, Any]], window: range) -> dict[str, Any]:
    """The configuration's numbers over the steady window (module docstring)."""
    g, k, inflight = CONFIGS[name]
    by_step = {r["step"]: r for r in steps}
    if missing := [s for s in [window.start - 1, *window] if s not in by_step]:
        raise ValueError(f"{name}: metrics.jsonl lacks step(s) {missing}")
    rows = [by_step[s] for s in window]
    tokens = rows[-1]["num_tokens"] - by_step[window.start - 1]["num_tokens"]
    wall = sum(r["time/step_s"] for r in rows)

    def total(key: str) -> float:
        return sum(r[key] for r in rows)

    if "time/consumer_idle_s" in rows[0]:
        consumer, producer = total("time/consumer_idle_s"), total("time/producer_idle_s")
    else:  # colocated K = 0: the sides take turns (what colocated K >= 1 logs as its idle times)
        consumer, producer = total("time/generate_s"), total("time/train_s") + total("time/sync_s")
    gpu_wait = (g * producer + (nproc - g) * consumer) / nproc if g else 0.0
    return {
        "config": name, "generator_ranks": g, "trainer_ranks": nproc - g, "max_staleness": k,
        "inflight_updates": inflight, "steady_steps": [window.start, window.stop - 1],
        "trained_tokens": tokens, "steady_wall_s": wall, "tokens_per_s": tokens / wall,
        "step_s_median": statistics.median(r["time/step_s"] for r in rows),
        "first_step_s": by_step[0]["time/step_s"] if 0 in by_step else None,
        "generate_share": total("time/generate_s") / wall, "train_share": total("time/train_s") / wall,
        "producer_idle_share": producer / wall, "consumer_idle_share": consumer / wall,
        "gpu_wait_share": gpu_wait / wall,
        "staleness_mean": statistics.fmean(r.get("staleness/mean", 0.0) for r in rows),
        "staleness_max": max(r.get("staleness/max", 0) for r in rows),
        "staleness_token_mean": statistics.fmean(r.get("staleness/token_mean", 0.0) for r in rows),
        "buffer_depth_mean": statistics.fmean(r.get("async/buffer_depth", 0) for r in rows),
        "completion_mean_length": statistics.fmean(r["completions/mean_length"] for r in rows),
        "completion_max_length": max(r["completions/max_length"] for r in rows),
    }


def table(rows: list[dict[str, Any]]) -> str:
    base = next((r["tokens_per_s"] for r in rows if r["config"] == "sync" and "tokens_per_s" in r), None)
    out = ["| config | G+T | K | tokens/s | vs sync | step s | generate / train share | producer / consumer idle "
           "share | GPU wait share | staleness mean / max | completion mean / max |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['config']} | | | failed: {r['error'][:120]} | | | | | | | |")
            continue
        vs = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        gt = f"{r['generator_ranks']}+{r['trainer_ranks']}" if r["generator_ranks"] else f"coloc {r['trainer_ranks']}"
        k = f"{r['max_staleness']}{' in-flight' if r['inflight_updates'] else ''}"
        out.append(f"| {r['config']} | {gt} | {k} | {r['tokens_per_s']:.0f} | {vs} | {r['step_s_median']:.2f} | "
                   f"{r['generate_share']:.2f} / {r['train_share']:.2f} | "
                   f"{r['producer_idle_share']:.2f} / {r['consumer_idle_share']:.2f} | {r['gpu_wait_share']:.2f} | "
                   f"{r['staleness_mean']:.2f} / {r['staleness_max']} | "
                   f"{r['completion_mean_length']:.0f} / {r['completion_max_length']:.0f} |")
    return "\n".join(out)


def device_name(device: str) -> str:
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"cpu ({os.cpu_count()} cores)"


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def main(argv: list[str] | None = None) -> int:
    a, passthrough = parse_args(argv)
    draw = length_draw(a)
    work = Path(a.work_dir) if a.work_dir else Path(__import__("tempfile").mkdtemp(prefix="bench_async_"))
    work.mkdir(parents=True, exist_ok=True)
    model = model_flags(a, work)
    window = range(1, a.steps - K_MAX)
    workload = {"shape": a.shape, "tokenizer": a.tokenizer or "char", "nproc": a.nproc, "prompts": a.prompts,
                "group": a.group, "max_new_tokens": a.max_new_tokens, "steps": a.steps,
                "max_num_seqs": a.max_num_seqs, "workload": a.workload,
                "task": "guess_number" if a.workload == "episodes" else "sum_digits",
                "turn_tokens": a.turn_tokens if a.workload == "episodes" else None, "tiny": a.tiny,
                "passthrough": passthrough,
                "lengths": draw.describe(a.max_new_tokens)}
    lengths = workload["lengths"]
    print(f"workload: {a.workload}, {a.shape}, {a.nproc} ranks, {a.prompts} prompts x {a.group}, lengths per sample: "
          f"median {lengths['p50']}, p90 {lengths['p90']}, p99 {lengths['p99']}, max {lengths['max']}, mean "
          f"{lengths['mean']:.0f} ({lengths['share_at_max'] * 100:.1f}% at max); steady steps {window.start}.."
          f"{window.stop - 1}; run dirs under {work}", flush=True)
    if a.tiny:
        print(TINY_NOTE, flush=True)
    command = " ".join([Path(sys.executable).name, *sys.argv])
    out_path = Path(a.out) if a.out else None
    kept: list[dict[str, Any]] = []
    if out_path is not None and out_path.is_file():
        old = json.loads(out_path.read_text())
        if old.get("workload") == workload:  # the same workload: keep the other configurations' rows
            kept = [r for r in old.get("rows", []) if r["config"] not in a.names]
    rows: list[dict[str, Any]] = []
    for name in a.names:
        info, steps = run_config(a, name, work, model, draw, passthrough)
        row = {"config": name, **info} if "error" in info else {**steady_row(name, a.nproc, steps, window), **info}
        row.update(date=now(), command=command)  # rows merged from several calls keep their own
        rows.append(row)
        if out_path is not None:  # after every configuration: a cut-off call keeps what it measured
            all_rows = sorted(kept + rows, key=lambda r: list(CONFIGS).index(r["config"]))
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps({
                "date": now(), "device": device_name(a.device), "command": command,
                "note": TINY_NOTE if a.tiny else "",
                "window": f"steps {window.start}..{window.stop - 1}: after the first, before the last {K_MAX} "
                "(the same for every configuration); tokens/s = trained tokens / the window's summed time/step_s",
                "workload": workload, "rows": all_rows}, indent=2) + "\n")
    all_rows = sorted(kept + rows, key=lambda r: list(CONFIGS).index(r["config"]))
    print()
    if a.tiny:
        print(f"NOTE: {TINY_NOTE}")
    print(table(all_rows))
    trained = {r["config"]: r["trained_tokens"] for r in all_rows if "trained_tokens" in r}
    if len(set(trained.values())) > 1:  # the forced lengths make every configuration train the same tokens
        print(f"WARNING: the configurations trained different token counts in the window: {trained}")
    elif trained:
        print(f"every configuration trained the same {next(iter(trained.values()))} tokens in the window")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
