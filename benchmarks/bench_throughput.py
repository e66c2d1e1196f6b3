"""Generator throughput (nano-vllm's bench): 256 requests, prompt and output lengths uniform in
100..1024, random prompt tokens, temperature 0.6, EOS ignored; Qwen3-0.6B shapes, random init, bf16.
Reports output tokens / s. Writes JSON to --out and prints a table.

  --profile: programmatic dependent launch off (each kernel's time its own), the timed run, then a second run under
  the profiler: GPU time by kernel name, split into the prefills' kernels and the decode steps'."""

from __future__ import annotations

import argparse
import bisect
import json
import time

import torch

from monorl.compile import CompileConfig
from monorl.generate import Generator, GeneratorConfig, SamplingParams
from monorl.model import build_model, model_shape


def time_the_parts(runner) -> dict:
    """Wrap the runner's prefill (synchronised, timed) and decode (counted) in place; the returned dict fills as
    the generator runs."""
    split = {"prefills": 0, "prefill_s": 0.0, "prefill_ms": [], "decode_steps": 0, "decode_rows": 0, "ring_reads": 0,
             "host_gap_s": 0.0}
    prefill, decode, read_ring, copy_ring = runner.prefill, runner.decode, runner.read_ring, runner.copy_ring
    read_at: list[float] = []  # when the last ring read returned (the GPU idle until the next decode launch)

    def timed_prefill(*a, **k):
        read_at.clear()
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = prefill(*a, **k)
        torch.cuda.synchronize()
        split["prefills"] += 1
        split["prefill_s"] += time.perf_counter() - t
        split["prefill_ms"].append(round((time.perf_counter() - t) * 1e3, 1))
        return out

    def counted_decode(live, *a, **k):
        if read_at:  # the host's work between a ring read (a sync) and the next step: the GPU has nothing queued
            split["host_gap_s"] += time.perf_counter() - read_at.pop()
        split["decode_steps"] += 1
        split["decode_rows"] += live
        return decode(live, *a, **k)

    def timed_read(*a, **k):  # a read that waits (counted by the copy it makes)
        out = read_ring(*a, **k)
        read_at[:] = [time.perf_counter()]
        return out

    def counted_copy(*a, **k):  # every read; alone, a deferred one (no stops): the GPU runs on, nothing to time
        split["ring_reads"] += 1
        return copy_ring(*a, **k)

    runner.prefill, runner.decode, runner.read_ring = timed_prefill, counted_decode, timed_read
    runner.copy_ring = counted_copy
    return split


def kernel_split(gen, prompts, sps, split: dict) -> dict:
    """One more run of the workload under the profiler: each kernel's time, grouped by name, in the prefills (their
    synchronised host ranges) or the decode steps."""
    from torch.profiler import ProfilerActivity, profile, record_function

    prefill = gen.runner.prefill

    def marked(*a, **k):
        with record_function("prefill"):
            return prefill(*a, **k)

    steps0 = split["decode_steps"]
    gen.runner.prefill = marked
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        gen.generate(prompts, sps)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    gen.runner.prefill = prefill
    events = prof.events()
    ranges = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == "prefill")
    starts = [r[0] for r in ranges]
    groups: dict = {"prefill": {}, "decode": {}}
    for e in events:
        if e.device_type.name != "CUDA" or e.device_time <= 0:
            continue
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        phase = "prefill" if i >= 0 and e.time_range.start <= ranges[i][1] else "decode"
        name = e.name if len(e.name) <= 70 else e.name[:67] + "..."
        g = groups[phase].setdefault(name, [0.0, 0])
        g[0] += e.device_time / 1e3
        g[1] += 1
    steps = split["decode_steps"] - steps0
    return dict(wall_s=wall, decode_steps=steps, prefill_host_s=sum(b - a for a, b in ranges) / 1e6,
                **{p: sorted(([n, ms, c] for n, (ms, c) in g.items()), key=lambda r: -r[1]) for p, g in groups.items()})


