"""Where a trainer step's time goes: Qwen3-0.6B shapes (random init), 40 rollouts of ~110 prompt + 100 completion
tokens in prompt groups of --group-size (8: the reference's 5 prompts x 8; 1: every prompt its own), bf16 autocast,
flash varlen. `--workload smollm2`: the `smollm2_135m_arith` preset's step instead (SmolLM2-135M's shapes, random
init: 16 prompts x 8 rollouts of ~53 prompt + ~7 completion tokens, the DAPO loss, #62). Times eager vs regionally
compiled steps with CUDA events (median of 5 after 2 warm-ups) and prints the profiler's top CUDA kernels of one
compiled step. A variant ending in `_whole` packs every sequence whole (`trainer.share_prompts false`).

  python benchmarks/profile_train_step.py
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from monorl.compile import CompileConfig, compile_blocks, setup_compile_cache
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.train.losses import LossConfig
from monorl.train.packing import TrainSequence
from monorl.train.trainer import Trainer, TrainerConfig

# workload -> (model shape, rollouts, prompt tokens, completion tokens, loss kind)
WORKLOADS = {"w0": ("qwen3-0.6b", 40, 110, 100, "grpo"), "smollm2": ("smollm2-135m", 128, 53, 7, "dapo")}


def seqs(g: torch.Generator, group_size: int = 8, workload: str = "w0", vocab: int = 150000) -> list[TrainSequence]:
    _, n, prompt, completion, _ = WORKLOADS[workload]
    out = []
    for i in range(n):
        if i % group_size == 0:
            p = torch.randint(0, vocab, (prompt,), generator=g).tolist()
        c = torch.randint(0, vocab, (completion,), generator=g).tolist()
        out.append(TrainSequence(p, c, [-1.0] * completion, advantage=float(i % 3 - 1)))
    return out


def floor_s(cfg, params: int, batch: list[TrainSequence], group_size: int, flops_s: float, bytes_s: float) -> dict:
    """The step's floor: FLOPs (6 per non-embedding parameter per unique token -- a group's prompt is packed once --,
    and the LM head on the completion rows) over `flops_s`, against bytes (AdamW in fp32: params, grads and both
    moments read, params and moments written, 28 B a parameter; the fp32 weights read by forward and backward, 8 B)
    over `bytes_s`; the larger of the two."""
    unique = sum(len(s.completion_ids) for s in batch) + sum(len(s.prompt_ids) for s in batch[::group_size])
    head = cfg.vocab_size * cfg.hidden_size
    flops = 6 * (params - head) * unique + 6 * head * sum(len(s.completion_ids) for s in batch)
    traffic = 36 * params
    return {"unique_tokens": unique, "flops": flops, "bytes": traffic, "compute_s": flops / flops_s,
            "memory_s": traffic / bytes_s, "floor_s": max(flops / flops_s, traffic / bytes_s)}


def timed(tr: Trainer, batches: list[list[TrainSequence]]) -> list[float]:
    ts = []
    for b in batches:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        tr.step(b)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return ts


VARIANTS = {"eager": ("none", False), "eager_graphs": ("none", True), "compiled": ("inductor", False),
            "compiled_graphs": ("inductor", True),
            # batch-invariant mode, as the RL loop runs it (both converted, bf16 compute dtype)
            "bi_eager": ("none", False), "bi_graphs": ("none", True), "bi_compiled": ("inductor", False),
            "bi_compiled_graphs": ("inductor", True)}


def kernel_classes(prof) -> str:
    """CUDA time of one profiled step by kind of kernel (the profile's own rows are per name)."""
    # first match wins: aten's own kernels (at::native::..._kernel) before monorl's Triton ones (_name_kernel)
    kinds = {"elementwise / reduce (aten)": ("at::native", "elementwise", "reduce", "vectorized"),
             "matmul": ("gemm", "nvjet", "cutlass", "xmma", "matmul"), "attention": ("flash", "attn", "attention"),
             "triton": ("triton", "_kernel")}
    out: dict[str, list[float]] = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0.0)
        if not t or e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind = next((k for k, keys in kinds.items() if any(w in e.key.lower() for w in keys)), "other")
        row = out.setdefault(kind, [0.0, 0])
        row[0] += t / 1e3
        row[1] += e.count
    return "CUDA time by kind: " + ", ".join(f"{k} {ms:.1f} ms ({n})" for k, (ms, n) in sorted(out.items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="train_step.json")
    ap.add_argument("--variants", default="eager,eager_graphs,compiled,compiled_graphs")
    ap.add_argument("--profile", default="compiled", help="the variants whose one step is profiled (comma list)")
    ap.add_argument("--rows", type=int, default=18, help="kernels listed per profile")
    ap.add_argument("--group-size", type=int, default=8, help="rollouts per prompt (a GRPO group)")
    ap.add_argument("--workload", default="w0", choices=sorted(WORKLOADS))
    ap.add_argument("--flops", type=float, default=790e12, help="bf16 FLOP/s ceiling (H200's measured 790 TFLOP/s)")
    ap.add_argument("--bandwidth", type=float, default=3.0e12,
                    help="bytes/s ceiling (a device-to-device copy: ~3.0 TB/s on this workplace's H100, 4.3 on H200)")
    ap.add_argument("--shapes", type=int, default=0,
                    help="also list this many ATen ops by self CUDA time, by input shapes (where copies come from)")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    shape, _, _, _, loss = WORKLOADS[args.workload]
    vocab = model_shape(shape).vocab_size
    batches = [seqs(g, args.group_size, args.workload, vocab) for _ in range(7)]
    res = {}
    for name in args.variants.split(","):
        backend, graphs = VARIANTS[name.removesuffix("_whole")]
        model = build_model(model_shape(shape), "cuda", torch.float32, seed=0)
        invariant = name.startswith("bi_")
        if invariant:
            make_batch_invariant_(model)
        if backend != "none":
            cc = CompileConfig(backend=backend)
            setup_compile_cache(cc)
            compile_blocks(model, cc)
        tcfg = TrainerConfig(lr=1e-6, micro_batch_tokens=16384, compute_dtype="bfloat16" if invariant else "auto",
                             share_prompts=not name.endswith("_whole"), loss=LossConfig(kind=loss))
        tr = Trainer(model, tcfg, total_steps=100, attn_backend="flash", cuda_graphs=graphs)
        ts = timed(tr, batches)
        res[name] = {"median_s": statistics.median(ts[2:]), "steps_s": ts,
                     "graphs": None if tr.graphs is None else len(tr.graphs.graphs)}
        print(name, "step times", [round(t, 3) for t in ts], flush=True)
        if name in args.profile.split(","):
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            with profile(activities=acts, record_shapes=args.shapes > 0) as prof:
                tr.step(batches[0])
                torch.cuda.synchronize()
            print(f"profile of one {name} step:")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))
            print(kernel_classes(prof))
            if args.shapes:
                print(f"ATen ops of one {name} step by self CUDA time, by input shapes:")
                print(prof.key_averages(group_by_input_shape=True).table(
                    sort_by="self_cuda_time_total", row_limit=args.shapes, max_name_column_width=40,
                    max_shapes_column_width=90))
        params = sum(p.numel() for p in model.parameters())
        cfg = model.config
        del tr, model
        torch.cuda.empty_cache()
    tokens = sum(len(s) for s in batches[0])
    fl = floor_s(cfg, params, batches[0], args.group_size, args.flops, args.bandwidth)
    floor = fl["floor_s"]
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "workload": args.workload,
                                          "tokens": tokens, "floor": fl, "results": res}, indent=2))
    print(f"floor: {fl['unique_tokens']} unique tokens, {fl['flops'] / 1e12:.2f} TFLOP -> "
          f"{fl['compute_s'] * 1e3:.2f} ms at {args.flops / 1e12:.0f} TFLOP/s; {fl['bytes'] / 1e9:.2f} GB -> "
          f"{fl['memory_s'] * 1e3:.2f} ms at {args.bandwidth / 1e12:.1f} TB/s")
    print(f"\n| trainer step ({tokens} tokens) | median s | vs floor {floor:.4f}s |\n|---|---|---|")
    for name, r in res.items():
        print(f"| {name} | {r['median_s']:.3f} | {r['median_s'] / floor:.1f}x |")


if __name__ == "__main__":
    main()
