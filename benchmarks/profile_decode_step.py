"""Where a decode step of the reference batch goes, kernel by kernel (`bench_generate.py`'s batch: Qwen3-0.6B shapes,
random bf16 weights, 5 prompts x 8 samples, temperature 0.8, top-p 0.95, EOS ignored).

With programmatic dependent launch (PDL) a kernel starts while the one before it runs and waits inside, so the
profiler's kernel times overlap and cannot be added up (benchmarks/RESULTS.md, 2026-11-24). This script first times
the decode step as the generator runs it (CUDA graphs, PDL on), then turns PDL off (`monorl.ops._pdl_capable`) and
profiles eager decode steps: each kernel's time is then its own. Kernels are grouped by name and, where a name runs
a multiple of the layer count a step, by its place in the layer ("_mm_kernel[1]": the layer's second). The table
says what a step would save if a group took no time, so its rows rank what is worth fusing or speeding up.

  python benchmarks/profile_decode_step.py [--mode default,invariant] --out profile_decode_step.json
  python benchmarks/profile_decode_step.py --mode default --prompts 128 --samples 1 --prompt-len 560 --top-p 1
      # a throughput-like step (bench_throughput.py's rows: distinct prompts, temperature alone)
  python benchmarks/profile_decode_step.py --sweep sampler.chunk=4096,8192 --repeat 2
      # the graphed step only, for each value of a kernel tunable (ops/tunables.py) or a module constant
      # (pkg.mod.NAME) in turns (each value its own generator)
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import importlib
import json
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import monorl.ops
from monorl.generate import Generator, GeneratorConfig, SamplingParams
from monorl.model import build_model, model_shape
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.ops import tunables

NEW = 100
SAMPLES = 8  # a prompt's samples (--samples): they share its KV blocks
TOP_P = 0.95  # --top-p


def reference_batch(prompts: int = 5, prompt_len: int = 110) -> tuple[list[list[int]], SamplingParams]:
    """bench_generate.py's prompts by default (5 of 105-115 tokens; 8 samples each)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(prompt_len - 5, prompt_len + 6, (prompts,), generator=g).tolist()
    ids = [torch.randint(0, 151643, (n,), generator=g).tolist() for n in lengths]
    return ids, SamplingParams(max_new_tokens=NEW, temperature=0.8, top_p=TOP_P, ignore_eos=True, seed=0)


def batch_s(gen: Generator, prompts: list[list[int]], sp: SamplingParams, runs: int = 7) -> float:
    out = []
    for _ in range(runs):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        gen.generate(prompts, sp, n=SAMPLES)
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return statistics.median(out)


def decode_step_ms(gen: Generator, prompts: list[list[int]], sp: SamplingParams) -> float:
    """bench_generate's measure: (batch - the batch with one new token) / (new tokens - 1)."""
    one = SamplingParams(**{**sp.__dict__, "max_new_tokens": 1})
    return (batch_s(gen, prompts, sp) - batch_s(gen, prompts, one)) / (NEW - 1) * 1e3


def step_kernels(gen: Generator, prompts: list[list[int]], sp: SamplingParams, steps: int) -> list[list[tuple]]:
    """(name, us) of each kernel of `steps` eager decode steps without PDL, in launch order, a list per step."""
    gen.runner.use_graphs = False
    params = SamplingParams(**{**sp.__dict__, "max_new_tokens": steps + 2})
    gen.generate(prompts, params, n=SAMPLES)  # the eager path's kernels compiled
    prefill, rounds = gen.runner.prefill, []

    def counted(*a, **k):  # each prefill round is followed by one sampler call (its first tokens)
        rounds.append(1)
        return prefill(*a, **k)

    gen.runner.prefill = counted
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gen.generate(prompts, params, n=SAMPLES)
    gen.runner.prefill = prefill
    gen.runner.use_graphs = True
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0),
                     key=lambda e: e.time_range.start)
    names = [e.name for e in kernels]
    out, cur = [], []
    if any("_step_inputs_kernel" in n for n in names):  # a decode step starts with its bookkeeping kernel
        for e in kernels:
            if "_step_inputs_kernel" in e.name and cur:
                out.append(cur)
                cur = []
            cur.append((e.name, e.device_time))
        return out[1:1 + steps]  # out[0]: the prefills and the first step's sampling before it
    # (a tree before that kernel) a sampler call ends with its combine kernel; the decode steps' calls come after
    # the prefill rounds' ones
    for e in kernels:
        cur.append((e.name, e.device_time))
        if "_sample_combine_kernel" in e.name:
            out.append(cur)
            cur = []
    return out[len(rounds):len(rounds) + steps]


def group(step: list[tuple], layers: int) -> dict[str, list[float]]:
    """[us, launches] a step by kernel group (see the module docstring)."""
    counts = collections.Counter(n for n, _ in step)
    seen: collections.Counter = collections.Counter()
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for name, t in step:
        short = name if len(name) < 60 else name[:57] + "..."
        per_layer = counts[name] // layers if counts[name] % layers == 0 else 0
        key = f"{short}[{seen[name] % per_layer}]" if per_layer > 1 else short
        seen[name] += 1
        out[key][0] += t
        out[key][1] += 1
    return out


