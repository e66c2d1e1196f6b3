"""Where an FSDP2 trainer step's time goes, against the one-rank step on the same per-rank tokens (#45 item 1).

Run once without torchrun (the one-rank baseline) and once under torchrun (N ranks): every rank trains
--seqs-per-rank rollouts (prompt groups of 8, 110 prompt + 100 completion tokens, random ids) of a randomly
initialised model of --shape, through `Trainer.step` as the RL loop calls it. Per variant: the median step (CUDA
events and host seconds, after --warm steps), peak memory, a digest of the weights after the timed steps (equal
digests across variants: the same update bit for bit), and of one profiled step on rank 0 the GPU's busy time
(union of kernel intervals), NCCL kernel time and compute kernel time.

Variants: bi (batch-invariant mode, eager: the RL loop's default under FSDP before #45), bi_graphs (the mode with
trainer CUDA graphs, FSDP's collectives captured too), bi_static (bi_graphs' computation without graphs), flash
(bf16 autocast, flash varlen, eager), flash_compiled (regional inductor), flash_graphs.

  python benchmarks/profile_fsdp_step.py --variants bi,bi_graphs --out /tmp/fsdp_1.json
  torchrun --nproc_per_node 2 benchmarks/profile_fsdp_step.py --variants bi,bi_graphs --out /tmp/fsdp_2.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path

import torch

from monorl.compile import CompileConfig, compile_blocks, setup_compile_cache
from monorl.distributed.fsdp import shard_model_
from monorl.distributed.world import init_world
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.train.packing import TrainSequence
from monorl.train.trainer import Trainer, TrainerConfig

VARIANTS = {  # name: (batch-invariant, compile backend, trainer CUDA graphs, static packs)
    "bi": (True, "none", False, False), "bi_graphs": (True, "none", True, True),
    # the graphs' computation without graphs: its weights digest must equal bi_graphs'
    "bi_static": (True, "none", False, True), "bi_compiled": (True, "inductor", False, False),
    "flash": (False, "none", False, False), "flash_compiled": (False, "inductor", False, False),
    "flash_graphs": (False, "none", True, True)}


def batch(g: torch.Generator, n: int, vocab: int, group_size: int = 8) -> list[TrainSequence]:
    out = []
    for i in range(n):
        if i % group_size == 0:
            p = torch.randint(0, vocab, (110,), generator=g).tolist()
        c = torch.randint(0, vocab, (100,), generator=g).tolist()
        out.append(TrainSequence(p, c, [-1.0] * 100, advantage=float(i % 3 - 1), group=i // group_size))
    return out


def busy_ms(prof) -> tuple[float, float, float, float]:
    """(window, busy union, NCCL kernel sum, compute kernel sum) in ms of the profiled CUDA kernels."""
    spans, nccl, comp = [], 0.0, 0.0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.time_range.elapsed_us() <= 0:
            continue
        a, b = e.time_range.start, e.time_range.end
        spans.append((a, b))
        if "nccl" in e.name.lower():
            nccl += b - a
        else:
            comp += b - a
    if not spans:
        return 0.0, 0.0, 0.0, 0.0
    spans.sort()
    union, (lo, hi) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > hi:
            union, lo, hi = union + hi - lo, a, b
        else:
            hi = max(hi, b)
    union += hi - lo
    return (spans[-1][1] - spans[0][0]) / 1e3 if spans else 0.0, union / 1e3, nccl / 1e3, comp / 1e3


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        t = p.detach()
        t = getattr(t, "_local_tensor", t)
        h.update(t.float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--seqs-per-rank", type=int, default=16)
    ap.add_argument("--variants", default="bi,bi_graphs")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--profile", default="", help="variants whose one step rank 0 profiles (comma list)")
    ap.add_argument("--rows", type=int, default=0, help="also print this many kernels of each profile")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (host times only)")
    a = ap.parse_args()
    world = init_world(a.device)
    cuda = a.device == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = model_shape(a.shape)
    n = a.seqs_per_rank * world.size
    g = torch.Generator().manual_seed(0)
    batches = [batch(g, n, cfg.vocab_size) for _ in range(a.warm + a.steps)]
    res = {}
    for name in a.variants.split(","):
        bi, backend, graphs, static = VARIANTS[name]
        model = build_model(cfg, dev, torch.float32, seed=0)
        if bi:
            make_batch_invariant_(model)
        if backend != "none":
            cc = CompileConfig(backend=backend)
            setup_compile_cache(cc)
            compile_blocks(model, cc)
        if world.size > 1:
            shard_model_(model, dev)
        tcfg = TrainerConfig(lr=1e-5, micro_batch_tokens=16384, compute_dtype="bfloat16" if bi else "auto")
        tr = Trainer(model, tcfg, total_steps=100, attn_backend="flash" if cuda else "sdpa", cuda_graphs=graphs,
                     static_shapes=static, world=world)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        t_start = time.perf_counter()
        gpu, host, losses = [], [], []
        for i, b in enumerate(batches):
            sync()
            t = time.perf_counter()
            if cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
            losses.append(tr.step(b)["loss"])
            if cuda:
                e.record()
            sync()
            if i >= a.warm:
                host.append(time.perf_counter() - t)
                gpu.append(s.elapsed_time(e) / 1e3 if cuda else host[-1])
        row = {"step_s": statistics.median(gpu), "host_s": statistics.median(host), "steps_s": gpu,
               "first_steps_s": time.perf_counter() - t_start - sum(host),
               "losses": losses, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
               "digest": digest(model),
               "graphs": None if tr.graphs is None else len(tr.graphs.graphs)}
        if name in a.profile.split(","):
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                tr.step(batches[0])
                sync()
            w, busy, nccl, comp = busy_ms(prof)
            row.update(window_ms=w, busy_ms=busy, nccl_ms=nccl, compute_ms=comp)
            if a.rows and world.is_main:
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows,
                                                max_name_column_width=60))
        res[name] = row
        if world.is_main:
            print(name, json.dumps({k: v for k, v in row.items() if k != "steps_s"}), flush=True)
        del tr, model
        if cuda:
            torch.cuda.empty_cache()
    if world.is_main:
        tokens = sum(len(s) for s in batches[0]) // world.size
        print(f"\n| {a.shape} x{world.size}, {a.seqs_per_rank} seqs ({tokens} tokens) per rank | step s | host s | "
              "peak GiB | busy ms | NCCL ms | compute ms | digest |\n|---|---|---|---|---|---|---|---|")
        for name, r in res.items():
            print(f"| {name} | {r['step_s']:.3f} | {r['host_s']:.3f} | {r['peak_gib']:.1f} | "
                  f"{r.get('busy_ms', 0):.0f} | {r.get('nccl_ms', 0):.0f} | {r.get('compute_ms', 0):.0f} | "
                  f"{r['digest']} |")
        if a.out:
            name = torch.cuda.get_device_name() if cuda else "cpu"
            Path(a.out).write_text(json.dumps({"device": name, "world": world.size,
                                               "shape": a.shape, "seqs_per_rank": a.seqs_per_rank,
                                               "results": res}, indent=2) + "\n")


if __name__ == "__main__":
    main()
