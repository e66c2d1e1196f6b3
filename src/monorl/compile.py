"""The one compile policy for trainer and generator: backend, mode, regional per-block compile,
CUDA graphs, and the persistent compile cache.

Regional compile: each `TransformerBlock` is compiled on its own. All blocks share one code object
and their parameters are graph inputs, so Dynamo traces one block once and every layer reuses it:
compile time does not grow with depth.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

COMPILE_BACKENDS = ("none", "eager", "aot_eager", "inductor")


@dataclass
class CompileConfig:
    backend: str = "none"  # none | eager | aot_eager | inductor
    mode: str | None = None  # torch.compile mode for inductor (e.g. "max-autotune-no-cudagraphs")
    regional: bool = True  # compile each TransformerBlock, not the whole model
    decode_cuda_graphs: bool = True  # capture the generator's decode step (CUDA only)
    trainer_cuda_graphs: bool = False  # replay each trainer micro-batch (fwd+bwd) from a graph per pack shape (CUDA)
    generator: bool = True  # compile the generator's blocks (and sampler)
    trainer: bool = True  # compile the trainer's blocks
    eager_step_s: float | None = None  # a measured eager RL step time: the run then reports compile break-even
    cache_dir: str | None = None  # persistent Inductor/AOTAutograd cache; default ~/.cache/monorl/torch_compile

    def __post_init__(self) -> None:
        if self.backend not in COMPILE_BACKENDS:
            raise ValueError(f"compile.backend must be one of {COMPILE_BACKENDS}, got {self.backend!r}")
        if self.mode is not None and self.backend != "inductor":
            raise ValueError(f"compile.mode={self.mode!r} needs compile.backend=inductor")

    @property
    def enabled(self) -> bool:
        return self.backend != "none"


def setup_compile_cache(cfg: CompileConfig) -> Path | None:
    """Point Inductor's FX-graph and AOTAutograd caches at a persistent directory, so a second run of
    the same preset loads compiled kernels instead of compiling them."""
    if not cfg.enabled:
        return None
    path = Path(cfg.cache_dir or Path.home() / ".cache" / "monorl" / "torch_compile").expanduser()
    path.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(path))
    os.environ.setdefault("TRITON_CACHE_DIR", str(path / "triton"))
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    # One block's code serves trainer (grad, autocast) and generator (prefill, decode) of two model
    # copies: more variants than Dynamo's default limit of 8, past which it silently runs eager.
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(getattr(dynamo_config, "recompile_limit", 8), 64)
    if hasattr(inductor_config, "autograd_cache"):
        inductor_config.autograd_cache = True
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


def compile_counters() -> dict[str, int]:
    """Dynamo's frame counters: 'ok' frames compiled, and recompiles/graph breaks seen so far."""
    from torch._dynamo.utils import counters

    return {
        "frames_compiled": int(counters["frames"]["ok"]),
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "recompiles": int(sum(v for k, v in counters["recompiles"].items())) if "recompiles" in counters else 0,
    }


def compile_phase_times(top: int = 12) -> dict[str, Any]:
    """Where compile time went: seconds per Dynamo/AOT/Inductor phase (summed over frames, largest first)
    and each frame's total compile time in order (`frames_s`)."""
    from torch._dynamo.utils import compilation_time_metrics

    sums = {k: sum(v) for k, v in compilation_time_metrics.items()}
    phases = dict(sorted(sums.items(), key=lambda kv: -kv[1])[:top])
    frames = compilation_time_metrics.get("_compile.compile_inner", [])
    return {"phases_s": {k: round(v, 3) for k, v in phases.items()}, "frames_s": [round(t, 3) for t in frames]}
