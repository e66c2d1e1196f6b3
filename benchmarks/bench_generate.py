"""Reference batch: Qwen3-0.6B shapes (random init, bf16), 5 prompts x 8 samples, prompts ~110 tokens,
100 new tokens, temperature 0.8, top_p 0.95, EOS ignored. Reports median seconds per batch, ms per decode
step, the fraction of the bandwidth floor reached, and (with --hf) HF transformers' `generate` with a
static cache + compile on the same batch. Writes JSON to --out and prints a table.

--variants compares generator configurations in one process: "graphs" (the default: CUDA graphs and the fused
Triton kernels, `GeneratorConfig.fused_kernels`), "graphs_eager_ops" (the model's eager ops and the PyTorch sampler)
and "compiled_eager_ops" (those compiled by Inductor; a copy on the fused kernels is never compiled)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from monorl.compile import CompileConfig
from monorl.generate import Generator, GeneratorConfig, SamplingParams
from monorl.generate.cache import bytes_per_block
from monorl.model import build_model, model_shape


def timed(fn, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def copy_bandwidth() -> float:
    """Measured device copy bandwidth (bytes read + written per second)."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    t = statistics.median(timed(lambda: y.copy_(x), 10))
    return 2 * x.numel() / t


VARIANTS = {  # name: (compile backend, fused kernels); a copy on the kernels is never compiled (compile_generator)
    "compiled_eager_ops": ("inductor", False),
    "graphs": ("none", True),
    "graphs_eager_ops": ("none", False),
}


def run_variant(name: str, cfg, prompts: list[list[int]], sp: SamplingParams, n: int, runs: int,
                profile: bool) -> dict:
    """One generator configuration on the reference batch: startup, median batch time, decode step."""
    backend, kernels = VARIANTS[name]
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gen = Generator(model, GeneratorConfig(max_num_seqs=len(prompts) * n, max_model_len=512, fused_kernels=kernels),
                    compile=CompileConfig(backend=backend))
    del model  # the generator runs its own copy
    gen.generate(prompts, sp, n=n)  # compile + graph capture + first batch
    torch.cuda.synchronize()
    startup = time.perf_counter() - t0
    batch = timed(lambda: gen.generate(prompts, sp, n=n), runs)
    one = timed(lambda: gen.generate(prompts, SamplingParams(**{**sp.__dict__, "max_new_tokens": 1}), n=n), runs)
    med, med1 = statistics.median(batch), statistics.median(one)
    new = sp.max_new_tokens
    res = dict(variant=name, compile=backend, fused_kernels=kernels, startup_s=startup, batch_s_median=med,
               batch_s_all=batch, prefill_plus_first_token_s=med1, decode_step_ms=(med - med1) / (new - 1) * 1e3)
    if profile:  # kernels of a few eager decode steps (same kernels as the graph, plus launch gaps)
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        gen.runner.use_graphs = False
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            gen.generate(prompts, SamplingParams(**{**sp.__dict__, "max_new_tokens": 6}), n=n)
        gen.runner.use_graphs = True
        ev = prof.key_averages()
        res["eager_6_steps_kernels"] = int(sum(e.count for e in ev if e.device_type.name == "CUDA"))
        print(f"-- {name}: kernels of a batch with 6 new tokens, eager --")
        print(ev.table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--hf", action="store_true", help="also time HF generate (static cache + compile)")
    ap.add_argument("--variants", default="graphs", help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--profile", action="store_true", help="print the top kernels of a few eager decode steps")
    ap.add_argument("--out", default="bench_generate.json")
    args = ap.parse_args()
    variants = args.variants.split(",")

    cfg = model_shape(args.shape)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(105, 116, (5,), generator=g).tolist()
    prompts = [torch.randint(0, 151643, (n,), generator=g).tolist() for n in lengths]
    n, new = 8, 100
    sp = SamplingParams(max_new_tokens=new, temperature=0.8, top_p=0.95, ignore_eos=True, seed=0)
    rows = []
    for v in variants:
        rows.append(run_variant(v, cfg, prompts, sp, n, args.runs, args.profile))
        torch.cuda.empty_cache()  # the variant's generator is gone: its KV cache back for the next

    bw = copy_bandwidth()
    weight_bytes = sum(p.numel() * 2 for p in build_model(cfg, device="meta", seed=None).parameters())  # bf16
    kv_tok = bytes_per_block(cfg, 1, torch.bfloat16)
    floor = sum(weight_bytes + n * sum(L + t for L in lengths) * kv_tok for t in range(new)) / bw
    for r in rows:
        r["floor_fraction"] = floor / r["batch_s_median"]
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shape=args.shape,
               prompts=len(prompts), n=n, prompt_lens=lengths, new_tokens=new, copy_bandwidth_TBps=bw / 1e12,
               floor_s=floor, variants=rows)

    if args.hf:
        import transformers

        hcfg = transformers.Qwen3Config(**cfg.to_hf())
        with torch.device("cuda"):
            hf = transformers.Qwen3ForCausalLM(hcfg).to(torch.bfloat16).eval()
        seqs = [p for p in prompts for _ in range(n)]
        T = max(lengths)
        ids = torch.zeros(len(seqs), T, dtype=torch.long)
        mask = torch.zeros(len(seqs), T, dtype=torch.long)
        for i, p in enumerate(seqs):  # left padding
            ids[i, T - len(p):] = torch.tensor(p)
            mask[i, T - len(p):] = 1
        ids, mask = ids.cuda(), mask.cuda()

        def hf_gen():
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=mask, do_sample=True, temperature=0.8, top_p=0.95, top_k=0,
                                  max_new_tokens=new, min_new_tokens=new, cache_implementation="static",
                                  pad_token_id=0)
            assert out.shape[1] == T + new

        t0 = time.perf_counter()
        hf_gen()
        torch.cuda.synchronize()
        res["hf_first_call_s"] = time.perf_counter() - t0
        hf_runs = timed(hf_gen, 3)
        res.update(hf_batch_s_median=statistics.median(hf_runs), hf_batch_s_all=hf_runs,
                   hf_version=transformers.__version__)

    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n== reference batch ({res['device']}, {args.shape}, {len(prompts)}x{n}, {new} new tokens; "
          f"bandwidth floor {floor * 1e3:.1f} ms at {bw / 1e12:.2f} TB/s copy) ==")
    print("| variant | startup s | batch ms (median) | prefill + 1st token ms | decode step ms | % of floor |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['startup_s']:.2f} | {r['batch_s_median'] * 1e3:.1f} | "
              f"{r['prefill_plus_first_token_s'] * 1e3:.1f} | {r['decode_step_ms']:.3f} | "
              f"{r['floor_fraction']:.0%} |")
    if "hf_batch_s_median" in res:
        print(f"HF generate static+compile        {res['hf_batch_s_median'] * 1e3:8.1f} ms "
              f"(first call {res['hf_first_call_s']:.1f} s)")


if __name__ == "__main__":
    main()
