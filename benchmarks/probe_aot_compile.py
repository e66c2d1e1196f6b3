"""Whether torch's ahead-of-time compile (`torch.compile(fullgraph=True).aot_compile`, saved with
`save_compiled_function`, loaded with `torch.compiler.load_compiled_function`) can stand in for the trainer's
regional block compile on this torch, and what a warm start then costs (issue 18, deliver 2: a second run must not
re-run Dynamo / AOTAutograd for frames it compiled before).

One phase per process (the driver, `--phase all`, runs each in a fresh one): a Qwen3 block in the trainer's call
(fp32 masters under bf16 autocast, a packed varlen batch, forward and backward), layer 0 compiled:
  lazy:  `block.compile(backend="inductor")` (what `monorl.compile.compile_blocks` does); first call timed; run it
         twice, the second finds Inductor's caches warm (Dynamo and AOTAutograd still trace);
  save:  `aot_compile` on layer 0 and `save_compiled_function`;
  load:  `load_compiled_function`, then the first call; checks against eager on layer 0, layer 1 and another pack.

  python benchmarks/probe_aot_compile.py --phase all --out probe_aot_compile.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import subprocess
import sys
import time

import torch


def setup(a):
    import monorl.model.attention as attention

    if a.phase == "lazy":  # as in a compiled run: mark_dynamic marks once Dynamo is imported
        importlib.import_module("torch._dynamo")
    else:  # aot_compile with dynamic sizes: a marked runtime tensor fails the loaded guards (marks are not saved)
        attention.mark_dynamic = lambda *t, **k: None

    from monorl.model.attention import VarlenContext
    from monorl.model.batch_invariant import make_batch_invariant_
    from monorl.model.config import model_shape
    from monorl.model.decoder import build_model
    from monorl.model.rope import rope_cos_sin

    cfg = model_shape(a.shape)
    cfg = dataclasses.replace(cfg, num_layers=2)
    model = build_model(cfg, device=a.device).init_weights(0)
    backend = "flash" if a.device == "cuda" else "sdpa"
    if a.mode == "invariant":
        make_batch_invariant_(model)

    def inputs(lengths, seed):
        ctx = VarlenContext.from_lengths(lengths, a.device, backend)
        if a.mode == "invariant":
            ctx = ctx.batch_invariant()
        g = torch.Generator(device=a.device).manual_seed(seed)
        x = torch.randn(int(sum(lengths)), cfg.hidden_size, device=a.device, generator=g).requires_grad_()
        cos, sin = rope_cos_sin(ctx.positions, cfg.head_dim, cfg.rope_theta, torch.bfloat16)
        if a.phase == "lazy":
            from monorl.compile import mark_dynamic
            mark_dynamic(x, cos, sin, dims=(0,))
        return x, cos, sin, ctx

    return model, inputs


def block_autocast(block, x, cos, sin, ctx):
    """The block under bf16 autocast, entered inside the compiled region (its guards then see no autocast state)."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        return block(x, cos, sin, ctx)


def run(block, fn, x, cos, sin, ctx, inner_autocast=False):
    """The trainer's call: forward under bf16 autocast, backward; (output, input grad, a weight grad)."""
    block.zero_grad(set_to_none=True)
    x.grad = None
    if inner_autocast:
        out = fn(x, cos, sin, ctx)
    else:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            out = fn(x, cos, sin, ctx)
    if isinstance(out, tuple):  # a fused-kernels block's (h, m), its residual add pending
        out = out[0] + out[1]
    out.float().square().mean().backward()
    w = next(p for n, p in block.named_parameters() if n.endswith("down_proj.weight"))
    if x.is_cuda:
        torch.cuda.synchronize()
    return out.detach().float(), x.grad.clone(), w.grad.clone()


def diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a, b, strict=True))


