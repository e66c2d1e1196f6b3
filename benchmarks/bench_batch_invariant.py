"""Cost of batch-invariant mode: the generator reference batch (Qwen3-0.6B shapes, random init, 5 prompts x
8 samples, prompts ~110 tokens, 100 new tokens) and one trainer step on its 40 rollouts, default vs
batch-invariant. CUDA-event medians; prints a table (last) and writes JSON to --out. Also reports the
first trainer step's logprob_diff (max), which the mode makes 0."""

from __future__ import annotations

import argparse
import json
import random
import statistics

import torch

from monorl.generate import Generator, GeneratorConfig, SamplingParams
from monorl.model import batch_invariant, build_model, model_shape
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.ops.tunables import overridden
from monorl.train.packing import TrainSequence
from monorl.train.trainer import Trainer, TrainerConfig


def cuda_time(fn, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def top_kernels(fn, n: int = 15) -> list[tuple[str, float, int]]:
    """(kernel, CUDA ms, calls) of one call of fn, the n largest by time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()]
    return sorted(rows, key=lambda r: -r[1])[:n]


def run_mode(mode: bool, runs: int, shape: str, tiles: str = "auto", ops: bool = False,
             profile: bool = False) -> dict:
    """ops: the mode as it was before the block kernels (an unfused generator copy; norms, RoPE and SiLU as the
    model's PyTorch ops on both sides; the PyTorch sampler), for comparison in the same process."""
    torch.manual_seed(0)
    model = build_model(model_shape(shape), "cuda", torch.float32, seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 32000) for _ in range(rng.randint(100, 120))] for _ in range(5)]
    sp = SamplingParams(max_new_tokens=100, temperature=0.8, top_p=0.95, ignore_eos=True, seed=1)
    gen = Generator(model, GeneratorConfig(max_num_seqs=64, max_model_len=512, fused_kernels=not ops),
                    fused=not ops)  # as the loop builds it
    if mode:  # both sides, as the RL loop converts them
        supported = batch_invariant.fused_kernels_supported
        if ops:
            batch_invariant.fused_kernels_supported = lambda m: False
        make_batch_invariant_(model)
        make_batch_invariant_(gen.model)
        batch_invariant.fused_kernels_supported = supported
    gen.generate(prompts, sp, n=8)  # graph capture / Triton compile
    gen_s = cuda_time(lambda: gen.generate(prompts, sp, n=8), runs)
    kernels = top_kernels(lambda: gen.generate(prompts, sp, n=8)) if profile else []
    out = gen.generate(prompts, sp, n=8)
    seqs = [TrainSequence(p, c.token_ids, c.logprobs, 1.0 if j % 2 else -1.0)
            for p, cs in zip(prompts, out, strict=True) for j, c in enumerate(cs)]
    tr = Trainer(model, TrainerConfig(lr=1e-7, micro_batch_tokens=8192), total_steps=runs + 2)
    # also the warm-up; the weights are still the generator's, so its diff is meaningful
    first = tr.step(seqs, temperature=sp.temperature)
    train_s = cuda_time(lambda: tr.step(seqs, temperature=sp.temperature), runs)
    name = ("batch_invariant" + ("" if tiles == "auto" else f"/{tiles}") + ("/ops" if ops else "")) if mode \
        else "default"
    return {"mode": name, "generate_s": statistics.median(gen_s), "generate_top_kernels": kernels,
            "train_step_s": statistics.median(train_s), "logprob_diff_max_step1": first["logprob_diff_max"],
            "logprob_diff_mean_step1": first["logprob_diff_mean"], "generate_all_s": gen_s, "train_all_s": train_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--out", default="bench_batch_invariant.json")
    ap.add_argument("--mm-tiles", nargs="*", default=["auto"], help="also time these matmul tilings (e.g. large)")
    ap.add_argument("--ops", action="store_true", help="also the mode on the PyTorch ops (before the block kernels)")
    ap.add_argument("--profile", action="store_true", help="print each mode's top CUDA kernels of one batch")
    args = ap.parse_args()
    rows = [run_mode(False, args.runs, args.shape, profile=args.profile)]
    torch.cuda.empty_cache()  # the first mode's generator and KV cache are gone with its frame
    for tiles in args.mm_tiles:
        torch.cuda.empty_cache()
        with overridden({"matmul.tiles": tiles}):  # the invariant GEMM's tiling (ops/tunables.py)
            rows.append(run_mode(True, args.runs, args.shape, tiles, profile=args.profile))
    if args.ops:
        torch.cuda.empty_cache()
        rows.append(run_mode(True, args.runs, args.shape, ops=True, profile=args.profile))
    d, b = rows[0], rows[1]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape,
              "rows": rows, "generate_slowdown": b["generate_s"] / d["generate_s"],
              "train_step_slowdown": b["train_step_s"] / d["train_step_s"]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in rows if args.profile else []:
        print(f"\n{r['mode']}: top CUDA kernels of one generate batch (ms, calls)")
        for name, ms, calls in r["generate_top_kernels"]:
            print(f"  {ms:9.2f} {calls:7d}  {name[:100]}")
    print(f"\n{result['device']}  torch {result['torch']}  {args.shape}, median of {args.runs}")
    print(f"{'mode':<22} {'generate 5x8 (s)':>17} {'train step (s)':>15} {'lp diff max (step 1)':>21}")
    for r in rows:
        print(f"{r['mode']:<22} {r['generate_s']:>17.3f} {r['train_step_s']:>15.3f} "
              f"{r['logprob_diff_max_step1']:>21.3g}")
    for r in rows[1:]:
        print(f"{'slowdown ' + (r['mode'][16:] or 'kernels'):<22} {r['generate_s'] / d['generate_s']:>16.2f}x "
              f"{r['train_step_s'] / d['train_step_s']:>14.2f}x")


if __name__ == "__main__":
    main()
