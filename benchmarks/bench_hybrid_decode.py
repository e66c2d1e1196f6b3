"""A Qwen3.5 hybrid (Gated DeltaNet + gated full attention, #58) against a Qwen3 of similar size, random init, bf16,
one GPU: decode tokens/s at --rows rows and --contexts prompt lengths (each row's prompt prefilled, then decode
chunks of --chunk steps timed with CUDA events, median over --chunks chunks after two warm ones: the engine's step,
graphs on, as the generator's defaults run), and the trainer step time of a W0-like batch (40 rollouts of 110 prompt
+ 100 completion tokens, groups of 8; `profile_train_step.seqs`; eager, median of 5 after 2 warm-ups: a hybrid's
chunked rule reads its sequences' bounds on the host, so no trainer graphs for either). Peak memory beside each.
A case whose KV cache cannot fit (the Qwen3's at long contexts) is listed as such; each case's model, cache and
graphs are freed before the next. Prints one table, each pair's hybrid / dense tokens/s where both ran (the issue's
target: >= 1.5 at 16k context, equal rows), writes --out.

Needs fla-core on CUDA (the linear-attention extra) for the prefills (the hybrid's decode runs monorl's own kernels,
`monorl.ops.gated_delta_decode`): without it the prefill would run the plain-PyTorch reference rule, so the script
stops. The first prefill of a shape includes fla's autotuning (tens of seconds).

  python benchmarks/bench_hybrid_decode.py --out hybrid_decode.json
  python benchmarks/bench_hybrid_decode.py --pairs qwen3_5-0.8b:qwen3-0.6b --rows 64,256 --contexts 1024,4096
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys

import torch
from decode_timing import GiB, decode_case, free_cuda
from profile_train_step import seqs, timed

from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.ops import gated_delta, gated_delta_decode
from monorl.ops.gated_delta import _fla
from monorl.train.losses import LossConfig
from monorl.train.trainer import Trainer, TrainerConfig


def train_case(shape: str) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cfg = model_shape(shape)
    g = torch.Generator().manual_seed(0)
    batches = [seqs(g, 8, "w0", cfg.vocab_size) for _ in range(7)]
    model = build_model(cfg, "cuda", torch.float32, seed=0)
    tr = Trainer(model, TrainerConfig(lr=1e-6, micro_batch_tokens=16384, loss=LossConfig(kind="grpo")),
                 total_steps=100, attn_backend="flash", cuda_graphs=False)
    ts = timed(tr, batches)
    out = {"step_s": statistics.median(ts[2:]), "steps_s": ts, "peak_gib": torch.cuda.max_memory_allocated() / GiB}
    del tr, model
    free_cuda()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="hybrid_decode.json")
    ap.add_argument("--pairs", default="qwen3_5-hybrid-2b-like:qwen3-1.7b",
                    help="hybrid:dense shape pairs, comma-separated")
    ap.add_argument("--rows", default="16,64", help="(Qwen3-1.7B's KV at 16k fits 16 rows, not 64, on 80 GB)")
    ap.add_argument("--contexts", default="1024,16384")
    ap.add_argument("--chunk", type=int, default=16, help="decode steps a timed engine step runs")
    ap.add_argument("--chunks", type=int, default=8, help="timed chunks (median)")
    ap.add_argument("--no-train", action="store_true", help="skip the trainer steps")
    ap.add_argument("--plain-decode-too", action="store_true",
                    help="also time each hybrid case with the in-place decode kernels off (the plain gather / step / "
                         "scatter path), in the same process: the kernels' own gain")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # which rule runs (gated_delta.rule_path)
    if not torch.cuda.is_available():
        sys.exit("bench_hybrid_decode: needs CUDA")
    if _fla() is None:
        sys.exit("bench_hybrid_decode: fla-core is not installed (pip install 'monorl[linear-attention]'): the hybrid "
                 "would run the plain-PyTorch reference rule")
    gated_delta.FLA_ENABLED = True  # fla's prefill (the default; set here in case it is turned off)
    gated_delta_decode.ENABLED = True  # the in-place decode kernels (the default)
    res: dict = {"device": torch.cuda.get_device_name(), "chunk": args.chunk, "shapes": {}}
    shapes = [s for pair in args.pairs.split(",") for s in pair.split(":")]
    for shape in shapes:
        model = build_model(model_shape(shape), "cuda", torch.bfloat16, seed=None).init_weights(0)
        model.requires_grad_(False)
        entry: dict = {"params_b": sum(p.numel() for p in model.parameters()) / 1e9, "decode": []}
        for rows in map(int, args.rows.split(",")):
            for context in map(int, args.contexts.split(",")):
                r = decode_case(model, rows, context, args.chunk, args.chunks)
                entry["decode"].append({"rows": rows, "context": context, **r})
                print(shape, rows, context, r, flush=True)
                if args.plain_decode_too and "linear_attention" in model.config.layer_types:
                    gated_delta_decode.ENABLED = False
                    plain = decode_case(model, rows, context, args.chunk, args.chunks)
                    gated_delta_decode.ENABLED = True
                    entry.setdefault("plain_decode", []).append({"rows": rows, "context": context, **plain})
                    print(shape, rows, context, "kernels off:", plain, flush=True)
        del model
        free_cuda()
        if not args.no_train:
            entry["train"] = train_case(shape)
            print(shape, "train", entry["train"], flush=True)
        res["shapes"][shape] = entry
    print(f"\n{res['device']}")
    print("| shape | rows | context | decode tok/s | step ms | KV GiB | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for shape, e in res["shapes"].items():
        for d in e["decode"]:
            if "skipped" in d:
                print(f"| {shape} | {d['rows']} | {d['context']} | {d['skipped']} | | | |")
            else:
                print(f"| {shape} | {d['rows']} | {d['context']} | {d['decode_tokens_s']:.0f} | "
                      f"{d['decode_step_ms']:.2f} | {d['kv_cache_gib']:.2f} | {d['peak_gib']:.2f} |")
    for pair in args.pairs.split(","):
        hybrid, dense = (res["shapes"][s]["decode"] for s in pair.split(":"))
        for h, d in zip(hybrid, dense, strict=True):
            ran = "skipped" not in h and "skipped" not in d
            ratio = f"{h['decode_tokens_s'] / d['decode_tokens_s']:.2f}x" if ran else "not both ran"
            print(f"{pair} rows {h['rows']} context {h['context']}: hybrid / dense tokens/s {ratio}")
    for shape, e in res["shapes"].items():
        for k, p in zip(e["decode"], e.get("plain_decode", []), strict=False):
            if "skipped" not in k and "skipped" not in p:
                print(f"{shape} rows {k['rows']} context {k['context']}: decode step {k['decode_step_ms']:.2f} ms "
                      f"with the in-place kernels, {p['decode_step_ms']:.2f} ms without")
    for shape, e in res["shapes"].items():
        if "train" in e:
            print(f"{shape} ({e['params_b']:.2f}B): W0-like trainer step {e['train']['step_s'] * 1e3:.0f} ms, "
                  f"peak {e['train']['peak_gib']:.1f} GiB")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
