"""Where a multi-turn episode's turn boundary goes on the GPU (#42): bench_agentic's kv_reuse on a tool-shaped
workload (64 episodes, a 2048-token prompt, 4 turns of 32 sampled + 64 inserted tokens, Qwen3-0.6B shapes, random
weights), run until its boundaries replay from CUDA graphs; one more run times each `prefill_cached` call (host
return, then synced) and profiles it (the CUDA kernels of the replayed graph, by self time); then the paged attention
kernel alone on the last boundary's layout, 28 launches (a layer each) per tile shape (`attention.cached_rows`,
`attention.cached_warps`).

    python benchmarks/profile_turn_boundary.py [--prompt-tokens 2048] [--turn-prefill paged]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_agentic import kv_reuse, sync, workload  # noqa: E402

from monorl.generate.attention import CachedPrefillContext  # noqa: E402
from monorl.model import model_shape  # noqa: E402
from monorl.ops import tunables  # noqa: E402
from monorl.ops.attention.kernel import cached_attention_triton  # noqa: E402

TILES = ((128, 8), (128, 4), (64, 4), (64, 8), (32, 4), (16, 4))  # (rows, warps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--turn-tokens", type=int, default=32)
    ap.add_argument("--inserted", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-prefill", default="paged")
    a = ap.parse_args()
    cfg = model_shape("qwen3-0.6b")
    gen, prompts, env, sp = workload("qwen3-0.6b", "cuda", a.episodes, a.turns, a.turn_tokens, a.inserted,
                                     a.prompt_tokens)
    for _ in range(4):  # a boundary shape is captured at its third run
        kv_reuse(gen, prompts, env, sp, a.turns, a.turn_prefill)
    runner = gen.runner
    print("turn boundary graphs:", [k for k in runner.prefill_graphs if k[0] == "cached"])
    plain, calls, profs, seen = runner.prefill_cached, [], [], []

    def timed(chunks: list[list[int]], *args: object, **kwargs: object) -> torch.Tensor:
        sync()
        t = time.perf_counter()
        out = plain(chunks, *args, **kwargs)
        host = time.perf_counter() - t
        sync()
        calls.append((host, time.perf_counter() - t))
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            plain(chunks, *args, **kwargs)  # the same call again (its K/V rewritten with the same values)
            sync()
        profs.append(prof)
        seen.append((chunks, args))
        return out

    collections: list[tuple[int, float]] = []  # Python's garbage collections in the run: (generation, seconds)

    def gc_timer(phase: str, info: dict) -> None:
        if phase == "start":
            gc_timer.t = time.perf_counter()
        else:
            collections.append((info["generation"], time.perf_counter() - gc_timer.t))

    runner.prefill_cached = timed
    gc.callbacks.append(gc_timer)
    kv_reuse(gen, prompts, env, sp, a.turns, a.turn_prefill)
    gc.callbacks.remove(gc_timer)
    del runner.prefill_cached
    print("calls (host return ms, synced ms):", [(round(h * 1e3, 1), round(s * 1e3, 1)) for h, s in calls])
    print("garbage collections in that run (generation: count, ms):",
          {g: (sum(1 for x, _ in collections if x == g), round(sum(t for x, t in collections if x == g) * 1e3, 1))
           for g in sorted({x for x, _ in collections})})
    print(profs[-1].key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=70))
    chunks, (starts, tables, *_) = seen[-1]
    ctx = CachedPrefillContext.build(chunks, starts, tables, runner.block_size, runner.device, "paged")
    T, keys = ctx.positions.numel(), int(ctx.cu_seqlens_k[-1])
    q = torch.randn(T, cfg.num_heads, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = gen.cache.layers[0][0], gen.cache.layers[0][1]
    read = keys * cfg.num_kv_heads * cfg.head_dim * 2 * 2  # K and V, bf16, once
    print(f"T {T}, keys {keys}: K+V read once {read / 1e6:.0f} MB a layer")
    for rows, warps in TILES:
        with tunables.overridden({"attention.cached_rows": rows, "attention.cached_warps": warps}):
            def launch() -> None:
                cached_attention_triton(q, k_cache, v_cache, ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.block_tables,
                                        max(len(c) for c in chunks))
            for _ in range(3):
                launch()
            sync()
            t = time.perf_counter()
            for _ in range(cfg.num_layers):
                launch()
            sync()
            dt = (time.perf_counter() - t) / cfg.num_layers
        print(f"rows {rows:>3} warps {warps}: {dt * 1e6:8.1f} us a layer ({read / dt / 1e9:.0f} GB/s reading K+V once)")


if __name__ == "__main__":
    main()