def phase(a) -> dict:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = a.dir + "/inductor"
    os.environ["TRITON_CACHE_DIR"] = a.dir + "/triton"
    import torch._inductor.config as ic
    ic.fx_graph_cache = True
    model, inputs = setup(a)
    b0, b1 = model.model.layers[0], model.model.layers[1]
    pack, other = inputs([158 + 100] * 8, 0), inputs([150 + 90, 170 + 100, 140 + 60] * 2, 1)
    eager = {name: run(b, b.forward, *inp) for name, b, inp in (("l0", b0, pack), ("l1", b1, pack), ("l0o", b0, other))}
    res: dict = {"phase": a.phase, "mode": a.mode}
    path = a.dir + f"/block_{a.mode}.aot"
    t = time.perf_counter()
    if a.phase == "lazy":
        b0.compile(backend="inductor")
        b1.compile(backend="inductor")
        first = run(b0, b0, *pack)
        res["first_call_s"] = time.perf_counter() - t
        calls = {"l0": first, "l1": run(b1, b1, *pack), "l0o": run(b0, b0, *other)}
    else:
        if a.phase == "save":
            cfg = importlib.import_module("torch._dynamo.config")
            if hasattr(cfg, "enable_aot_compile"):  # torch 2.11: `.aot_compile` only with this set
                cfg.enable_aot_compile = True
            compiled = torch.compile(block_autocast, fullgraph=True, backend="inductor", dynamic=a.dynamic)
            for b, inp in ((b0, pack), (b1, pack), (b0, other)):  # the example's guards pickle its tensors' grads
                b.zero_grad(set_to_none=True)
                inp[0].grad = None
            fn = compiled.aot_compile(((b0, *pack), {}))
            res["aot_compile_s"] = time.perf_counter() - t
            fn.save_compiled_function(path)
            res["bytes"] = os.path.getsize(path)
        else:
            with open(path, "rb") as f:
                fn = torch.compiler.load_compiled_function(f, f_globals=globals())
            res["load_s"] = time.perf_counter() - t
        t = time.perf_counter()
        calls = {"l0": run(b0, lambda *x: fn(b0, *x), *pack, inner_autocast=True)}
        res["first_call_s"] = time.perf_counter() - t
        for name, b, inp in (("l1", b1, pack), ("l0o", b0, other)):
            try:
                calls[name] = run(b, lambda *x, b=b: fn(b, *x), *inp, inner_autocast=True)
            except Exception as e:  # a guard that does not hold (another layer, another pack)
                res[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:3000]}"
    res["max_diff_vs_eager"] = {k: diff(v, eager[k]) for k, v in calls.items()}
    res["bitwise"] = {k: all(torch.equal(p, q) for p, q in zip(v, eager[k], strict=True)) for k, v in calls.items()}
    t = time.perf_counter()
    for _ in range(3):
        if a.phase == "lazy":
            run(b0, b0, *pack)
        else:
            run(b0, lambda *x: fn(b0, *x), *pack, inner_autocast=True)
    res["call_s"] = (time.perf_counter() - t) / 3
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", default="all", choices=["all", "lazy", "save", "load"])
    ap.add_argument("--mode", default="plain", choices=["plain", "invariant"])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dynamic", type=lambda v: None if v == "none" else v == "true", default=True,
                    help="aot_compile's dynamic: true (every size dynamic), false, none (marked sizes only)")
    ap.add_argument("--phases", default="lazy,lazy,save,load")
    ap.add_argument("--modes", default="plain,invariant")
    ap.add_argument("--dir", default="/tmp/probe_aot")
    ap.add_argument("--out", default="probe_aot_compile.json")
    a = ap.parse_args()
    if a.phase != "all":
        t = time.perf_counter()
        res = phase(a)
        res["process_phase_s"] = time.perf_counter() - t
        print("RESULT " + json.dumps(res), flush=True)
        return
    rows = []
    for mode in a.modes.split(","):
        for ph in a.phases.split(","):
            t = time.perf_counter()
            p = subprocess.run([sys.executable, __file__, "--phase", ph, "--mode", mode, "--shape", a.shape,
                                "--device", a.device, "--dir", a.dir,
                                "--dynamic", str(a.dynamic).lower()], capture_output=True, text=True)
            wall = time.perf_counter() - t
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            res = json.loads(line[7:]) if line else {"phase": ph, "mode": mode, "error": p.stderr[-1500:]}
            res["process_wall_s"] = wall
            rows.append(res)
            print(json.dumps(res), flush=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
