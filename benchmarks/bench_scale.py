"""Scale-out on one node: N ranks (torchrun through `monorl train --nproc N`), one process per GPU, three
workloads (all random weights from the released Qwen3 config.json, the real Qwen3 tokenizer, EOS ignored so
every step generates the same tokens):

  8b       Qwen3-8B full fine-tuning, 8 prompts x 8 completions x 100 tokens per step (the global batch is fixed:
           strong scaling; 8 divides over 1, 2 and 4 ranks). Full 8B does not fit one GPU (the plan says so): at
           --nproc 1 the row reports the plan's refusal
  weak     Qwen3-1.7B, 5 prompts x 8 per GPU (prompts_per_step = 5 N: weak scaling)
  moe30b   Qwen3-30B-A3B (mixture of experts) with LoRA on the attention, 8 prompts x 8 x 100 tokens: its RL steps on
           4 GPUs, generating tensor-parallel over the 4 (full fine-tuning does not fit 4 H200s; the plan puts this
           at ~40 GiB a GPU)
  14b      Qwen3-14B full fine-tuning, 8 prompts x 8 x 100 tokens, on 4 GPUs generating tensor-parallel over the 4
           (--generator.tensor_parallel_size 4; the plan: 76.1 GiB a GPU, activation checkpointing on)
  32b      Qwen3-32B with LoRA (rank 16, q,k,v,o), the same batch, 4 GPUs, TP 4 (full fine-tuning needs ~219 GiB a
           GPU on 4; LoRA ~50). The configs of 14b and 32b are not in ../shared/models: write them as the released
           ones are (hidden 5120; 40 layers, 40 heads, MLP 17408 / 64 layers, 64 heads, MLP 25600; 8 kv heads)
  8b_gsm8k Qwen3-8B full fine-tuning with the qwen3_0_6b_gsm8k preset's own defaults (8 prompts x 8, up to 512
           tokens, 100 validation prompts before and after) on GSM8K (--data DIR: train.jsonl and test.jsonl): #45's
           "runs with the preset's defaults"; EOS is not ignored (random weights rarely emit it)
  ref      the reference workload, preset qwen3_0_6b_sum_digits (5 prompts x 8, 100 tokens) with random init of
           .models/qwen3-0.6b/config.json; 5 groups do not divide over 2 or 4 ranks, so there the row runs 8
           prompts (`ref8`, also run at N = 1 for the comparison)

Per row: steady-state step (median of the steps after the first), prompt+completion tokens per second of step
time, generate / train / weight-sync seconds per step (weight sync: the FSDP shards all-gathered into every
rank's bf16 generator copy), startup, wall time. Prints a table and writes JSON (--out).

Model directories: `.models/qwen3-<size>/config.json` and `.models/qwen3-tokenizer/` (see bench_memory.py).

  python benchmarks/bench_scale.py --nproc 2 --rows 8b,weak,ref --out results/scale_2.json
  python benchmarks/bench_scale.py --nproc 4 --rows ref8 --vs-one 3    # 3 pairs of 4 GPUs against the first one
  python benchmarks/bench_scale.py --nproc 2 --rows ref8 --shape tiny --device cpu --steps 2 \
      --compile.backend none --compile.trainer_cuda_graphs false --compile.decode_cuda_graphs false \
      --rollout.max_new_tokens 8 --generator.max_model_len 512 --validation.num_prompts 2 \
      --batch_invariant false    # a CPU smoke run (the mode's CPU path is slow reference code)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import model_dir, run_train  # noqa: E402 -- the benchmarks' shared helpers

TP4_ROWS = {  # rows of models one GPU's generator copy cannot hold beside the trainer's shard: 4 GPUs, TP 4
    "moe30b": ("qwen3-30b-a3b", ["--lora.rank", "16", "--lora.targets", "q,k,v,o"]),  # full: 243 GiB a GPU on 4
    "14b": ("qwen3-14b", []),
    "32b": ("qwen3-32b", ["--lora.rank", "16", "--lora.targets", "q,k,v,o"]),  # full: 219 GiB a GPU on 4
}


PRESET_ROWS = {"8b_gsm8k": ("qwen3-8b", "qwen3_0_6b_gsm8k")}  # name: (model, preset run with its own defaults)


def row_args(name: str, nproc: int, data: Path | None = None) -> tuple[str, list[str]] | str:
    """(model, extra flags) of a row at `nproc` ranks; a string saying why when the row does not apply there."""
    if name in PRESET_ROWS:
        if data is None or not (data / "train.jsonl").is_file():
            return f"needs --data DIR with GSM8K's train.jsonl and test.jsonl (got {data})"
        return PRESET_ROWS[name][0], ["--task.args.train_path", str(data / "train.jsonl"),
                                      "--task.args.test_path", str(data / "test.jsonl")]
    if name == "8b":
        return "qwen3-8b", ["--rollout.prompts_per_step", "8"]
    if name == "weak":
        return "qwen3-1.7b", ["--rollout.prompts_per_step", str(5 * nproc)]
    if name == "ref":
        return ("qwen3-0.6b", []) if 5 % nproc == 0 else f"5 prompt groups do not divide over {nproc} ranks"
    if name == "ref8":
        return "qwen3-0.6b", ["--rollout.prompts_per_step", "8"]
    if name in TP4_ROWS:
        if nproc != 4:
            return "a 4-GPU row (tensor-parallel generation over the 4)"
        model, extra = TP4_ROWS[name]
        return model, ["--rollout.prompts_per_step", "8", "--generator.tensor_parallel_size", "4", *extra]
    raise ValueError(f"unknown row {name!r}")


def run_row(name: str, nproc: int, models: Path, steps: int, shape: str | None, device: str,
            passthrough: list[str], timeout_s: float | None = None, data: Path | None = None,
            log_to: Path | None = None) -> dict:
    """One row's `monorl train` and its summary; log_to: where its whole output goes (a failure's tail is in the
    row, not always enough to say where it failed)."""
    spec = row_args(name, nproc, data)
    if isinstance(spec, str):
        return {"name": name, "nproc": nproc, "skipped": spec}
    model, extra = spec
    run_dir = Path(tempfile.mkdtemp(prefix=f"scale_{name}_{nproc}_"))
    # --shape: a named shape (e.g. tiny) instead of the row's model, for a smoke run without .models or a GPU
    where = (["--model.shape", shape] if shape else
             ["--model.path", str(model_dir(models, model)), "--model.random_init", "true"])
    preset = ["--preset", PRESET_ROWS[name][1]] if name in PRESET_ROWS else [
        "--preset", "qwen3_0_6b_sum_digits", "--rollout.ignore_eos", "true"]
    proc, log, wall = run_train(
        ["--nproc", str(nproc), *preset, *where, "--checkpoint.final", "false", "--steps", str(steps), "--device",
         device, "--run_dir", str(run_dir), *extra, *passthrough], f"{name} x{nproc}", timeout_s)
    if log_to is not None:
        log_to.write_text(log)
    if proc.returncode != 0:
        return {"name": name, "nproc": nproc, "error": log[-2000:], "returncode": proc.returncode, "wall_s": wall}
    print(f"--- {name} x{nproc}\n{proc.stdout[-2000:]}", flush=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows if "step" in r][1:] or [r for r in rows if "step" in r]
    summary = json.loads((run_dir / "summary.json").read_text())

    def med(key: str) -> float:
        return statistics.median(r[key] for r in steady)

    prompts = json.loads((run_dir / "config.json").read_text())["rollout"]["prompts_per_step"]
    first = next(r for r in rows if "step" in r)
    return {"name": name, "nproc": nproc, "model": shape or model, "prompts_per_step": prompts,
            "steady_step_s": med("time/step_s"), "tokens_per_s": med("throughput/tokens_per_s"),
            "generate_s": med("time/generate_s"), "train_s": med("time/train_s"), "sync_s": med("time/sync_s"),
            "first_step_s": first["time/step_s"], "first_train_s": first["time/train_s"],
            "logprob_diff_max": max(r.get("logprob_diff_max", float("nan")) for r in rows if "step" in r),
            # startup ends when every rank is ready (rank_wait_s: rank 0 waiting for the others); the run's own
            # wall time starts after imports and the process group, the row's wall_s around the whole command
            "startup_s": summary.get("startup_s"), "startup": summary.get("startup"),
            "run_wall_s": summary.get("wall_s"), "wall_s": wall}


@contextlib.contextmanager
def one_gpu(device: str) -> Iterator[None]:
    """The 1-GPU side of a pair: the first GPU of this machine alone (CUDA_VISIBLE_DEVICES=0 for the child)."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device != "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    try:
        yield
    finally:
        if device != "cpu" and before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        elif device != "cpu":
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def pair_summary(pairs: list[dict]) -> dict:
    """Means over the pairs that both ran: each side's steady step, their ratio, and the ratios' median and range."""
    ok = [p for p in pairs if p["ratio"] is not None]
    if not ok:
        return {"pairs": 0}
    n, one = statistics.mean(p["n_step_s"] for p in ok), statistics.mean(p["one_step_s"] for p in ok)
    ratios = [p["ratio"] for p in ok]
    return {"pairs": len(ok), "mean_n_step_s": n, "mean_one_step_s": one, "ratio_of_means": n / one,
            "median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios)}


def print_rows(results: list[dict]) -> None:
    print("\n| row | ranks | steady step s | tokens/s | generate s | train s | weight sync s | first step s |"
          " startup s | run wall s | wall s | logprob_diff max |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "skipped" in r or "error" in r:
            why = r.get("skipped") or f"failed (exit {r['returncode']})"
            print(f"| {r['name']} | {r['nproc']} | {why} | | | | | | | | | |")
            continue
        print(f"| {r['name']} | {r['nproc']} | {r['steady_step_s']:.3f} | {r['tokens_per_s']:.0f} | "
              f"{r['generate_s']:.3f} | {r['train_s']:.3f} | {r['sync_s']:.4f} | {r['first_step_s']:.2f} | "
              f"{r['startup_s'] or 0:.1f} | {r['run_wall_s'] or 0:.1f} | {r['wall_s']:.1f} | "
              f"{r['logprob_diff_max']:.3g} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, choices=(1, 2, 4), required=True)
    ap.add_argument("--rows", default="8b,weak,ref,ref8")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--models", default=".models")
    ap.add_argument("--shape", default=None, help="run every row on this named shape (smoke test)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--data", default="../shared/data/gsm8k", help="GSM8K's directory (the 8b_gsm8k row)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--row-timeout", type=float, default=None,
                    help="seconds a row may run; past it its processes are killed and the row fails")
    ap.add_argument("--vs-one", type=int, default=0, metavar="K",
                    help="K pairs: each row at --nproc, then on this machine's first GPU alone, K times in turns "
                         "(runs of one machine spread; a pair's ratio is N GPUs' steady step over one's)")
    a, passthrough = ap.parse_known_args()  # the rest goes to every `monorl train` (e.g. --compile.backend none)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    models = Path(a.models).resolve()
    names = [r for r in a.rows.split(",") if r]
    results: list[dict] = []
    pairs: list[dict] = []

    def row(name: str, nproc: int, tag: str) -> dict:
        log_to = Path(a.out).with_suffix(f".{name}_x{nproc}{tag}.log") if a.out else None
        r = run_row(name, nproc, models, a.steps, a.shape, a.device, passthrough, a.row_timeout,
                    Path(a.data).resolve(), log_to)
        results.append(r)
        if a.out:  # after every row: a call cut off by its time limit keeps what it measured
            Path(a.out).write_text(json.dumps({"nproc": a.nproc, "rows": results, "pairs": pairs,
                                               "pair_summary": pair_summary(pairs)}, indent=2) + "\n")
        return r

    for k in range(max(1, a.vs_one)):
        for name in names:
            tag = f"_{k + 1}" if a.vs_one else ""
            n = row(name, a.nproc, tag)
            if not a.vs_one:
                continue
            with one_gpu(a.device):
                one = row(name, 1, tag)
            steps = [r.get("steady_step_s") for r in (n, one)]
            pairs.append({"row": name, "pair": k + 1, "n_step_s": steps[0], "one_step_s": steps[1],
                          "ratio": steps[0] / steps[1] if None not in steps else None})
    if a.out and a.vs_one:
        Path(a.out).write_text(json.dumps({"nproc": a.nproc, "rows": results, "pairs": pairs,
                                           "pair_summary": pair_summary(pairs)}, indent=2) + "\n")
    print_rows(results)
    if a.vs_one:
        print(f"\n| row | pair | {a.nproc} GPUs step s | 1 GPU step s | {a.nproc} / 1 |\n|---|---|---|---|---|")
        for p in pairs:
            ratio = f"{p['ratio']:.2f}x" if p["ratio"] is not None else "failed"
            print(f"| {p['row']} | {p['pair']} | {p['n_step_s'] or 0:.3f} | {p['one_step_s'] or 0:.3f} | {ratio} |")
        sm = pair_summary(pairs)
        if sm["pairs"]:
            print(f"\nover {sm['pairs']} pairs: {sm['mean_n_step_s']:.3f} / {sm['mean_one_step_s']:.3f} s = "
                  f"{sm['ratio_of_means']:.2f}x (median {sm['median_ratio']:.2f}x, {sm['min_ratio']:.2f}-"
                  f"{sm['max_ratio']:.2f}x)")


if __name__ == "__main__":
    main()