def run_mode(mode: str, steps: int, prompts: int = 5, prompt_len: int = 110, profile_steps: bool = True) -> dict:
    cfg = model_shape("qwen3-0.6b")
    prompts, sp = reference_batch(prompts, prompt_len)
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
    gen = Generator(model, GeneratorConfig(max_num_seqs=SAMPLES * len(prompts), max_model_len=prompt_len + NEW + 16))
    del model
    if mode == "invariant":
        make_batch_invariant_(gen.model)
    gen.generate(prompts, sp, n=SAMPLES)  # compile + capture
    graphed = decode_step_ms(gen, prompts, sp)
    if not profile_steps:
        return dict(mode=mode, graphed_decode_step_ms=graphed)
    capable = monorl.ops._pdl_capable
    monorl.ops._pdl_capable = lambda index: False
    try:
        per_step = step_kernels(gen, prompts, sp, steps)
    finally:
        monorl.ops._pdl_capable = capable
    groups = [group(s, cfg.num_layers) for s in per_step]
    rows = [dict(kernel=k, launches=n, us_step=statistics.median(g[k][0] if k in g else 0.0 for g in groups))
            for k, (_, n) in groups[0].items()]
    rows.sort(key=lambda r: -r["us_step"])
    total = sum(r["us_step"] for r in rows)
    return dict(mode=mode, graphed_decode_step_ms=graphed, kernels_per_step=len(per_step[0]),
                kernel_us_sum_no_pdl=total, rows=rows)


def main() -> None:
    global SAMPLES, TOP_P
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="default,invariant")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=5, help="prompts of --samples each (rows = samples x prompts)")
    ap.add_argument("--samples", type=int, default=SAMPLES)
    ap.add_argument("--top-p", type=float, default=TOP_P, help="1: temperature alone, as bench_throughput.py")
    ap.add_argument("--prompt-len", type=int, default=110, help="tokens a prompt, +-5")
    ap.add_argument("--out", default="profile_decode_step.json")
    ap.add_argument("--sweep", default="", help="TUNABLE=V1,V2,... or MODULE.NAME=V1,V2,...: the graphed step for "
                    "each value in turns")
    ap.add_argument("--repeat", type=int, default=2, help="rounds of --sweep")
    ap.add_argument("--variants", default="", help="'M.A=1;M.B=2|M.A=3;M.B=4': like --sweep, each variant setting "
                    "several module constants (an empty variant: the constants as they are)")
    args = ap.parse_args()
    SAMPLES, TOP_P = args.samples, args.top_p
    if args.sweep or args.variants:
        sweep(args)
        return
    res = [run_mode(m, args.steps, args.prompts, args.prompt_len) for m in args.mode.split(",")]
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, modes=res), f, indent=1)
    for r in res:
        print(f"\n== {r['mode']} ({torch.cuda.get_device_name()}): decode step {r['graphed_decode_step_ms']:.3f} ms "
              f"(CUDA graph, PDL); {r['kernels_per_step']} kernels a step, {r['kernel_us_sum_no_pdl']:.0f} us summed "
              f"without PDL ==")
        print("| kernel | launches a step | us a step | us a launch |")
        print("|---|---|---|---|")
        for row in r["rows"][:24]:
            print(f"| {row['kernel']} | {row['launches']} | {row['us_step']:.1f} | "
                  f"{row['us_step'] / max(1, row['launches']):.2f} |")


def parse_assignments(text: str) -> list[tuple[object, str, object]]:
    """'NAME=V;...' -> [(module, NAME, V)]: a kernel tunable (ops/tunables.py, module None) or pkg.mod.NAME (V a
    Python literal where it reads as one: 4096, (64, 64, 128, 4, 4), else the string)."""
    out = []
    for item in filter(None, text.split(";")):
        target, v = item.split("=")
        try:
            value = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            value = v
        if target in tunables.TABLE[tunables.HOPPER]:
            out.append((None, target, value))
        else:
            out.append((importlib.import_module(target.rsplit(".", 1)[0]), target.rsplit(".", 1)[1], value))
    return out


def sweep(args: argparse.Namespace) -> None:
    """The graphed decode step (no profile) for each value of one module constant (--sweep) or each variant
    (--variants), in turns."""
    if args.sweep:
        target, values = args.sweep.split("=")
        variants = [f"{target}={v}" for v in values.split(",")]
    else:
        variants = args.variants.split("|")
    sets = [parse_assignments(v) for v in variants]
    defaults = {(id(m), n): (m, n, getattr(m, n)) for s in sets for m, n, _ in s if m is not None}
    res: dict = collections.defaultdict(list)
    for _ in range(args.repeat):
        for assigns in sets:
            for m, n, v in defaults.values():
                setattr(m, n, v)
            for m, n, v in assigns:
                if m is not None:
                    setattr(m, n, v)
            tuned = {n: v for m, n, v in assigns if m is None}
            label = ";".join(f"{n}={v}" for _, n, v in assigns) or "as is"
            with tunables.overridden(tuned) if tuned else contextlib.nullcontext():
                for m in args.mode.split(","):
                    r = run_mode(m, args.steps, args.prompts, args.prompt_len, profile_steps=False)
                    res[f"{m} {label}"].append(r["graphed_decode_step_ms"])
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, sweep=res), f, indent=1)
    print(f"\n== {torch.cuda.get_device_name()}: graphed decode step (ms), {args.repeat} rounds in turns ==")
    print("| mode, value | ms |")
    print("|---|---|")
    for k, ts in res.items():
        print(f"| {k} | {', '.join(f'{t:.3f}' for t in ts)} |")


if __name__ == "__main__":
    main()
