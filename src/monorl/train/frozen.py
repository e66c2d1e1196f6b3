"""A frozen model's log-probs of a step's completion tokens: the KL reference's (`MicroBatch.ref_logprobs`) and the
distillation teacher's (`MicroBatch.teacher_logprobs`; monorl.train.teacher).

They come from a forward over the student's own micro-batches, after packing, and stay on the device: no second
packing, no host round trip of the log-probs. Where the student's step replays CUDA graphs, each pack shape's
frozen forward replays one too (a forward alone: one launch for the eager forward's hundreds), in the trainer's pool,
keyed by the field it fills (its own budget of graphs beside the step's), so the reference's and the teacher's
graphs never share a key. The KL reference is a full copy on every rank; the teacher is sharded over the trainer
ranks as the policy is (its forward gathers a block at a time: every rank runs as many, on the padded micro-batches
the trainer's step gives each rank; eagerly, not from graphs)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from monorl.distributed.fsdp import is_sharded

# the MicroBatch fields a frozen forward fills: what a frozen forward computes, never an input of one
FROZEN_FIELDS = ("ref_logprobs", "teacher_logprobs")


def fill_frozen_logprobs(trainer: Any, model: torch.nn.Module, mbs: list[Any], field: str, temperature: float
                         ) -> Callable[[], float]:
    """Set `field` (one of FROZEN_FIELDS) of each of this rank's micro-batches `mbs` (in place: each replaced by a
    copy) to `model`'s log-probs of its completion tokens ([N] fp32, on the device). Returns what reads its seconds,
    the GPU's work included: on CUDA two events, read after the step's own metrics sync (no sync of its own)."""
    if field not in FROZEN_FIELDS:
        raise ValueError(f"a frozen forward fills one of {', '.join(FROZEN_FIELDS)}, got {field!r}")
    if trainer.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t = time.perf_counter()
    for i, mb in enumerate(mbs):
        mbs[i] = dataclasses.replace(mb, **{field: frozen_forward(trainer, model, mb, field, temperature)})
    if trainer.device.type != "cuda":
        seconds = time.perf_counter() - t
        return lambda: seconds
    end.record()
    return lambda: (end.synchronize(), start.elapsed_time(end) / 1e3)[1]


@torch.no_grad()
def frozen_forward(trainer: Any, model: torch.nn.Module, mb: Any, field: str, temperature: float) -> Tensor:
    """`model`'s log-probs of one micro-batch's completion tokens ([N] fp32, on the device), for its `field`. Where
    the student's step replays graphs, so does this: a graph per (field, pack shape: its image grids included,
    temperature) in the trainer's pool, its output copied out of the graph's buffer; else eagerly."""
    graphs = trainer.graphs
    # a sharded teacher's forward runs eagerly: its all-gathers were never captured on GPUs (no multi-GPU machine
    # ran it), and an eager forward costs launches, not correctness
    if graphs is None or graphs.full(field) or is_sharded(model):
        return trainer.response_logprobs(model, mb, temperature)
    # the frozen fields are never its inputs (whichever forward ran first, or a warm-up's zeros): one graph per key
    mb = dataclasses.replace(mb, **dict.fromkeys(FROZEN_FIELDS))
    key = (field, mb.shape, float(temperature))
    if not graphs.has(key):
        out = torch.empty(mb.targets.shape, dtype=torch.float32, device=trainer.device)
        graphs.capture(key, lambda m: out.copy_(trainer.response_logprobs(model, m, temperature)), (mb,),
                       reset=lambda: None, warmup=1)
        trainer.frozen_out[key] = out
    graphs.replay(key, (mb,))
    return trainer.frozen_out[key].clone()  # the next pack of this shape replays into the same buffer
