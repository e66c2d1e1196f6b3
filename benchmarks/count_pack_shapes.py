"""How many trainer CUDA graphs a workload asks for: the distinct graph keys (`Trainer._graph_key`: the static pack
shape, the step's sequence count, KL on or off, the temperature) that each rank's micro-batches have, step by step.
Each new key costs the trainer an eager warm-up pass and a capture (and under FSDP every rank runs as many warm-up
passes as the rank with the most new keys); past `TrainGraphs.max_graphs` (32) a new key runs eager. A count, on
CPU, no model: the packing code the trainer runs, on the sequences a step would hand it.

Workload (defaults: bench_async.py's): the task's real prompts (sum_digits) through a real tokenizer, 64 prompts x 8,
completion lengths drawn per sample as `benchmarks/async_worker.py` draws them (lognormal, median 128, sigma 1,
clipped to [32, 1024]); `--fixed N` gives every completion N tokens instead (bench_scale's rows).

    python benchmarks/count_pack_shapes.py --tokenizer ../shared/models/qwen3-tokenizer --ranks 1,2,4 --steps 16
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_worker import LengthDraw  # noqa: E402 -- the benchmarks' length draw

from monorl.model.hf_checkpoint import load_tokenizer  # noqa: E402
from monorl.presets import preset  # noqa: E402
from monorl.rl.rollouts.rollout import encode_prompts  # noqa: E402
from monorl.task_registry import load_task  # noqa: E402
from monorl.tasks.stream import PromptStream  # noqa: E402
from monorl.train.packing import (  # noqa: E402
    TrainSequence,
    covering_shape,
    make_micro_batches,
    token_buckets,
    token_share,
)

MAX_GRAPHS = 32  # TrainGraphs' default


def step_sequences(prompt_ids: list[list[int]], group: int, lengths: LengthDraw | int, max_new: int
                   ) -> list[TrainSequence]:
    out = []
    for g, ids in enumerate(prompt_ids):
        for j in range(group):
            n = lengths if isinstance(lengths, int) else lengths.length(ids, j, max_new)
            out.append(TrainSequence(ids, [7] * n, [0.0] * n, 0.0, group=g))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json (the Qwen3 tokenizer)")
    ap.add_argument("--task", default="sum_digits")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--fixed", type=int, default=None, help="every completion this long (no draw)")
    ap.add_argument("--micro-batch-tokens", type=int, default=None, help="default: the preset's")
    ap.add_argument("--preset", default="qwen3_0_6b_sum_digits")
    ap.add_argument("--slack", type=float, default=None,
                    help="trainer.graph_pad_slack (default: the preset's): a new pack padded to a captured shape")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = preset(a.preset)
    mbt = a.micro_batch_tokens or cfg.trainer.micro_batch_tokens
    slack = cfg.trainer.graph_pad_slack if a.slack is None else a.slack
    tok = load_tokenizer(Path(a.tokenizer))
    task = load_task(a.task)
    stream = PromptStream(task, cfg.seed)
    lengths: LengthDraw | int = a.fixed if a.fixed is not None else LengthDraw(a.max_new_tokens / 8, 1.0, 32)
    steps = []
    for _ in range(a.steps):
        prompts = list(itertools.islice(stream, a.prompts))
        _, ids = encode_prompts(task, tok, prompts, 10**9, a.max_new_tokens)
        steps.append(step_sequences(ids, a.group, lengths, a.max_new_tokens))
    buckets = token_buckets(mbt)
    rows = []
    for ranks in (int(r) for r in a.ranks.split(",")):
        seen: list[set] = [set() for _ in range(ranks)]  # every key a rank's micro-batches had
        captured: list[set] = [set() for _ in range(ranks)]  # those it captured (at most MAX_GRAPHS)
        per_step, warmups, eager = [], [], []
        for seqs in steps:
            new, uncaptured = [], 0
            for r in range(ranks):
                share = token_share(seqs, r, ranks)
                def cover(mb, have=captured[r]):  # the trainer's `_cover`: a captured shape that holds the pack
                    return None if slack <= 0 else covering_shape(mb.shape, [k[0] for k in have], slack, mbt)

                mbs = make_micro_batches(seqs, mbt, "cpu", buckets=buckets, static=True, indices=share, cover=cover)
                keys = [(mb.shape, len(seqs), False, 1.0) for mb in mbs]
                fresh = list(dict.fromkeys(k for k in keys if k not in captured[r]))
                take = fresh[:max(0, MAX_GRAPHS - len(captured[r]))]
                new.append(len(take))
                captured[r] |= set(take)
                seen[r] |= set(keys)
                uncaptured += sum(k not in captured[r] for k in keys)
            per_step.append(new)
            warmups.append(max(new))  # FSDP: every rank runs the most warm-up passes any rank runs
            eager.append(uncaptured)
        rows.append({"ranks": ranks, "new_keys_per_step": per_step, "warmup_passes_per_step": warmups,
                     "eager_micro_batches_per_step": eager, "distinct_keys_per_rank": [len(s) for s in seen]})
    print(f"micro_batch_tokens {mbt}, graph_pad_slack {slack}; {a.prompts} prompts x {a.group}; lengths "
          f"{'fixed ' + str(a.fixed) if a.fixed is not None else 'drawn (median 128, sigma 1, [32, 1024])'}")
    print(f"\n| ranks | distinct keys per rank ({a.steps} steps) | captures per step, the busiest rank | "
          "steps with no capture | micro-batches run eager (past the graph limit), all ranks |")
    print("|---|---|---|---|---|")
    for r in rows:
        w = r["warmup_passes_per_step"]
        print(f"| {r['ranks']} | {', '.join(map(str, r['distinct_keys_per_rank']))} | {', '.join(map(str, w))} | "
              f"{sum(x == 0 for x in w)} of {len(w)} | {sum(r['eager_micro_batches_per_step'])} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"micro_batch_tokens": mbt, "graph_pad_slack": slack, "fixed": a.fixed,
                                           "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
