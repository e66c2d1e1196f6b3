"""CUDA graphs for the trainer: one graph per static pack shape replays a whole micro-batch --
forward, log-probs, loss, backward into the gradients, metric sums -- as a single launch.

A compiled trainer step is host-bound (autograd and ~30 compiled regions queue kernels more slowly
than the GPU runs them); a replayed graph costs one launch. What makes it replayable:
- static packs (`packing.pack(static=True)`): every size is a bucket, so a `PackShape` recurs;
- the step's inputs are copied into the graph's own buffers before each replay (`copy_into`);
- the loss divides by tensors (`LossNorm`), so this step's normalisers are read, not baked in;
- gradients live in fixed `.grad` buffers that backward accumulates into in place (never set to None
  while graphs exist); metrics accumulate into a fixed device buffer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from monorl.compile import capture_cuda_graph, clone_tensors, copy_into
from monorl.model.config import ModelConfig

log = logging.getLogger(__name__)


def graph_blocker(cfg: ModelConfig, batch_invariant: bool, flash: bool, experts_grouped: bool,
                  linear_capturable: Callable[[], bool] = lambda: False) -> str | None:
    """Why the trainer's step cannot be a CUDA graph for this model, or None: a step that reads the device on the
    host cannot be captured. flash: the attention backend is flash (the others read lengths on the host);
    experts_grouped: a MoE block's experts run on grouped_mm here (bf16 on sm90+), not per expert;
    linear_capturable: whether fla serves a trainer pack's Gated DeltaNet layers with their backward here
    (`gated_delta_padded.capturable`: the padded sequence, no host read); asked of hybrids only: asking imports fla
    (while every trainer asked, a dense W0 run's trainer_init was 7.24 s on an H100, 0.28 s before, 2026-12-08)."""
    if "linear_attention" in cfg.layer_types and (batch_invariant or not linear_capturable()):
        return ("a hybrid's Gated DeltaNet layers read their sequences' bounds on the host (batch-invariant mode, or "
                "fla not serving their backward: gated_delta.rule_path)")
    if cfg.is_moe and (batch_invariant or not experts_grouped):
        return ("a mixture-of-experts model runs its experts per expert here (grouped_mm: bf16 on sm90+, outside "
                "batch-invariant mode)")
    if not (flash or batch_invariant):
        return "they need attention backend 'flash'"
    return None


class CaptureLog:
    """Captures and their seconds (warm-up passes and capture), read per step as what happened since the last read:
    a step that captures pays an eager warm-up pass and a capture per new pack shape (long-tailed batches keep
    making new shapes: `benchmarks/count_pack_shapes.py`)."""

    def __init__(self) -> None:
        self.captures, self.seconds = 0, 0.0
        self._read = (0, 0.0)

    def add(self, seconds: float) -> None:
        self.captures += 1
        self.seconds += seconds

    def since_last_read(self) -> dict[str, float]:
        n, s = self._read
        self._read = (self.captures, self.seconds)
        return {"trainer/graph_captures": float(self.captures - n), "time/graph_capture_s": self.seconds - s}


def graph_owner(key: tuple) -> str:
    """Whose graph a key names: a frozen forward's keys start with the field it fills (`monorl.train.frozen`), the
    student's step's with its pack shape ("step")."""
    return key[0] if key and isinstance(key[0], str) else "step"


class TrainGraphs:
    """Captured micro-batch graphs keyed by everything the captured work depends on. Each owner (`graph_owner`: the
    student's step, each frozen forward) has its own `max_graphs`: the frozen forwards run first in a step, and on a
    shared budget their graphs took the slots the step's own (the costlier: forward and backward) were left without.
    """

    def __init__(self, params: list[torch.nn.Parameter], device: torch.device, max_graphs: int = 32) -> None:
        self.params, self.device, self.max_graphs = params, device, max_graphs
        self.grads = [torch.zeros_like(p) for p in params]  # fixed gradient buffers the graphs write
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.capture_s = 0.0  # capturing proper; the warm-up passes before each capture in warmup_s
        self.warmup_s = 0.0
        self.log = CaptureLog()  # both, per step
        self.replays = 0
        self._warned_full: set[str] = set()

    def install_grads(self) -> None:
        """Point every `.grad` at the fixed buffers (zeroing them if something else had replaced them,
        e.g. a warm-start optimizer that freed its gradients)."""
        for p, g in zip(self.params, self.grads, strict=True):
            if p.grad is not g:
                g.zero_()
                p.grad = g

    def has(self, key: tuple) -> bool:
        return key in self.graphs

    def count(self, owner: str = "step") -> int:
        return sum(graph_owner(k) == owner for k in self.graphs)

    def new_captures(self, keys: list[tuple]) -> int:
        """How many graphs capturing `keys` (one owner's) would add now: the new keys, up to that owner's room."""
        new = {k for k in keys if k not in self.graphs}
        owner = graph_owner(next(iter(new))) if new else "step"
        return min(len(new), self.max_graphs - self.count(owner))

    def full(self, owner: str = "step") -> bool:
        """Whether `owner` has captured its `max_graphs` (warns once per owner)."""
        full = self.count(owner) >= self.max_graphs
        if full and owner not in self._warned_full:
            log.warning("trainer: %d CUDA graphs captured for %s; further pack shapes run it without graphs",
                        self.max_graphs, owner)
            self._warned_full.add(owner)
        return full

    def capture(self, key: tuple, fn: Callable[..., None], inputs: tuple, reset: Callable[[], None],
                warmup: int = 2) -> None:
        """Warm `fn(*inputs)` up on a side stream `warmup` times (compile, autotune, allocator), capture it with
        private copies of `inputs` as its static buffers, then `reset()` (clears what the warm-up accumulated)."""
        t = time.perf_counter()
        self.install_grads()
        static = clone_tensors(inputs)
        graph, warm_s, _ = capture_cuda_graph(lambda: fn(*static), self.device, self.pool, warmup=warmup)
        reset()
        self.graphs[key] = (graph, static)
        self.warmup_s += warm_s
        self.capture_s += time.perf_counter() - t - warm_s
        self.log.add(time.perf_counter() - t)

    def release(self) -> None:
        """Reset and drop every graph. Under FSDP they hold NCCL kernels, and NCCL's communicator teardown
        (`destroy_process_group`) hangs while such graphs exist (pytorch#115388)."""
        if self.graphs:
            torch.cuda.synchronize(self.device)
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def replay(self, key: tuple, inputs: tuple) -> None:
        graph, static = self.graphs[key]
        copy_into(static, inputs)
        graph.replay()
        self.replays += 1
