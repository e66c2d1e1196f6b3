"""The one compile policy for trainer and generator: backend, mode, regional per-block compile,
CUDA graphs, and the persistent compile cache. The only caller of `torch.compile` in monorl.

Regional compile: each `TransformerBlock` is compiled on its own. All blocks share one code object
and their parameters are graph inputs, so Dynamo traces one block once and every layer reuses it:
compile time does not grow with depth.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from monorl.speedups.private_apis import (
    compilation_time_metrics,
    dynamo_counters,
    dynamo_imported,
    enable_compile_caches,
    maybe_mark_dynamic,
)

CompileBackend = Literal["none", "eager", "aot_eager", "inductor", "auto"]
COMPILE_BACKENDS: tuple[str, ...] = get_args(CompileBackend)


@dataclass
class CompileConfig:
    # torch.compile backend; none: eager PyTorch, no compile; auto: inductor when the run's steps pay for the
    # compile, else none (monorl/compile_auto.py)
    backend: CompileBackend = "none"
    mode: str | None = None  # torch.compile mode for inductor (e.g. "max-autotune-no-cudagraphs")
    regional: bool = True  # compile each TransformerBlock, not the whole model
    decode_cuda_graphs: bool = True  # capture the generator's decode step (CUDA only)
    trainer_cuda_graphs: bool = False  # replay each trainer micro-batch (fwd+bwd) from a graph per pack shape (CUDA)
    generator: bool = True  # compile the generator's blocks (and sampler), unless it runs the fused Triton kernels
    trainer: bool = True  # compile the trainer's blocks
    eager_step_s: float | None = None  # a measured eager RL step time: the run then reports compile break-even
    cache_dir: str | None = None  # persistent Inductor/AOTAutograd cache; default ~/.cache/monorl/torch_compile
    # monorl's Triton kernels for the warm-ups compiled ahead in this many threads (monorl.speedups.precompile);
    # 0: one per CPU core (shared by a node's ranks, at most 16); 1: none ahead, each at its first launch
    kernel_compile_threads: int = 0
    # CUDA start-up speed-ups (monorl/rl/startup.py): Triton's cache key in a child process, monorl's kernels
    # compiled ahead in threads, an earlier run's ATen kernels replayed in a thread; false: each at first launch
    startup_speedups: bool = True

    def __post_init__(self) -> None:
        if self.backend not in COMPILE_BACKENDS:
            raise ValueError(f"compile.backend must be one of {COMPILE_BACKENDS}, got {self.backend!r}")
        if self.kernel_compile_threads < 0:
            raise ValueError(f"compile.kernel_compile_threads must be >= 0, got {self.kernel_compile_threads}")
        if self.mode is not None and self.backend not in ("inductor", "auto"):
            raise ValueError(f"compile.mode={self.mode!r} needs compile.backend=inductor")

    @property
    def enabled(self) -> bool:
        return self.backend not in ("none", "auto")  # auto is resolved by the RL loop before anything compiles

    @property
    def cache_path(self) -> Path:
        """The persistent compile cache directory."""
        return Path(self.cache_dir or Path.home() / ".cache" / "monorl" / "torch_compile").expanduser()


def setup_compile_cache(cfg: CompileConfig) -> Path | None:
    """Point Inductor's FX-graph and AOTAutograd caches at a persistent directory, so a second run of
    the same preset loads compiled kernels instead of compiling them."""
    if not cfg.enabled:
        return None
    path = cfg.cache_path
    path.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(path))
    os.environ.setdefault("TRITON_CACHE_DIR", str(path / "triton"))
    enable_compile_caches()
    # AOTAutograd's cache (torch._functorch.config.enable_autograd_cache) is on by default and shares the dir
    return path


def compile_blocks(model: torch.nn.Module, cfg: CompileConfig) -> float:
    """Apply `torch.compile` to every TransformerBlock (regional) or the whole forward. Returns the
    seconds spent wrapping (the real compile happens lazily at first call)."""
    if not cfg.enabled:
        return 0.0
    t = time.perf_counter()
    kw: dict = {"backend": cfg.backend}
    if cfg.mode:
        kw["mode"] = cfg.mode
    if cfg.regional:
        for layer in model.model.layers:
            layer.compile(**kw)
    else:
        model.compile(**kw)
    return time.perf_counter() - t


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether any part of `model` runs under torch.compile (`compile_blocks`: the blocks or the whole model)."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


def compile_generator(model: torch.nn.Module, sample: Callable, cfg: CompileConfig, device: torch.device,
                      decode_backend: str, fused_kernels: bool = False) -> tuple[Callable, bool]:
    """Every compile decision for a generator's model, in one place. Returns (the sampler to call, whether
    decode steps replay CUDA graphs).
    - `compile.generator`: its blocks are compiled as `compile_blocks` says (the trainer's are, separately, under
      `compile.trainer`); so is the sampler, on CUDA with Inductor only: compiled it is a few fused kernels
      instead of ~30 passes over [B, vocab], while elsewhere the eager sampler costs little next to the model.
      Not a copy on the fused Triton kernels (`fused_kernels`, `monorl.model.fused_kernels`): its blocks are GEMMs
      and those kernels, and its sampler is one, so Inductor has nothing left to fuse (decode step 2.20 ms
      uncompiled vs 2.24 ms compiled, Qwen3-0.6B, H200) and would only add its compile time.
    - `compile.decode_cuda_graphs`: on CUDA with the triton decode kernel only. A graph reads its block tables'
      full width every step, and only that kernel's cost does not grow with the width."""
    sampler = sample
    if cfg.enabled and cfg.generator and not fused_kernels:
        compile_blocks(model, cfg)
        if device.type == "cuda" and cfg.backend == "inductor":
            sampler = torch.compile(sample, dynamic=True)
    graphs = cfg.decode_cuda_graphs and device.type == "cuda" and decode_backend == "triton"
    return sampler, graphs


