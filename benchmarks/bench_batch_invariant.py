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
from monorl.model import build_model, model_shape
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.ops import matmul_invariant
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


def run_mode(mode: bool, runs: int, shape: str, tiles: str = "auto") -> dict:
    matmul_invariant.MM_TILES = tiles
    torch.manual_seed(0)
    model = build_model(model_shape(shape), "cuda", torch.float32, seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 32000) for _ in range(rng.randint(100, 120))] for _ in range(5)]
    sp = SamplingParams(max_new_tokens=100, temperature=0.8, top_p=0.95, ignore_eos=True, seed=1)
    gen = Generator(model, GeneratorConfig(max_num_seqs=64, max_model_len=512), fused=not mode)  # as the loop
    if mode:  # both sides, as the RL loop converts them
        make_batch_invariant_(model)
        make_batch_invariant_(gen.model)
    gen.generate(prompts, sp, n=8)  # graph capture / Triton compile
    gen_s = cuda_time(lambda: gen.generate(prompts, sp, n=8), runs)
    out = gen.generate(prompts, sp, n=8)
    seqs = [TrainSequence(p, c.token_ids, c.logprobs, 1.0 if j % 2 else -1.0)
            for p, cs in zip(prompts, out, strict=True) for j, c in enumerate(cs)]
    tr = Trainer(model, TrainerConfig(lr=1e-7, micro_batch_tokens=8192), total_steps=runs + 2)
    # also the warm-up; the weights are still the generator's, so its diff is meaningful
    first = tr.step(seqs, temperature=sp.temperature)
    train_s = cuda_time(lambda: tr.step(seqs, temperature=sp.temperature), runs)
    name = ("batch_invariant" + ("" if tiles == "auto" else f"/{tiles}")) if mode else "default"
    return {"mode": name, "generate_s": statistics.median(gen_s),
            "train_step_s": statistics.median(train_s), "logprob_diff_max_step1": first["logprob_diff_max"],
            "logprob_diff_mean_step1": first["logprob_diff_mean"], "generate_all_s": gen_s, "train_all_s": train_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--out", default="bench_batch_invariant.json")
    ap.add_argument("--mm-tiles", nargs="*", default=["auto"], help="also time these matmul tilings (e.g. large)")
    args = ap.parse_args()
    rows = [run_mode(False, args.runs, args.shape)]
    torch.cuda.empty_cache()  # the first mode's generator and KV cache are gone with its frame
    for tiles in args.mm_tiles:
        torch.cuda.empty_cache()
        rows.append(run_mode(True, args.runs, args.shape, tiles))
    d, b = rows[0], rows[1]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape,
              "rows": rows, "generate_slowdown": b["generate_s"] / d["generate_s"],
              "train_step_slowdown": b["train_step_s"] / d["train_step_s"]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['device']}  torch {result['torch']}  {args.shape}, median of {args.runs}")
    print(f"{'mode':<22} {'generate 5x8 (s)':>17} {'train step (s)':>15} {'lp diff max (step 1)':>21}")
    for r in rows:
        print(f"{r['mode']:<22} {r['generate_s']:>17.3f} {r['train_step_s']:>15.3f} "
              f"{r['logprob_diff_max_step1']:>21.3g}")
    for r in rows[1:]:
        print(f"{'slowdown ' + (r['mode'][16:] or 'auto'):<22} {r['generate_s'] / d['generate_s']:>16.2f}x "
              f"{r['train_step_s'] / d['train_step_s']:>14.2f}x")


if __name__ == "__main__":
    main()
