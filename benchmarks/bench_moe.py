"""Decode step of a mixture-of-experts model against a dense one (issue #46's floor): Qwen3-30B-A3B's shapes (random
weights) against Qwen3-4B's (about the same active parameters), each on monorl's generator (CUDA graphs, fused
kernels), at `--rows` live sequences.

    python benchmarks/bench_moe.py --config .device/qwen3-30b-a3b/config.json \\
        --dense-config .device/qwen3-4b/config.json --rows 64 --json moe.json

The generator builds its own bf16 copy of a policy; here the policy it copies is hollow (every tensor a stride-0
view of one zero, no memory), and the copy is then filled with random weights in place, so the 30B model exists
once, in bf16, on the GPU (~61 GB). Decode step = (time for N new tokens - time for 1) / (N - 1), medians of a few
runs; tokens/s = rows / step. `--device cpu --config tiny.json` checks the script end to end without a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from monorl.generate import Generator, GeneratorConfig, SamplingParams
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import ModelConfig, model_shape
from monorl.model.decoder import DecoderForCausalLM
from monorl.plan_params import active_param_count, param_counts


def hollow_policy(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> DecoderForCausalLM:
    """The model with every tensor a stride-0 view of one zero on `device`: what `Generator` copies from, free."""
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg)
    zero = torch.zeros((), dtype=dtype, device=device)
    return model._apply(lambda t: zero.expand(t.shape))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, runs: int, device: torch.device) -> float:
    out = []
    for _ in range(runs):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def bench(name: str, cfg: ModelConfig, args: argparse.Namespace, device: torch.device) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    gen = Generator(hollow_policy(cfg, device, dtype), GeneratorConfig(
        max_num_seqs=args.rows, max_model_len=args.prompt_len + args.new_tokens + 16), eos_token_ids=())
    gen.model.init_weights(seed=0)  # in place: graphs captured later read the same memory
    if args.batch_invariant:
        make_batch_invariant_(gen.model)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, cfg.vocab_size, (args.rows, args.prompt_len), generator=g).tolist()
    sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=0)
    one = SamplingParams(max_new_tokens=1, temperature=1.0, seed=0)
    gen.generate(prompts, sp)  # graph capture and first batch
    gen.generate(prompts, one)
    sync(device)
    startup = time.perf_counter() - t0
    t_all = timed(lambda: gen.generate(prompts, sp), args.runs, device)
    t_one = timed(lambda: gen.generate(prompts, one), args.runs, device)
    step = (t_all - t_one) / (args.new_tokens - 1)
    res = dict(model=name, rows=args.rows, total_params=sum(param_counts(cfg).values()),
               active_params=active_param_count(cfg), decode_step_ms=step * 1e3, tokens_per_s=args.rows / step,
               prefill_plus_first_token_s=t_one, startup_s=startup, batch_invariant=args.batch_invariant,
               device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    if device.type == "cuda":
        res["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    gen = None  # the next model's copy needs the memory
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return res


def read_config(path: str | None, default: str) -> tuple[str, ModelConfig]:
    if path is None:
        return default, model_shape(default)
    return Path(path).parent.name or path, ModelConfig.from_hf(json.loads(Path(path).read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="the MoE model's config.json (random weights of its shapes)")
    ap.add_argument("--dense-config", help="the dense floor's config.json (default: the qwen3-4b shape)")
    ap.add_argument("--rows", type=int, default=64, help="live sequences in each decode step")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens per timed batch (the step is their mean)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batch-invariant", action="store_true", help="time the batch-invariant copies instead")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.new_tokens < 2:
        raise SystemExit("--new-tokens must be >= 2 (the step is the difference between N tokens and 1)")
    moe_name, moe_cfg = read_config(args.config, "qwen3-30b-a3b")
    if not moe_cfg.is_moe:
        raise SystemExit(f"{args.config}: not a mixture-of-experts config (model_type {moe_cfg.model_type})")
    dense_name, dense_cfg = read_config(args.dense_config, "qwen3-4b")
    if args.device == "cpu" and args.dense_config is None:  # a CPU check runs the tiny dense shape
        dense_name, dense_cfg = "tiny", model_shape("tiny")
    rows = [bench(moe_name, moe_cfg, args, device)]
    print(f"{moe_name}: {rows[0]['decode_step_ms']:.3f} ms / step", flush=True)
    rows.append(bench(dense_name, dense_cfg, args, device))
    ratio = rows[0]["decode_step_ms"] / rows[1]["decode_step_ms"]
    print(f"\n{'model':<16}{'params':>10}{'active':>10}{'step ms':>10}{'tok/s':>10}   ({args.rows} rows, "
          f"{rows[0]['device']}{', batch-invariant' if args.batch_invariant else ''})")
    for r in rows:
        print(f"{r['model']:<16}{r['total_params'] / 1e9:>9.2f}B{r['active_params'] / 1e9:>9.2f}B"
              f"{r['decode_step_ms']:>10.3f}{r['tokens_per_s']:>10.0f}")
    print(f"MoE / dense decode step: {ratio:.2f}x (target: within 2x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": rows, "moe_over_dense": ratio}, indent=2) + "\n")


if __name__ == "__main__":
    main()
