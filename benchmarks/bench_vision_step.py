"""The RL step of a vision-language model with one image per prompt against the same language model without its
tower at equal text lengths (#59: the target is the VL step within 1.3x of the text-only one). Qwen3-VL-2B's shapes
(`qwen3-vl-2b`, random init; the text-only case is that shape with `vision=None`), one GPU, a W0-like batch: 5
prompts x 8 samples, 105-115 random text tokens per prompt (the VL prompt: the same tokens with one image's
<|vision_start|><|image_pad|><|vision_end|> after the first 3, where a chat template puts it), 100 new tokens,
EOS ignored, temperature 0.8, top_p 0.95; then one trainer step (GRPO, the run's default TrainerConfig otherwise:
eager -- with --trainer-graphs each micro-batch replays a trainer CUDA graph, as the presets'
`--compile.trainer_cuda_graphs true` does, packs with images included --, shared prompts, bf16 autocast over fp32
masters) on those 40 rollouts, then the generator's weight sync.
The VL case twice: the tower trained (the run's default) and frozen (`--model.freeze_vision true`: no tower
backward, gradients or AdamW state).

As a colocated run does it, but built directly (a random-init 2B shape has no tokenizer whose image tokens it
matches, so no task and no `generate_rollouts`): one fp32 policy the trainer steps, the generator's bf16 copy (its
defaults: decode CUDA graphs, fused kernels, no compile), the image processor the run makes for a named shape
(`monorl.model.source.image_processor`: Qwen3-VL's preprocessor bounds with the tower's patch sizes; a 448 x 448
image is 28 x 28 patches, 196 image tokens), synthetic pictures drawn at run time (`count_squares.draw_squares`).
"generate" starts from prompts encoded during the previous step's training (in the trainer step's after_update,
before its host sync, where a run's `RolloutProducer.encode_ahead` runs: the images' PIL resize and patches), so
"train" holds that host work where the GPU's training kernels do not cover it; the 1-token batches are encoded
before their timing too.

Times with CUDA events: generate, train and sync each, median of --steps after --warmup steps, and the peak memory
allocated during each phase. Decode tokens/s: 40 rows over the decode step, (batch time - the batch's time with 1
new token) / 99, medians (bench_generate.py's split). Prints one table, writes --out.

  python benchmarks/bench_vision_step.py --out vision_step.json     # one H100: ~1-2 min
  python benchmarks/bench_vision_step.py --trainer-graphs --out vision_step_graphs.json
  python benchmarks/bench_vision_step.py --smoke                    # CPU, tiny-vl against tiny, < 1 min
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from monorl.generate import Generator, GeneratorConfig, SamplingParams
from monorl.model.attention import resolve_backend
from monorl.model.config import ModelConfig, model_shape
from monorl.model.decoder import build_model
from monorl.model.qwen3_vl import freeze_vision_
from monorl.model.section import ModelSection
from monorl.model.source import image_processor
from monorl.model.vision_prompt import encode_with_images
from monorl.tasks.count_squares import draw_squares
from monorl.train.losses import LossConfig
from monorl.train.packing import TrainSequence
from monorl.train.trainer import Trainer, TrainerConfig

GiB = 1 << 30
FIRST_SPECIAL = 151643  # Qwen's <|endoftext|>: random text tokens stay below the special ids


def timed_call(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """(seconds, fn()): CUDA events around fn on CUDA (host gaps between its kernels included), else wall time."""
    if device.type != "cuda":
        t = time.perf_counter()
        out = fn()
        return time.perf_counter() - t, out
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    out = fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3, out


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / GiB if device.type == "cuda" else None


def make_prompts(vl: ModelConfig, prompts: int, image_size: int) -> tuple[list[list[int]], list[list[int]], list]:
    """(text-only prompts, the same prompts with an image's placeholder, one picture per prompt)."""
    v = vl.vision
    assert v is not None
    top = min(vl.vocab_size, FIRST_SPECIAL, v.vision_start_token_id, v.image_token_id, v.vision_end_token_id,
              v.video_token_id)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(105, 116, (prompts,), generator=g).tolist()
    text = [torch.randint(0, top, (n,), generator=g).tolist() for n in lengths]
    marked = [t[:3] + [v.vision_start_token_id, v.image_token_id, v.vision_end_token_id] + t[3:] for t in text]
    count = [k % 4 + 1 for k in range(prompts)]  # 1-4 squares on a 2 x 2 grid of image_size / 2 pixel cells
    pictures = [draw_squares(tuple(range(c)), tuple(range(c)), 2, image_size // 2) for c in count]
    return text, marked, pictures


def run_case(cfg: ModelConfig, shape: str, prompts: list[list[int]], pictures: list | None, args: Any,
             device: torch.device, max_len: int, freeze: bool = False) -> dict:
    """RL steps (generate, train, sync) of `cfg` on `prompts` (with `pictures`, one per prompt, when given), then
    the batch with 1 new token for the decode split. freeze: the tower frozen (`--model.freeze_vision true`)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    processor = image_processor(ModelSection(shape=shape), cfg) if pictures is not None else None
    model = build_model(cfg, device, torch.float32, seed=0)  # the trainer's fp32 masters
    if freeze:
        freeze_vision_(model)
    gen = Generator(model, GeneratorConfig(max_num_seqs=len(prompts) * args.n, max_model_len=max_len))
    backend = resolve_backend("auto", device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    trainer = Trainer(model, TrainerConfig(lr=1e-6, loss=LossConfig(kind="grpo"),
                                           micro_batch_tokens=args.micro_batch_tokens), total_steps=100,
                      attn_backend=backend, cuda_graphs=args.trainer_graphs)

    def encode() -> tuple[list[list[int]], list | None]:
        if pictures is None:
            return prompts, None
        pairs = [encode_with_images(p, [im], cfg.vision, processor) for p, im in zip(prompts, pictures, strict=True)]
        return [ids for ids, _ in pairs], [im for _, im in pairs]

    ahead: list = []  # the next step's encoded prompts, made while the GPU trains (as a run's encode_ahead does)

    def generate(sp: SamplingParams) -> tuple[list[list[int]], list | None, list]:
        ids, images = ahead.pop() if ahead else encode()
        return ids, images, gen.generate(ids, sp, n=args.n, images=images)

    def encode_next() -> None:  # a 1-token batch's prompts encoded before its timing, as the steps' batches are
        ahead[:] = [] if args.no_ahead else [encode()]

    def train(seqs: list[TrainSequence]) -> None:
        # queued behind the update, before the step's host sync: where a run's consumer puts its after_publish
        trainer.step(seqs, after_update=None if args.no_ahead else lambda: ahead.append(encode()))

    def sampling(seed: int, new: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=new, temperature=0.8, top_p=0.95, ignore_eos=True, seed=seed)

    rows: dict[str, list[float]] = {"generate_s": [], "train_s": [], "sync_s": [], "one_token_s": []}
    peaks: dict[str, list[float]] = {"generate": [], "train": []}
    prompt_len = 0
    for step in range(args.warmup + args.steps):
        reset_peak(device)
        t_gen, (ids, images, outs) = timed_call(lambda s=step: generate(sampling(s, args.new)), device)
        gen_peak = peak_gib(device)
        prompt_len = max(map(len, ids))
        seqs = [TrainSequence(ids[k], c.token_ids, c.logprobs, advantage=float(j % 3 - 1), group=k,
                              images=None if images is None else images[k])
                for k, comps in enumerate(outs) for j, c in enumerate(comps)]
        assert all(len(s.completion_ids) == args.new for s in seqs)
        reset_peak(device)
        t_train, _ = timed_call(lambda b=seqs: train(b), device)
        train_peak = peak_gib(device)
        t_sync, _ = timed_call(lambda: gen.load_weights_(model), device)
        print(f"  step {step}: generate {t_gen:.3f} s, train {t_train:.3f} s, sync {t_sync:.3f} s", flush=True)
        if step >= args.warmup:
            rows["generate_s"].append(t_gen)
            rows["train_s"].append(t_train)
            rows["sync_s"].append(t_sync)
            if gen_peak is not None:
                peaks["generate"].append(gen_peak)
                peaks["train"].append(train_peak)
    if args.profile and device.type == "cuda":  # one more step, its training under the profiler
        ids, images, outs = generate(sampling(999, args.new))
        seqs = [TrainSequence(ids[k], c.token_ids, c.logprobs, advantage=float(j % 3 - 1), group=k,
                              images=None if images is None else images[k])
                for k, comps in enumerate(outs) for j, c in enumerate(comps)]
        profiled = profile_call(lambda: train(seqs), args.profile, "train step")
        gen.load_weights_(model)
    if args.profile_prefill and device.type == "cuda":  # one 1-token batch (the prefill, the tower's forward)
        encode_next()
        generate(sampling(998, 1))  # its own warm-up
        encode_next()
        prefill_profiled = profile_call(lambda: generate(sampling(999, 1)), args.profile_prefill, "1-token batch")
    for rep in range(args.decode_reps + 1):  # the first: the 1-token batch's own warm-up
        encode_next()  # (the decode split: like with like)
        t_one, _ = timed_call(lambda r=rep: generate(sampling(1000 + r, 1)), device)
        if rep:
            rows["one_token_s"].append(t_one)
    med = {k: statistics.median(v) for k, v in rows.items()}
    decode_step = (med["generate_s"] - med["one_token_s"]) / (args.new - 1)
    out = {"prompt_tokens_max": prompt_len, **{f"{k}_median": v for k, v in med.items()}, "steps": rows,
           "rl_step_s": med["generate_s"] + med["train_s"] + med["sync_s"], "decode_step_ms": decode_step * 1e3,
           "decode_tokens_s": len(prompts) * args.n / decode_step if decode_step > 0 else None,
           "generate_peak_gib": max(peaks["generate"], default=None),
           "train_peak_gib": max(peaks["train"], default=None),
           "params_b": sum(p.numel() for p in model.parameters()) / 1e9}
    if args.profile and device.type == "cuda":
        out["train_profile"] = profiled
    if args.profile_prefill and device.type == "cuda":
        out["prefill_profile"] = prefill_profiled
    if processor is not None:
        out["image_tokens"] = processor.token_count(processor.grid(args.image_size, args.image_size))
    return out


def profile_call(fn: Callable[[], Any], top: int, label: str) -> dict:
    """One call (a trainer step, a 1-token batch) under torch's profiler: its wall, CUDA time by kind and the `top`
    kernels by CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    kinds = {"elementwise / reduce (aten)": ("at::native", "elementwise", "reduce", "vectorized"),
             "matmul": ("gemm", "nvjet", "cutlass", "xmma", "matmul", "cublas"),
             "attention": ("flash", "attn", "attention"), "triton": ("triton", "_kernel")}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    rows, by_kind = [], {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0.0)
        if not t or e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        rows.append((t / 1e3, e.count, e.key[:90]))
        kind = next((k for k, keys in kinds.items() if any(w in e.key.lower() for w in keys)), "other")
        acc = by_kind.setdefault(kind, [0.0, 0])
        acc[0] += t / 1e3
        acc[1] += e.count
    rows.sort(reverse=True)
    out = {"wall_ms": wall * 1e3, "cuda_ms": sum(r[0] for r in rows), "kernels": sum(r[1] for r in rows),
           "by_kind": {k: {"ms": v[0], "count": v[1]} for k, v in by_kind.items()},
           "top": [{"ms": ms, "count": n, "name": name} for ms, n, name in rows[:top]]}
    print(f"  profiled {label}: wall {out['wall_ms']:.1f} ms, CUDA {out['cuda_ms']:.1f} ms in {out['kernels']} "
          "kernels; " + ", ".join(f"{k} {v[0]:.1f} ms ({v[1]})" for k, v in sorted(by_kind.items())), flush=True)
    for ms, n, name in rows[:top]:
        print(f"    {ms:8.2f} ms {n:6d}  {name}", flush=True)
    return out


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="vision_step.json")
    ap.add_argument("--shape", default="qwen3-vl-2b", help="a named vision-language shape; text-only: its vision=None")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--new", type=int, default=100, help="new tokens per sample (EOS ignored)")
    ap.add_argument("--image-size", type=int, default=448, help="each prompt's picture, pixels a side")
    ap.add_argument("--warmup", type=int, default=2, help="RL steps before the timed ones")
    ap.add_argument("--steps", type=int, default=5, help="timed RL steps (median)")
    ap.add_argument("--decode-reps", type=int, default=5, help="timed 1-new-token batches (median)")
    ap.add_argument("--trainer-graphs", action="store_true", help="the trainer step replays CUDA graphs (#59)")
    ap.add_argument("--no-ahead", action="store_true",
                    help="each step encodes its prompts at its start (before session 20's encode-ahead of images)")
    ap.add_argument("--profile", type=int, default=0, metavar="TOP",
                    help="CUDA: one more training step per case under torch's profiler, its TOP kernels printed")
    ap.add_argument("--profile-prefill", type=int, default=0, metavar="TOP",
                    help="also profile one 1-token batch (the prefill with the tower's forward), TOP kernels")
    ap.add_argument("--micro-batch-tokens", type=int, default=TrainerConfig.micro_batch_tokens,
                    help="the trainer's token budget of one micro-batch (whole sequences, as unshared)")
    ap.add_argument("--cases", default="text,vl,vl_frozen", help="which of text, vl, vl_frozen to run")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny-vl against tiny, few steps: checks the script")
    args = ap.parse_args()
    if args.smoke:
        args.shape, args.warmup, args.steps, args.decode_reps = "tiny-vl", 1, 2, 2
        device = torch.device("cpu")  # threads as the process has them (a test runs this in pytest's process)
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise SystemExit("bench_vision_step: needs CUDA (or --smoke for the CPU check)")
    vl = model_shape(args.shape)
    if vl.vision is None:
        raise SystemExit(f"bench_vision_step: --shape {args.shape} has no vision tower; give a vision-language shape")
    text_prompts, vl_prompts, pictures = make_prompts(vl, args.prompts, args.image_size)
    processor = image_processor(ModelSection(shape=args.shape), vl)
    image_tokens = processor.token_count(processor.grid(args.image_size, args.image_size))
    # one context length for both cases: the VL prompt's, its image expanded
    max_len = -(-(max(map(len, vl_prompts)) - 1 + image_tokens + args.new + 8) // 16) * 16
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                           "torch": torch.__version__, "shape": args.shape, "prompts": args.prompts, "n": args.n,
                           "new_tokens": args.new, "image_size": args.image_size,
                           "trainer_graphs": args.trainer_graphs, "micro_batch_tokens": args.micro_batch_tokens,
                           "text_tokens": [len(p) for p in text_prompts], "max_model_len": max_len, "cases": {}}
    t0 = time.perf_counter()
    cases = [("text", vl.replace(vision=None), text_prompts, None, False), ("vl", vl, vl_prompts, pictures, False),
             ("vl_frozen", vl, vl_prompts, pictures, True)]
    cases = [c for c in cases if c[0] in args.cases.split(",")]
    for name, cfg, prompts, pics, freeze in cases:
        print(f"{name}: {args.shape}{' without vision' if pics is None else ''}{' (tower frozen)' if freeze else ''}",
              flush=True)
        try:
            res["cases"][name] = run_case(cfg, args.shape, prompts, pics, args, device, max_len, freeze)
        except Exception as e:  # the other case's numbers still print
            traceback.print_exc()
            res["cases"][name] = {"error": f"{type(e).__name__}: {e}"}
        res["wall_s"] = time.perf_counter() - t0
        with open(args.out, "w") as f:  # after each case: a run cut short keeps the first case's numbers
            json.dump(res, f, indent=1)
    text = res["cases"].get("text", {"error": "not run"})
    for name, key in (("vl", "rl_step_ratio"), ("vl_frozen", "rl_step_ratio_frozen")):
        if "error" not in text and "error" not in res["cases"].get(name, {"error": ""}):
            res[key] = res["cases"][name]["rl_step_s"] / text["rl_step_s"]
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)

    print(f"\n{res['device']}, {args.shape}: {args.prompts} prompts x {args.n}, {args.new} new tokens, text "
          f"{min(res['text_tokens'])}-{max(res['text_tokens'])} tokens; vl: + one {args.image_size}x{args.image_size} "
          f"image per prompt ({image_tokens} image tokens); medians of {args.steps} steps ({res['wall_s']:.0f} s)")
    print("| case | generate s | train s | sync s | RL step s | vs text | 1-token batch s | decode ms/step "
          "| decode tok/s | gen peak GiB | train peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, c in res["cases"].items():
        if "error" in c:
            print(f"| {name} | {c['error'][:200]} |||||||||| ")
            continue
        ratio = c["rl_step_s"] / text["rl_step_s"] if "error" not in text else None
        print(f"| {name} | {c['generate_s_median']:.3f} | {c['train_s_median']:.3f} | {c['sync_s_median']:.3f} | "
              f"{c['rl_step_s']:.3f} | {fmt(ratio, '.2f')}x | {c['one_token_s_median']:.3f} | "
              f"{c['decode_step_ms']:.2f} | {fmt(c['decode_tokens_s'], '.0f')} | {fmt(c['generate_peak_gib'], '.1f')} "
              f"| {fmt(c['train_peak_gib'], '.1f')} |")
    for key, tower in (("rl_step_ratio", "tower trained (the default)"), ("rl_step_ratio_frozen", "tower frozen")):
        if key in res:
            verdict = "within" if res[key] <= 1.3 else "over"
            print(f"RL step with one image per prompt, {tower}: {res[key]:.2f}x the text-only step ({verdict} the "
                  "1.3x target)")


if __name__ == "__main__":
    main()