def print_split(prof: dict) -> None:
    steps = max(1, prof["decode_steps"])
    for phase in ("decode", "prefill"):
        rows = prof[phase]
        total = sum(r[1] for r in rows)
        print(f"\n-- {phase}: kernels {total:.0f} ms" + (f", {total / steps * 1e3:.0f} us a step ({steps} steps)"
                                                       if phase == "decode" else
                                                       f" (prefill host ranges {prof['prefill_host_s']:.2f} s)"))
        print(f"{'kernel':72s} {'ms':>8s} {'launches':>9s} {'us/step':>8s}")
        for name, ms, n in rows[:22]:
            print(f"{name:72s} {ms:8.1f} {n:9d} {ms / steps * 1e3 if phase == 'decode' else 0:8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default="bench_throughput.json")
    ap.add_argument("--profile", action="store_true", help="PDL off; then a profiled run, kernels by phase")
    ap.add_argument("--set", default="", help="'pkg.mod.NAME=V;...': module constants set first (a variant)")
    args = ap.parse_args()
    from profile_decode_step import parse_assignments
    for module, name, value in parse_assignments(args.set):
        setattr(module, name, value)
    if args.profile:
        import monorl.ops
        monorl.ops._pdl_capable = lambda index: False

    cfg = model_shape(args.shape)
    g = torch.Generator().manual_seed(0)
    N = args.requests
    plens = torch.randint(100, 1025, (N,), generator=g).tolist()
    olens = torch.randint(100, 1025, (N,), generator=g).tolist()
    prompts = [torch.randint(0, 10000, (n,), generator=g).tolist() for n in plens]
    sps = [SamplingParams(max_new_tokens=o, temperature=0.6, ignore_eos=True, seed=0) for o in olens]

    model = build_model(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
    free, _ = torch.cuda.mem_get_info()
    t0 = time.perf_counter()
    gen = Generator(model, GeneratorConfig(max_num_seqs=args.max_num_seqs, max_model_len=2048,
                                           kv_cache_bytes=int(free * 0.6)),
                    compile=CompileConfig(backend="none" if args.no_compile else "inductor"))
    del model  # the generator runs its own copy
    gen.generate([prompts[0][:100]] * 2, SamplingParams(max_new_tokens=32, temperature=0.6, ignore_eos=True))
    gen.capture_decode_graphs(sps[0])  # every batch bucket up front, as nano-vllm does (lazily: ~3 s in the run)
    torch.cuda.synchronize()
    startup = time.perf_counter() - t0
    split = time_the_parts(gen.runner)
    t0 = time.perf_counter()
    out = gen.generate(prompts, sps)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    first_prefills = list(split["prefill_ms"])
    ntok = sum(len(c[0].token_ids) for c in out)
    assert ntok == sum(olens)
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shape=args.shape, requests=N, set=args.set,
               max_num_seqs=args.max_num_seqs, kv_blocks=gen.kv.num_blocks, prompt_tokens=sum(plens),
               output_tokens=ntok, seconds=dt, output_tok_per_s=ntok / dt, startup_s=startup, **split)
    if args.profile:
        res["profile"] = kernel_split(gen, prompts, sps, split)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n== throughput ({res['device']}, {args.shape}, {N} requests, max_num_seqs {args.max_num_seqs}"
          f"{', ' + args.set if args.set else ''}) ==")
    print(f"startup (compile + capture)  {startup:8.2f} s")
    print(f"prompt tokens / output tokens {sum(plens)} / {ntok}")
    print(f"time {dt:.2f} s -> {ntok / dt:,.0f} output tok/s")
    rest = dt - split["prefill_s"]
    print(f"prefills {split['prefills']} in {split['prefill_s']:.2f} s (synchronised); decode steps "
          f"{split['decode_steps']} (mean {split['decode_rows'] / max(1, split['decode_steps']):.0f} rows) and the "
          f"rest {rest:.2f} s -> {rest / max(1, split['decode_steps']) * 1e3:.2f} ms a step")
    print(f"each prefill (ms): {first_prefills}")
    print(f"ring reads (host syncs) {split['ring_reads']}; host work between a read and the next step (the GPU "
          f"idle) {split['host_gap_s']:.2f} s")
    if args.profile:
        print(f"(PDL off) profiled run {res['profile']['wall_s']:.2f} s")
        print_split(res["profile"])


if __name__ == "__main__":
    main()
