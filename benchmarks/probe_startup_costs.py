"""What a run's first seconds pay for, item by item, in one fresh process (issue 18): the first CUDA launch of
ATen ops a trainer step uses (lazy module loading, or a PTX JIT where the wheel lacks this GPU's SASS), the
import of torch._dynamo, and the Qwen3 tokenizer's load with its merges as pairs (the released file) and as
"a b" strings. Prints a table; --out writes JSON.

    python benchmarks/probe_startup_costs.py --tokenizer .models/qwen3-tokenizer/tokenizer.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _first_ops() -> dict:
    import torch

    x = torch.randn(4096, 1024, device="cuda")
    return {
        "clamp": lambda: x.clamp(-1, 1), "pow": lambda: x.pow(2), "exp": lambda: x.exp(),
        "minimum": lambda: torch.minimum(x, x), "mul bf16": lambda: x.bfloat16() * 2,
        "index_add_": lambda: torch.zeros(64, 1024, device="cuda").index_add_(
            0, torch.zeros(4096, dtype=torch.long, device="cuda"), x),
        "sum": lambda: x.sum(0), "cumsum": lambda: x.cumsum(0),
    }


def _python_work(seconds: float = 0.3) -> None:
    """GIL-bound work that yields the GIL at the interpreter's switch interval, as imports and launches do."""
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1


def overlap(mode: str) -> None:
    """Whether the first launches of ATen kernels can be paid in a thread while this one runs Python:
    `serial` (the ops, then 0.3 s of Python), `thread` (the ops in a thread meanwhile), `sleep` (the ops in a
    thread while this one sleeps: the ops' own time in a thread)."""
    import threading

    import torch

    torch.ones(1, device="cuda")
    ops = _first_ops()
    torch.cuda.synchronize()

    def launch_all() -> None:
        for op in ops.values():
            op()
        torch.cuda.synchronize()

    t = time.perf_counter()
    if mode == "serial":
        launch_all()
        _python_work()
    else:
        th = threading.Thread(target=launch_all)
        th.start()
        time.sleep(0.3) if mode == "sleep" else _python_work()
        th.join()
    total = time.perf_counter() - t
    again = _timed(launch_all)
    print(f"first launches of {len(ops)} ops and 0.3 s of {'sleep' if mode == 'sleep' else 'Python'}, "
          f"{mode}: {total * 1e3:.1f} ms (the ops again: {again * 1e3:.1f} ms; "
          f"CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', '(default)')})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=".models/qwen3-tokenizer/tokenizer.json")
    ap.add_argument("--out", default=None)
    ap.add_argument("--overlap", choices=["serial", "thread", "sleep"], default=None,
                    help="only: first launches against Python work (see `overlap`; a fresh process each)")
    args = ap.parse_args()
    if args.overlap:
        return overlap(args.overlap)
    rows: list[tuple[str, float]] = []
    rows.append(("import torch", _timed(lambda: __import__("torch"))))
    import torch

    rows.append(("import torch._dynamo", _timed(lambda: __import__("torch._dynamo"))))
    info = {"torch": torch.__version__, "module_loading": os.environ.get("CUDA_MODULE_LOADING", "(default)")}
    if torch.cuda.is_available():
        rows.append(("CUDA init (first tensor)", _timed(lambda: torch.ones(1, device="cuda"))))
        info |= {"arch_list": torch.cuda.get_arch_list(), "capability": torch.cuda.get_device_capability(),
                 "device": torch.cuda.get_device_name()}
        for name, op in _first_ops().items():
            first = _timed(lambda op=op: (op(), torch.cuda.synchronize()))
            again = _timed(lambda op=op: (op(), torch.cuda.synchronize()))
            rows.append((f"first {name} (then {again * 1e3:.2f} ms)", first))
    if os.path.exists(args.tokenizer):
        from tokenizers import Tokenizer

        with open(args.tokenizer, encoding="utf-8") as f:
            text = f.read()
        spec = json.loads(text)
        rows.append(("tokenizer from_file", _timed(lambda: Tokenizer.from_file(args.tokenizer))))
        rows.append(("tokenizer from_str (released)", _timed(lambda: Tokenizer.from_str(text))))
        merges = spec["model"]["merges"]
        if merges and isinstance(merges[0], list) and not any(" " in p for m in merges for p in m):
            spec["model"]["merges"] = [" ".join(m) for m in merges]
            legacy = json.dumps(spec, ensure_ascii=False)
            rows.append(("tokenizer from_str (merges as strings)", _timed(lambda: Tokenizer.from_str(legacy))))
    width = max(len(n) for n, _ in rows)
    print(json.dumps(info))
    for name, s in rows:
        print(f"{name:<{width}}  {s * 1e3:9.1f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"info": info, "rows": {n: s for n, s in rows}, "argv": sys.argv}, f, indent=1)


if __name__ == "__main__":
    main()
