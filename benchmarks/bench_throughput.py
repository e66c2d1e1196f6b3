"""Generator throughput (nano-vllm's bench): 256 requests, prompt and output lengths uniform in
100..1024, random prompt tokens, temperature 0.6, EOS ignored; Qwen3-0.6B shapes, random init, bf16.
Reports output tokens / s. Writes JSON to --out and prints a table."""

from __future__ import annotations

import argparse
import json
import time

import torch

from monorl.compile import CompileConfig
from monorl.generate import Generator, GeneratorConfig, SamplingParams
from monorl.model import build_model, model_shape


def time_the_parts(runner) -> dict:
    """Wrap the runner's prefill (synchronised, timed) and decode (counted) in place; the returned dict fills as
    the generator runs."""
    split = {"prefills": 0, "prefill_s": 0.0, "decode_steps": 0, "decode_rows": 0, "ring_reads": 0, "host_gap_s": 0.0}
    prefill, decode, read_ring = runner.prefill, runner.decode, runner.read_ring
    read_at: list[float] = []  # when the last ring read returned (the GPU idle until the next decode launch)

    def timed_prefill(*a, **k):
        read_at.clear()
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = prefill(*a, **k)
        torch.cuda.synchronize()
        split["prefills"] += 1
        split["prefill_s"] += time.perf_counter() - t
        return out

    def counted_decode(live, *a, **k):
        if read_at:  # the host's work between a ring read (a sync) and the next step: the GPU has nothing queued
            split["host_gap_s"] += time.perf_counter() - read_at.pop()
        split["decode_steps"] += 1
        split["decode_rows"] += live
        return decode(live, *a, **k)

    def timed_read(*a, **k):
        out = read_ring(*a, **k)
        split["ring_reads"] += 1
        read_at[:] = [time.perf_counter()]
        return out

    runner.prefill, runner.decode, runner.read_ring = timed_prefill, counted_decode, timed_read
    return split


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default="bench_throughput.json")
    args = ap.parse_args()

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
    ntok = sum(len(c[0].token_ids) for c in out)
    assert ntok == sum(olens)
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shape=args.shape, requests=N,
               max_num_seqs=args.max_num_seqs, kv_blocks=gen.kv.num_blocks, prompt_tokens=sum(plens),
               output_tokens=ntok, seconds=dt, output_tok_per_s=ntok / dt, startup_s=startup, **split)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n== throughput ({res['device']}, {args.shape}, {N} requests, max_num_seqs {args.max_num_seqs}) ==")
    print(f"startup (compile + capture)  {startup:8.2f} s")
    print(f"prompt tokens / output tokens {sum(plens)} / {ntok}")
    print(f"time {dt:.2f} s -> {ntok / dt:,.0f} output tok/s")
    rest = dt - split["prefill_s"]
    print(f"prefills {split['prefills']} in {split['prefill_s']:.2f} s (synchronised); decode steps "
          f"{split['decode_steps']} (mean {split['decode_rows'] / max(1, split['decode_steps']):.0f} rows) and the "
          f"rest {rest:.2f} s -> {rest / max(1, split['decode_steps']) * 1e3:.2f} ms a step")
    print(f"ring reads (host syncs) {split['ring_reads']}; host work between a read and the next step (the GPU "
          f"idle) {split['host_gap_s']:.2f} s")


if __name__ == "__main__":
    main()