# ---- dynamic sizes --------------------------------------------------------------------------------------
# Token counts, sequence counts, prompt lengths and decode batch sizes change every call. Marking those
# dimensions dynamic up front makes Dynamo compile one graph for any size, instead of a static graph first and
# a dynamic one at the first other size. What marking cannot do: Dynamo still specialises a dimension that is
# 0 or 1 when first seen (and one compiled for sizes >= 2 recompiles at size 1). So nothing compiled should see
# a size-1 dimension, and each place that could avoids it:
# - decode batch buckets start at 2 (`generate.runner.graph_buckets`); one live sequence runs in the bucket of 2;
# - the first-token sampler gets at least 2 rows (`Generator._admit_round` repeats a lone row, then drops it);
# - the RL loop's warm-up prefills two prompts of different lengths (`GRPORun.warm_up`), so the first real
#   prefill of several prompts is not a new shape class;
# - the trainer's warm-up runs two packs that differ in every size (`Trainer.warm_up`).

def mark_dynamic(*tensors: Tensor, dims: tuple[int, ...] | None = None) -> None:
    """Mark `dims` (default: every dimension) of each tensor dynamic for torch.compile (Dynamo's
    `maybe_mark_dynamic`: a hint, never an error; a no-op in eager code). See the notes above. Inside code Dynamo
    is tracing (a whole-model compile reaches the contexts built in forward) it does nothing: Dynamo refuses to
    trace the call, and the graph's inputs were marked where they entered."""
    # Nothing imported torch._dynamo yet: nothing is compiled in this process, and importing it here would cost
    # ~1 s of a run that compiles nothing (torch.compile imports it first, so compiled runs still get the hints).
    if torch.compiler.is_compiling() or not dynamo_imported():
        return
    for t in tensors:
        for d in range(t.dim()) if dims is None else dims:
            maybe_mark_dynamic(t, d)


# ---- CUDA graphs ------------------------------------------------------------------------------------------

def capture_cuda_graph(fn: Callable[[], Any], device: torch.device, pool: Any,
                       warmup: int = 2) -> tuple[torch.cuda.CUDAGraph, float, float]:
    """Run `fn()` `warmup` times on a side stream (compile, autotune and the allocator settle outside the
    capture), then capture one call into a graph drawing on the memory `pool`. The caller resets whatever
    the warm-up calls changed. Returns (graph, warm-up seconds, capture seconds)."""
    t0 = time.perf_counter()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    torch.cuda.synchronize(device)
    return graph, t1 - t0, time.perf_counter() - t1


def copy_into(dst: Any, src: Any) -> None:
    """Copy src's tensors into dst's (same structure: dataclasses, tuples, tensors; other values equal)."""
    if isinstance(dst, Tensor):
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"static buffer {tuple(dst.shape)} {dst.dtype} vs {tuple(src.shape)} {src.dtype}")
        dst.copy_(src, non_blocking=True)
    elif dataclasses.is_dataclass(dst):
        for f in dataclasses.fields(dst):
            copy_into(getattr(dst, f.name), getattr(src, f.name))
    elif isinstance(dst, tuple | list):
        for d, s in zip(dst, src, strict=True):
            copy_into(d, s)
    elif dst != src and not isinstance(dst, int | float):  # ints/floats that differ are host-side counts
        raise ValueError(f"static value {dst!r} differs from {src!r}")


def clone_tensors(x: Any) -> Any:
    """A copy of x with every tensor cloned (dataclasses, tuples, lists; other values shared): a graph's static
    inputs."""
    if isinstance(x, Tensor):
        return x.clone()
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: clone_tensors(getattr(x, f.name)) for f in dataclasses.fields(x)
                                         if f.init})
    if isinstance(x, tuple | list):
        return type(x)(clone_tensors(v) for v in x)
    return x


def compile_counters() -> dict[str, int]:
    """Dynamo's frame counters: 'ok' frames compiled, and recompiles/graph breaks seen so far (all 0 in a process
    that never imported Dynamo: nothing compiled, and importing it to say so costs ~1 s)."""
    if not (counters := dynamo_counters()):
        return {"frames_compiled": 0, "unique_graphs": 0, "graph_breaks": 0, "recompiles": 0}
    return {
        "frames_compiled": int(counters["frames"]["ok"]),
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "recompiles": int(sum(v for k, v in counters["recompiles"].items())) if "recompiles" in counters else 0,
    }


def compile_phase_times(top: int = 12) -> dict[str, Any]:
    """Where compile time went: seconds per Dynamo/AOT/Inductor phase (summed over frames, largest first)
    and each frame's total compile time in order (`frames_s`); empty where Dynamo was never imported."""
    if not dynamo_imported():
        return {"phases_s": {}, "frames_s": []}
    metrics = compilation_time_metrics()
    sums = {k: sum(v) for k, v in metrics.items()}
    phases = dict(sorted(sums.items(), key=lambda kv: -kv[1])[:top])
    frames = metrics.get("_compile.compile_inner", [])
    return {"phases_s": {k: round(v, 3) for k, v in phases.items()}, "frames_s": [round(t, 3) for t in frames]}
