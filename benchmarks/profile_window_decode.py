"""Where a Gemma 3 decode step goes (#57's bytes-floor target): one shape, one context and row count, window on and
off, random bf16 weights, graphs on as the generator runs them (`decode_timing.decode_case`'s setup). For each side:
the graphed step's time (CUDA events over --chunk engine steps), then a torch.profiler trace of the same chunks:
GPU kernel time a step (summed), the host's wall a step, and the kernels ranked by their time a step. The floor
beside it: the weights' bytes plus the KV the step reads (`bench_window_decode.kv_reads`) over --bandwidth.

  python benchmarks/profile_window_decode.py --shape gemma3-270m --context 16384 --rows 64
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics

import torch
from bench_window_decode import kv_reads, smoke_shape, window_off
from decode_timing import BLOCK_SIZE, decode_len, free_cuda, timed
from torch.profiler import ProfilerActivity, profile

from monorl.generate import Generator, GeneratorConfig, SamplingParams
from monorl.generate.cache import kv_cache_bytes_needed
from monorl.generate.engine import Engine
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.fused_kernels import FusedKernelsLinear
from monorl.model.layers import Linear


def attention_by_layer(prof: profile, chunk: int) -> list[dict]:
    """Each attention launch's time, in launch order and averaged over the chunk's steps: which layers (window or
    full) hold the attention's time. Kernels whose name starts with `_attn`."""
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                  and e.name.startswith("_attn")), key=lambda e: e.time_range.start)
    per_step = len(evs) // chunk
    out = []
    for i in range(per_step):
        same = evs[i::per_step][:chunk]
        out.append({"name": same[0].name, "us": statistics.mean(e.device_time_total for e in same)})
    return out


def side(model: torch.nn.Module, rows: int, context: int, chunk: int, bandwidth: float, top: int,
         triton_gemm: bool = False) -> dict:
    cfg = model.config
    max_len = decode_len(context, chunk, 6)
    dev = next(model.parameters()).device
    need = kv_cache_bytes_needed(cfg, rows, max_len, BLOCK_SIZE, next(model.parameters()).dtype)
    gen = Generator(model, GeneratorConfig(max_num_seqs=rows, max_model_len=max_len, kv_cache_bytes=need,
                                           stop_check_interval=chunk))
    if triton_gemm:  # the copy's layer projections on the Triton decode GEMM (`FusedKernelsLinear`), before capture
        for name, m in gen.model.named_modules():
            if type(m) is Linear and ".layers." in f".{name}":
                m.__class__ = FusedKernelsLinear
    engine = Engine(gen)
    g = torch.Generator().manual_seed(context)
    sp = SamplingParams(max_new_tokens=max_len - context, temperature=1.0, seed=1, ignore_eos=True,
                        stop_token_ids=(cfg.vocab_size - 1,))
    for i in range(rows):
        engine.add(i, torch.randint(0, cfg.vocab_size - 1, (context,), generator=g).tolist(), sp, one_turn=True)
    engine.step()
    engine.step()
    step_ms = statistics.median(timed(dev, engine.step) for _ in range(3)) / chunk * 1e3
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        wall = timed(dev, engine.step)
    kernels: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:160]] += e.device_time_total / chunk
            counts[e.name[:160]] += 1 / chunk
    reads = kv_reads(engine)["kv_reads"]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = sum(k["bytes_per_step"] for k in reads.values())
    out = {"step_ms": step_ms, "profiled_step_ms": wall / chunk * 1e3, "gpu_kernel_ms": sum(kernels.values()) / 1e3,
           "kernels_per_step": sum(counts.values()), "weights_mb": weights / 1e6, "kv_read_mb": kv / 1e6,
           "floor_ms": (weights + kv) / bandwidth * 1e3,
           "top": [(n, t / 1e3, counts[n]) for n, t in kernels.most_common(top)],
           "attention_by_launch": attention_by_layer(prof, chunk),
           "host_top": [(a.key[:70], a.self_cpu_time_total / chunk / 1e3, a.count / chunk) for a in
                        sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:10]]}
    del engine, gen
    free_cuda()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="gemma3-270m")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s (an H100's HBM3 peak)")
    ap.add_argument("--out", default="profile_window_decode.json")
    ap.add_argument("--top", type=int, default=14, help="kernels listed, by their time a step")
    ap.add_argument("--triton-gemm", action="store_true",
                    help="also the window-on side with the layers' projections on the Triton decode GEMM")
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny Gemma 3 shape: checks the script")
    args = ap.parse_args()
    if args.smoke:
        cfg, dev, dtype = smoke_shape(), torch.device("cpu"), torch.float32
        args.context, args.rows, args.chunk = 96, 2, 4
    else:
        cfg, dev, dtype = model_shape(args.shape), torch.device("cuda"), torch.bfloat16
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", **vars(args), "sides": {}}
    sides = [("on", cfg, False)] + ([("on, Triton GEMM", cfg, True)] if args.triton_gemm else []) + \
        [("off", window_off(cfg), False)]
    for label, c, triton_gemm in sides:
        model = build_model(c, dev, dtype, seed=None).init_weights(0).requires_grad_(False)
        res["sides"][label] = s = side(model, args.rows, args.context, args.chunk, args.bandwidth, args.top,
                                       triton_gemm)
        del model
        free_cuda()
        print(f"{args.shape} ctx {args.context} rows {args.rows} window {label}: step {s['step_ms']:.2f} ms "
              f"(profiled {s['profiled_step_ms']:.2f}), GPU kernels {s['gpu_kernel_ms']:.2f} ms in "
              f"{s['kernels_per_step']:.0f} launches, floor {s['floor_ms']:.2f} ms (weights {s['weights_mb']:.0f} MB "
              f"+ KV {s['kv_read_mb']:.0f} MB)", flush=True)
        for name, ms, n in s["top"]:
            print(f"   {ms:7.3f} ms {n:5.0f}x  {name}")
        print("   attention launches, us:", " ".join(f"{a['us']:.0f}" for a in s["attention_by_launch"]))
        print("   host, self time a step:")
        for name, ms, n in s["host_top"]:
            print(f"   {ms:7.3f} ms {n:5.0f}x  {name}")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
