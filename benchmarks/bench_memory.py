"""Memory plan against measurement, and what fits one GPU: the reference workload (10 GRPO steps, 5 prompts x 8,
100 new tokens, EOS ignored, the qwen3_0_6b_sum_digits preset's defaults, random weights from the released Qwen3
config.json, the real Qwen3 tokenizer) for each model, one `monorl train` process per row:

  0.6b, 1.7b, 4b     full fine-tuning
  8b-lora            --lora.rank 16 (full fine-tuning of 8B cannot fit one GPU: the plan says so)
  4b-nographs        4b with --compile.trainer_cuda_graphs false (what the trainer graphs are worth at 4B)

Per row: planned peak vs measured peak allocated (torch.cuda.max_memory_allocated), peak reserved, the trainer's
measured transient bytes vs the plan's activations + gradients, activation checkpointing (the plan's choice), the
steady-state step, process wall time.

--decode-lora MODEL: also time the decode of a LoRA policy's generator two ways, the adapters merged into the
fused bf16 copy vs run as separate matmuls on an unfused copy (what batch-invariant mode needs), and the
merge-sync time.

Model directories: `.models/qwen3-<size>/config.json` and `.models/qwen3-tokenizer/` (copied from ../shared/models;
an ignored folder carried to the GPU machine); each run gets a directory holding both (`model_dir`).

  python benchmarks/bench_memory.py --rows 0.6b,1.7b,4b,8b-lora --out results.json [--decode-lora 8b]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GiB = 1 << 30
ROWS: dict[str, tuple[str, list[str]]] = {
    "0.6b": ("qwen3-0.6b", []),
    "1.7b": ("qwen3-1.7b", []),
    "4b": ("qwen3-4b", []),
    "8b-lora": ("qwen3-8b", ["--lora.rank", "16"]),
    "4b-nographs": ("qwen3-4b", ["--compile.trainer_cuda_graphs", "false"]),
    "1.7b-lora": ("qwen3-1.7b", ["--lora.rank", "16"]),
    # GPT-OSS-20B (#57; its released config, from MODEL_SHAPES; the Qwen3 tokenizer's ids fit its vocabulary):
    # LoRA on the attention (experts take no adapters), the generator's adapters over the policy's own base (the
    # merged copy's second 39 GiB base does not fit 80 GB: `monorl plan` advises it)
    "gpt-oss-20b-lora": ("gpt-oss-20b", ["--lora.rank", "16", "--lora.targets", "q,k,v,o",
                                         "--generator.merge_lora", "false"]),
}


def model_dir(models: Path, model: str) -> Path:
    """A checkpoint directory without weights: the model's config.json beside the Qwen3 tokenizer files."""
    d = Path(tempfile.gettempdir()) / "monorl_models" / model
    d.mkdir(parents=True, exist_ok=True)
    for f in [models / model / "config.json", *sorted((models / "qwen3-tokenizer").iterdir())]:
        if f.is_file() or f.name != "config.json":
            # an unchanged file is left as it is: its mtime keys the tokenizer's kept copy (`read_tokenizer_file`),
            # so a rewrite made the first run after each call parse the original again
            if not (d / f.name).is_file() or not filecmp.cmp(f, d / f.name, shallow=False):
                shutil.copy(f, d / f.name)
        else:  # a shape monorl knows the released config of (gpt-oss-20b): written from it
            from monorl.model.config import MODEL_SHAPES

            (d / "config.json").write_text(json.dumps(MODEL_SHAPES[model].to_hf(), indent=1))
    return d


def run_train(args: list[str], label: str, timeout_s: float | None = None
              ) -> tuple[subprocess.CompletedProcess, str, float]:
    """`monorl train ARGS` in a fresh process: (the process, its stdout + stderr, wall seconds); a failure's log
    tail is printed under `label`. timeout_s: past it the whole process group is killed (torchrun's workers too: a
    `timeout` around the benchmark kills only its direct child, and a hung row's workers then kept spinning NCCL
    kernels on the GPUs the next rows measured) and the row fails with exit -9."""
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "monorl.cli", "train", *args]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as p:
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            err += f"\n(killed after {timeout_s:g} s)"
        proc = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    wall = time.perf_counter() - t
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        print(f"--- {label} failed (exit {proc.returncode}):\n{log[-3000:]}", flush=True)
    return proc, log, wall


def run_row(name: str, models: Path, steps: int, backend: str | None = None) -> dict:
    model, extra = ROWS[name]
    run_dir = Path(tempfile.mkdtemp(prefix=f"mem_{name}_"))
    proc, log, wall = run_train(
        ["--preset", "qwen3_0_6b_sum_digits", "--model.path", str(model_dir(models, model)), "--model.random_init",
         "true", "--rollout.ignore_eos", "true", "--checkpoint.final", "false", "--steps", str(steps), "--run_dir",
         str(run_dir), *(["--compile.backend", backend] if backend else []), *extra], name)
    if proc.returncode != 0:
        return {"name": name, "error": log[-2000:], "returncode": proc.returncode, "wall_s": wall}
    print(f"--- {name}\n" + "\n".join(line for line in log.splitlines() if "DEBUG" not in line)[-2500:], flush=True)
    s = json.loads((run_dir / "summary.json").read_text())
    mem = s["memory"]
    plan = mem["plan"]
    rows = plan["rows"]
    planned_trainer = rows["trainer activations"] + rows["gradients"]
    return {
        "name": name, "wall_s": wall, "steady_step_s": s["steady_step_s"], "startup_s": s["startup_s"],
        "generate_s": s["generate_s"], "train_s": s["train_s"], "sync_s": s["sync_s"],
        "planned_peak_gib": plan["peak_bytes"] / GiB, "measured_peak_gib": mem["peak_allocated_bytes"] / GiB,
        "reserved_peak_gib": mem["peak_reserved_bytes"] / GiB,
        "trainer_transient_gib": (mem["trainer_transient_bytes"] or 0) / GiB,
        "planned_trainer_gib": planned_trainer / GiB, "activation_checkpointing": plan["activation_checkpointing"],
        "micro_batch_tokens": plan["micro_batch_tokens"], "plan_rows_gib": {k: v / GiB for k, v in rows.items()},
        "device_gib": (plan["device_bytes"] or 0) / GiB, "trainer_graphs": s.get("trainer_graphs"),
        "marks_gib": {k: {kk: vv / GiB for kk, vv in v.items()} for k, v in (mem.get("marks") or {}).items()},
    }


