"""Run one preset several ways, one after another on this machine, and print a table of how each learned: held-out
greedy pass@1 before and after, the training reward's first and last 10 steps, the entropy and grad norm at a few
steps, and the generator/trainer log-prob gap. For questions like "is the gap to TRL the mode, the seed or the
mismatch?" (#57), where each run is a short CLI process.

    python benchmarks/learn_variants.py --preset gemma3_270m_arith --model FILE.gguf --out DIR \
        --variant "mode s0=--seed 0" --variant "mode s1=--seed 1" \
        --variant "default tis=--batch_invariant false --trainer.loss.rollout_correction.rollout_is token"

Each variant's metrics.jsonl, summary.json and samples.jsonl are copied to DIR/<slug>/, its output to DIR/<slug>.log
(all in DIR/runs.tgz); the table goes to stdout and DIR/table.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AT_STEPS = (1, 2, 5, 10, 20, 50, 100)


def run_variant(name: str, flags: list[str], args: argparse.Namespace) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="learn_variant_")) / "run"
    cmd = [sys.executable, "-m", "monorl.cli", "train", "--preset", args.preset, "--run_dir", str(run_dir),
           "--checkpoint.final", "false", "--checkpoint.every_minutes", "0", "--steps", str(args.steps)]
    if args.model:
        cmd += ["--model.path", args.model]
    cmd += flags
    t0 = time.perf_counter()
    log = args.out / f"{slug(name)}.log"
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    dest = args.out / slug(name)
    dest.mkdir(parents=True, exist_ok=True)
    out = {"name": name, "rc": rc, "wall_s": wall, "flags": flags}
    for f in ("metrics.jsonl", "summary.json", "samples.jsonl"):
        if (run_dir / f).exists():
            (dest / f).write_bytes((run_dir / f).read_bytes())
    if not (run_dir / "summary.json").exists():
        return out
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step" in r and "reward" in r]
    rew = [r["reward"] for r in rows]
    out.update(pre=(summary.get("pre") or {}).get("pass_at_k"), post=(summary.get("post") or {}).get("pass_at_k"),
               steps=len(rows), first10=sum(rew[:10]) / max(1, len(rew[:10])),
               last10=sum(rew[-10:]) / max(1, len(rew[-10:])),
               diff_max=max((r.get("logprob_diff_max", 0.0) for r in rows), default=None),
               at={s: (rows[s - 1].get("entropy"), rows[s - 1].get("grad_norm"), rows[s - 1]["reward"])
                   for s in AT_STEPS if s <= len(rows)})
    return out


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def table(results: list[dict]) -> str:
    lines = ["| variant | rc | steps | pass@1 pre | pass@1 post | reward first/last 10 | logprob_diff max | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        f = (lambda v, p=3: "-" if v is None else f"{v:.{p}f}")
        lines.append(f"| {r['name']} | {r['rc']} | {r.get('steps', '-')} | {f(r.get('pre'))} | {f(r.get('post'))} | "
                     f"{f(r.get('first10'))} / {f(r.get('last10'))} | {f(r.get('diff_max'), 4)} | {r['wall_s']:.1f} |")
    lines += ["", "entropy / grad_norm / reward at step " + ", ".join(map(str, AT_STEPS)) + ":"]
    for r in results:
        cells = [f"{s}: {e:.3f}/{g:.2f}/{w:.2f}" for s, (e, g, w) in r.get("at", {}).items()
                 if e is not None and g is not None]
        lines.append(f"- {r['name']}: " + "; ".join(cells))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", required=True)
    ap.add_argument("--model", default=None, help="--model.path for every variant")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--variant", action="append", required=True, help='"NAME=FLAGS" (monorl train flags)')
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a variant may run")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    results = []
    for v in args.variant:
        name, _, flags = v.partition("=")
        results.append(run_variant(name.strip(), shlex.split(flags), args))
        print(f"{name}: rc {results[-1]['rc']} post {results[-1].get('post')} ({results[-1]['wall_s']:.0f} s)",
              flush=True)
    text = table(results)
    (args.out / "table.md").write_text(text + "\n")
    # one archive of the runs' files (a device call brings back only a few files)
    subprocess.run(["tar", "czf", str(args.out / "runs.tgz"), "-C", str(args.out),
                    *[p for r in results for p in (slug(r["name"]), f"{slug(r['name'])}.log")]], check=False)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(text)


if __name__ == "__main__":
    main()
