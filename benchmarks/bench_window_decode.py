"""Gemma 3's sliding-window layers at decode (#57): random init, bf16, one GPU. Each shape runs as configured (window
on: 5 of every 6 layers attend their last `sliding_window` keys, kept in recycled rings, `generate/window_cache.py`)
and as the same shape with every layer full attention (window off: `layer_types` all "full_attention"), at --rows
rows and --contexts prompt lengths: decode tokens/s of engine steps, graphs on, as the generator's defaults run
(`decode_timing.decode_case`: prompts prefilled, then decode chunks of --chunk steps timed with CUDA events, median
over --chunks after a warm one), peak memory beside each.

KV read per decode step, per layer kind, from the cache's state after the timed chunks (`kv_reads`): a window layer's
row reads the keys from the start of the kernel's key block (`attention.block_n` keys) holding its first visible key
n - W up to n (W + (n - W) mod block_n keys at most; all n while n <= W), which live in the ring blocks its map gives
for those positions (checked: at most R = ceil(W / block_size) + 1 distinct blocks, all the row's own ring); a full
layer's row reads its n keys. Bytes: keys x (key + value) x the kind's layers, summed over the rows. A case whose KV
cache cannot fit is listed as such; the capacity lines give, window on and off, the KV cache --probe-rows rows need
(marked where it exceeds --fit-gib) and the most rows whose KV fits --fit-gib. Peak memory counts the two benchmark
copies (on, off) and the generator's.

  python benchmarks/bench_window_decode.py --out window_decode.json      # one H100: 2-3 minutes (estimated)
  python benchmarks/bench_window_decode.py --smoke                        # CPU, tiny shapes, under a minute
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from decode_timing import BLOCK_SIZE, GiB, decode_case, decode_len

from monorl.generate.cache import kv_cache_bytes_needed
from monorl.generate.engine import Engine
from monorl.generate.window_cache import KIND, RecycledWindowKV
from monorl.model.config import ModelConfig, model_shape
from monorl.model.decoder import build_model
from monorl.ops.tunables import HOPPER, chip_of, tuned

MiB = 1 << 20


def window_off(cfg: ModelConfig) -> ModelConfig:
    """The same shape with every layer full attention."""
    return cfg.replace(layer_types=("full_attention",) * cfg.num_layers)


def smoke_shape() -> ModelConfig:
    """A Gemma 3 in small for the CPU smoke run: 6 layers (5 window, 1 full), windows of 32 keys."""
    return model_shape("gemma3-270m").replace(
        vocab_size=32768, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4, num_kv_heads=1, head_dim=16,
        layer_types=("sliding_attention",) * 5 + ("full_attention",), sliding_window=32, max_position_embeddings=1024,
        query_pre_attn_scalar=16.0)


def kv_reads(engine: Engine) -> dict:
    """Per layer kind ("window", "full"): the keys and cache blocks one decode step reads per row (mean over the
    running rows) and the KV bytes over the kind's layers, read off the cache's state (module docstring). The Triton
    decode kernel's reads; the CPU's torch path gathers whole tables (masked)."""
    cache, cfg = engine.cache, engine.gen.kv_config
    dev = cache.device
    block_n = tuned("attention.block_n", chip_of(dev.index or 0) if dev.type == "cuda" else HOPPER)
    kv_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=cache.dtype).element_size()
    bs, rows = cache.block_size, len(engine.running)
    out = {}
    for kind in cache.kinds:
        keys = blocks = 0
        for req in engine.running:
            n, st = len(req.tokens), req.cache  # the next step's keys: the cached positions and its own token
            if isinstance(kind, RecycledWindowKV):
                first = max(n - kind.window, 0)  # the first key position p = n - 1 sees
                idx = torch.tensor(st.table[first // bs:(n - 1) // bs + 1], device=dev)
                mapped = set(kind.block_map[idx].tolist())  # its window blocks, as the decode's mapped table has them
                ring = st.kind_state[KIND]
                own = set(ring.blocks) | (set(kind.prefix_rings[ring.prefix][0].blocks) if ring.prefix is not None
                                          else set())
                if not (mapped <= own and len(mapped) <= kind.R):
                    raise AssertionError(f"a window row reads blocks {sorted(mapped)}, its ring {sorted(own)} "
                                         f"(R = {kind.R})")
                blocks += len(mapped)
                keys += n - first // block_n * block_n  # the kernel starts at the key block holding `first`
            else:
                blocks += -(-n // bs)
                keys += n
        name = "window" if isinstance(kind, RecycledWindowKV) else "full"
        out[name] = {"layers": len(kind.layer_ids), "keys_per_row": keys / rows, "blocks_per_row": blocks / rows,
                     "bytes_per_step": keys * kv_bytes * len(kind.layer_ids)}
        if name == "window":
            out[name]["ring_blocks"] = kind.R
    return {"kv_reads": out, "block_n": block_n}


def fit_rows(cfg: ModelConfig, context: int, chunk: int, chunks: int, budget: float) -> int:
    """The most rows whose KV cache (`kv_cache_bytes_needed`, bf16) fits `budget` bytes."""
    need = lambda r: kv_cache_bytes_needed(cfg, r, decode_len(context, chunk, chunks), BLOCK_SIZE,  # noqa: E731
                                           torch.bfloat16)
    lo, hi = 0, 1
    while need(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid) <= budget else (lo, mid)
    return lo


def kv_size(gib: float, fit_gib: float) -> str:
    return f"{gib:.1f} GiB" + (" (cannot fit)" if gib > fit_gib else "")


def row(c: dict) -> str:
    rows = c["rows"] if c.get("live", c["rows"]) == c["rows"] else f"{c['live']} of {c['rows']}"  # (live ones)
    head = f"| {c['shape']} | {c['context']} | {rows} | {c['window']} |"
    if "skipped" in c:
        return f"{head} {c['skipped']} | | | | | |"
    r = c["kv_reads"]
    w, f = r.get("window"), r["full"]
    keys = f"{w['keys_per_row']:.0f} / {f['keys_per_row']:.0f}" if w else f"- / {f['keys_per_row']:.0f}"
    read = f"{w['bytes_per_step'] / MiB:.1f} / {f['bytes_per_step'] / MiB:.1f}" if w else \
        f"- / {f['bytes_per_step'] / MiB:.1f}"
    peak = "-" if c["peak_gib"] is None else f"{c['peak_gib']:.2f}"
    return (f"{head} {c['decode_tokens_s']:.0f} | {c['decode_step_ms']:.2f} | {keys} | {read} | "
            f"{c['kv_cache_gib']:.2f} | {peak} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="window_decode.json")
    ap.add_argument("--shapes", default="gemma3-270m,gemma3-1b")
    ap.add_argument("--rows", default="16,64")
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--chunk", type=int, default=16, help="decode steps a timed engine step runs")
    ap.add_argument("--chunks", type=int, default=6, help="timed chunks (median)")
    ap.add_argument("--fit-gib", type=float, default=64.0,
                    help="KV budget of the capacity lines (an H100's 78 GiB less the model copies and activations)")
    ap.add_argument("--probe-rows", type=int, default=256, help="rows of the capacity lines' KV sizes")
    ap.add_argument("--budget-s", type=float, default=180.0,
                    help="start no case after this many seconds (the rest listed as not run)")
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny Gemma 3 shape and contexts")
    args = ap.parse_args()
    if args.smoke:
        dev, dtype = torch.device("cpu"), torch.float32
        shapes = {"gemma3-tiny": smoke_shape()}
        args.rows, args.contexts, args.chunk, args.chunks = "2,4", "96,208", 4, 3
    elif torch.cuda.is_available():
        dev, dtype = torch.device("cuda"), torch.bfloat16
        shapes = {s: model_shape(s) for s in args.shapes.split(",")}
    else:
        sys.exit("bench_window_decode: needs CUDA (--smoke runs a tiny shape on the CPU)")
    t0 = time.monotonic()
    res: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "chunk": args.chunk,
                 "chunks": args.chunks, "cases": [], "capacity": []}
    for shape, cfg in shapes.items():
        models = {}
        for label, c in (("on", cfg), ("off", window_off(cfg))):
            models[label] = build_model(c, dev, dtype, seed=None).init_weights(0).requires_grad_(False)
        for context in map(int, args.contexts.split(",")):
            for rows in map(int, args.rows.split(",")):
                for label, model in models.items():  # on and off side by side
                    case = {"shape": shape, "window": label, "context": context, "rows": rows}
                    if time.monotonic() - t0 > args.budget_s:
                        case["skipped"] = f"not run (--budget-s {args.budget_s:.0f} reached)"
                    else:
                        t = time.monotonic()
                        case |= decode_case(model, rows, context, args.chunk, args.chunks, inspect=kv_reads)
                        case["case_s"] = time.monotonic() - t
                    res["cases"].append(case)
                    print({k: v for k, v in case.items() if k != "kv_reads"}, case.get("kv_reads"), flush=True)
            max_len = decode_len(context, args.chunk, args.chunks)
            res["capacity"].append({"shape": shape, "context": context, "fit_gib": args.fit_gib,
                                    "probe_rows": args.probe_rows, **{label: {
                                        "fit_rows": fit_rows(m.config, context, args.chunk, args.chunks,
                                                             args.fit_gib * GiB),
                                        "probe_gib": kv_cache_bytes_needed(m.config, args.probe_rows, max_len,
                                                                           BLOCK_SIZE, torch.bfloat16) / GiB}
                                        for label, m in models.items()}})
        del models
    res["wall_s"] = time.monotonic() - t0
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n{res['device']}, {res['wall_s']:.0f} s. keys/row: one layer's reads per row per step (window layer / "
          "full layer); KV read: per step over all rows and layers of each kind")
    print("| shape | context | rows | window | decode tok/s | step ms | keys/row W / full | KV read MiB W / full "
          "| KV GiB | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in res["cases"]:
        print(row(c))
    for c in res["capacity"]:
        on, off = c["on"], c["off"]
        print(f"{c['shape']} at {c['context']} tokens: {c['probe_rows']} rows' KV cache: window on "
              f"{kv_size(on['probe_gib'], c['fit_gib'])}, off {kv_size(off['probe_gib'], c['fit_gib'])}; rows whose "
              f"KV fits {c['fit_gib']:.0f} GiB: on {on['fit_rows']}, off {off['fit_rows']}")


if __name__ == "__main__":
    main()