def decode_lora(model: str, models: Path) -> dict:
    """Decode time of a LoRA policy's generator: merged into the fused copy vs adapters as separate matmuls."""
    import torch

    from monorl.compile import CompileConfig
    from monorl.generate.generator import Generator, GeneratorConfig
    from monorl.generate.sampling import SamplingParams
    from monorl.model.decoder import build_model
    from monorl.model.hf_checkpoint import load_config, load_tokenizer
    from monorl.model.lora import LoRAConfig, apply_lora_

    path = model_dir(models, f"qwen3-{model}")
    cfg, tok = load_config(path), load_tokenizer(path)
    policy = build_model(cfg, "cuda", torch.bfloat16, seed=0)
    lora = LoRAConfig(rank=16)
    apply_lora_(policy, lora, base_dtype=torch.bfloat16)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if n.endswith("lora_B.weight"):
                p.normal_(0, 0.01)  # non-zero adapters: the merge does real work
    prompts = [tok.encode(f"What is the total digit sum of [{i}, {i + 3}, 17]? " * 12) for i in range(5)]
    sp = SamplingParams(max_new_tokens=100, temperature=0.8, top_p=0.95, ignore_eos=True, seed=0)
    out = {"model": model}
    for variant, kw in (("merged_fused", {}), ("adapters_unfused", {"lora": lora, "fused": False})):
        gen = Generator(policy, GeneratorConfig(max_num_seqs=64, max_model_len=2048), tokenizer=tok,
                        compile=CompileConfig(), **kw)
        gen.generate(prompts, sp, n=8)  # capture
        times, syncs = [], []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            gen.generate(prompts, sp, n=8)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
            gen.load_weights_(policy)
            torch.cuda.synchronize()
            syncs.append(time.perf_counter() - t)
        out[variant] = {"generate_s_median": sorted(times)[2], "sync_s_median": sorted(syncs)[2],
                        "generator_weights_gib": sum(p.numel() * p.element_size()
                                                     for p in gen.model.parameters()) / GiB}
        del gen
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="0.6b,1.7b,4b,8b-lora")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--models", default=".models")
    ap.add_argument("--decode-lora", default=None, help="model size for the merged-vs-unmerged decode timing")
    ap.add_argument("--out", default=None)
    ap.add_argument("--compile-backend", default=None, help="--compile.backend for every row (default: the preset's)")
    a = ap.parse_args()
    models = Path(a.models).resolve()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    results = []
    for r in (r for r in a.rows.split(",") if r):
        results.append(run_row(r, models, a.steps, a.compile_backend))
        if a.out:  # after every row: a call cut off by its time limit keeps what it measured
            Path(a.out).write_text(json.dumps({"rows": results}, indent=2) + "\n")
    decode = decode_lora(a.decode_lora, models) if a.decode_lora else None
    print("\n| row | AC | planned peak GiB | measured peak GiB | err | reserved GiB | trainer transient GiB "
          "(planned) | steady step s | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['name']} | failed (exit {r['returncode']}) | | | | | | | {r['wall_s']:.1f} |")
            continue
        err = (r["planned_peak_gib"] - r["measured_peak_gib"]) / r["measured_peak_gib"]
        print(f"| {r['name']} | {'on' if r['activation_checkpointing'] else 'off'} | {r['planned_peak_gib']:.1f} | "
              f"{r['measured_peak_gib']:.1f} | {err:+.1%} | {r['reserved_peak_gib']:.1f} | "
              f"{r['trainer_transient_gib']:.1f} ({r['planned_trainer_gib']:.1f}) | {r['steady_step_s']:.3f} | "
              f"{r['wall_s']:.1f} |")
    for r in results:
        marks = "; ".join(f"{k}: {v['allocated']:.1f}/{v['reserved']:.1f}" for k, v in r.get("marks_gib", {}).items())
        print(f"{r['name']} (allocated/reserved GiB) {marks}")
    if decode:
        print(f"\nLoRA generator ({decode['model']}, 5 prompts x 8 x 100 tokens, eager + decode graphs):")
        for v in ("merged_fused", "adapters_unfused"):
            d = decode[v]
            print(f"  {v}: generate {d['generate_s_median'] * 1e3:.1f} ms, sync {d['sync_s_median'] * 1e3:.1f} ms, "
                  f"weights {d['generator_weights_gib']:.2f} GiB")
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": results, "decode_lora": decode}, indent=2) + "\n")


if __name__ == "__main__":
    main()
