"""Launch values of Qwen3.5's decode rule step (`monorl.ops.gated_delta_decode.rule_step`): values per program
(BV), warps and stages, at a hybrid's decode shapes (16 value heads of 128, 16 key heads of 128: the 0.8B and 2B
shapes) and 40-256 rows. The step reads and writes each row's fp32 state, Hv x Dk x Dv x 4 bytes (1 MiB a row at
these heads), so its floor is 2 x rows x that over the HBM's bandwidth. Each launch's output and state are checked
against the kept launch's (not bitwise: the reduction over Dk may split otherwise). Timed in CUDA graphs over
several layers' states in turn (states that do not fit L2, as a decode step's 18 layers), the decode step's way.

  python benchmarks/tune_rule_step.py --out tune_rule_step.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
from triton.testing import do_bench_cudagraph

from monorl.ops import gated_delta_decode as gd
from monorl.ops.tunables import chip_of, overridden, tuned


def sweep(n: int, args: argparse.Namespace, kept: dict, hk: int, hv: int, dk: int, dv: int) -> dict:
    """Every (BV, warps, stages) at n rows: microseconds a launch, sorted, and the floor."""
    x = torch.randn(n, 2 * hk * dk + hv * dv, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(n, hv, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, hv, device="cuda", dtype=torch.bfloat16)
    a_log, dt_bias = torch.randn(hv, device="cuda"), torch.randn(hv, device="cuda")
    rows = torch.randperm(n, device="cuda", dtype=torch.int32) + 1
    states = [torch.randn(n + 1, hv, dk, dv, device="cuda") * 0.1 for _ in range(args.layers)]
    floor_us = 2 * n * hv * dk * dv * 4 / args.bandwidth * 1e6

    def run(values: dict, ss: list[torch.Tensor]) -> torch.Tensor:
        with overridden({f"gated_delta_decode.rule_{k}": v for k, v in values.items()}):
            return [gd.rule_step(x, a, b, a_log, dt_bias, s, rows, hk, dk) for s in ss][-1]

    init = states[0].clone()  # the timed launches advance the states in place: each check starts from this copy
    ref_state = init.clone()
    ref = run(kept, [ref_state])
    results = []
    for bv, w, st in itertools.product(*(map(int, getattr(args, k).split(",")) for k in ("bv", "warps", "stages"))):
        values = {"bv": bv, "warps": w, "stages": st}
        try:
            s0 = init.clone()
            o = run(values, [s0])
            err = max((o.float() - ref.float()).abs().max().item(), (s0 - ref_state).abs().max().item())
            us = do_bench_cudagraph(functools.partial(run, values, states), rep=50) * 1e3 / args.layers
        except Exception as e:  # a launch the compiler refuses (too many registers): listed, not fatal
            results.append({**values, "error": str(e)[:120]})
            continue
        results.append({**values, "us": us, "max_abs_diff": err})
    results.sort(key=lambda r: r.get("us", float("inf")))
    kept_us = next((r["us"] for r in results if all(r.get(k) == v for k, v in kept.items()) and "us" in r), None)
    return {"rows": n, "floor_us": floor_us, "kept_us": kept_us, "results": results}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="40,64,128,256")
    ap.add_argument("--bv", default="8,16,32,64")
    ap.add_argument("--warps", default="1,2,4,8")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--layers", type=int, default=6, help="states launched on in turn (cold reads)")
    ap.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s for the floor (H100 SXM: 3.35e12)")
    ap.add_argument("--out", default="tune_rule_step.json")
    args = ap.parse_args()
    chip = chip_of(0)
    kept = {k: tuned(f"gated_delta_decode.rule_{k}", chip) for k in ("bv", "warps", "stages")}
    hk = hv = 16
    dk = dv = 128
    torch.manual_seed(0)
    out: dict = {"device": torch.cuda.get_device_name(), "kept": kept, "rows": []}
    for n in map(int, args.rows.split(",")):
        r = sweep(n, args, kept, hk, hv, dk, dv)
        out["rows"].append(r)
        print(f"rows {n}: floor {r['floor_us']:.1f} us, kept {kept} {r['kept_us']:.1f} us; best:")
        for x in r["results"][:6]:
            print(f"  bv {x['bv']:3d} warps {x['warps']} stages {x['stages']}: {x.get('us', float('nan')):.1f} us "
                  f"({x.get('us', 0) / r['floor_us']:.2f}x floor) max|diff| {x.get('max_abs_diff', float('nan')):.1e}")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
