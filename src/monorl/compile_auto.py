"""`compile.backend auto`: compile only when the run's steps pay for the compile (`auto_backend`; the choice is
made by `monorl.assembly.resolve_config`, with the other `auto` settings).

On the reference workload (Qwen3-0.6B, 10 steps of 5 x 8 rollouts, one H200, real tokenizer; benchmarks/RESULTS.md,
2026-11-23, after the generator moved to fused Triton kernels) only the trainer is compiled: the generator's decode
step is as fast without Inductor (`monorl.compile.compile_generator`). Compiling the trainer costs ~19 s of startup
with a cold compile cache (trainer warm-up 19.5 s vs 0.9 s eager) and ~2.5 s with a warm one (3.0 vs 0.9 s, plus
the compiler's imports), and saves ~0.13 s per RL step (steady step 0.39 vs 0.52 s). In batch-invariant mode, the
Qwen3 presets' default for full fine-tuning, it saves nothing since the block kernels got fused backward kernels
(2026-11-24: steady step 0.42 s compiled vs 0.41 s with CUDA graphs alone, trainer 1.44 vs 1.43 s per 10 steps: both
run the same Triton kernels, which Inductor cannot fuse into), so `auto` does not compile there. Otherwise it pays
after ~150 steps cold and ~20 warm; the reference's 10 steps finish first without it. Larger
models save more per step for about the same compile time (one block is compiled, whatever the depth), so these
constants err towards not compiling them.

Whether the cache is warm is known from a marker monorl writes into the compile cache directory once a compiled
warm-up has finished, keyed by everything that changes the compiled code: the model's shape, dtypes, the compile
and graph settings, the torch version, the GPU and the source of monorl's model, generation, training and kernel
code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from monorl.config import RunConfig
    from monorl.model.config import ModelConfig

COLD_COMPILE_S = 19.0
WARM_COMPILE_S = 2.5
SAVED_PER_STEP_S = 0.13
SAVED_PER_STEP_S_BATCH_INVARIANT = 0.0
_CODE_DIRS = ("model", "generate", "train", "ops")  # the code Inductor compiles
_MARKERS = "monorl_compiled"


def compile_key(parts: dict[str, Any]) -> str:
    """A short hash of `parts` (JSON-able settings), torch's version, the device's name and monorl's code."""
    src = Path(__file__).parent
    code = hashlib.sha256()
    for d in _CODE_DIRS:
        for f in sorted((src / d).rglob("*.py")):
            code.update(f.name.encode() + f.read_bytes())
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    blob = json.dumps({**parts, "torch": torch.__version__, "device": device, "code": code.hexdigest()},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def warm_marker(cache_dir: Path, key: str) -> Path:
    return cache_dir / _MARKERS / f"{key}.json"


def mark_compiled(cache_dir: Path, key: str, compile_s: float) -> None:
    """Record that `key`'s compiled code is in `cache_dir` (after a compiled warm-up finished)."""
    path = warm_marker(cache_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"compile_s": compile_s}) + "\n", encoding="utf-8")


def auto_backend(steps: int, device: torch.device, cache_dir: Path, key: str,
                 batch_invariant: bool = False) -> tuple[str, str]:
    """(the backend `auto` runs: "inductor" or "none", a line saying why). CUDA graphs are on either way."""
    if device.type != "cuda":
        return "none", "compile.backend auto -> none: compiling is not measured to pay off on CPU"
    warm = warm_marker(cache_dir, key).is_file()
    cost = WARM_COMPILE_S if warm else COLD_COMPILE_S
    saved = SAVED_PER_STEP_S_BATCH_INVARIANT if batch_invariant else SAVED_PER_STEP_S
    if saved <= 0:
        return "none", ("compile.backend auto -> none: in batch-invariant mode compiling was measured to save nothing "
                        "per step (Qwen3-0.6B, H200: the trainer runs the same Triton kernels either way); "
                        "--compile.backend inductor compiles anyway")
    even = cost / saved
    backend = "inductor" if steps >= even else "none"
    return backend, (f"compile.backend auto -> {backend}: {steps} steps against a break-even of ~{even:.0f} "
                     f"({'warm' if warm else 'cold'} compile cache: ~{cost:.0f} s to compile, ~{saved} s "
                     "saved per step, as measured for Qwen3-0.6B on an H200; --compile.backend inductor or none "
                     "decides it yourself)")


def run_compile_key(cfg: RunConfig, m: ModelConfig) -> str:
    """`compile_key` of a run: the model's shape and every setting that changes the code compiled for it."""
    cc = cfg.compile
    compiled = {k: v for k, v in cc.__dict__.items() if k not in ("backend", "eager_step_s", "cache_dir")}
    return compile_key({"model": dataclasses.asdict(m), "compile": compiled, "batch_invariant": cfg.batch_invariant,
                        "lora": cfg.lora.__dict__, "dtype": str(cfg.trainer.compute_dtype),
                        "attn": cfg.model.attn_backend})


def run_kernels_key(cfg: RunConfig, m: ModelConfig, world_size: int, traced: dict[str, bool]) -> str:
    """`compile_key` of the Triton specialisations a run's warm-ups launch (`monorl.speedups.precompile`'s kept list):
    `run_compile_key`'s parts, the settings that set the warm-ups' shapes (prompts, rollouts, generator, packing),
    the ranks, the passes traced and Triton's version. Not the seed: it picks which of the task's prompts the
    warm-ups take, whose lengths a run's steps vary anyway, so another seed's list serves (a kernel it lacks
    compiles at its first launch, as without a list); a run's second seed then skips the trace (~4 s of a Gemma 3
    270M run's 11 s start-up, H100)."""
    import triton

    return compile_key({"run": run_compile_key(cfg, m), "task": dataclasses.asdict(cfg.task),
                        "rollout": dataclasses.asdict(cfg.rollout), "generator": dataclasses.asdict(cfg.generator),
                        "trainer": dataclasses.asdict(cfg.trainer), "world": world_size, "traced": traced,
                        "triton": triton.__version__})


def run_aten_key(cfg: RunConfig, m: ModelConfig, world_size: int) -> str:
    """`compile_key` of the ATen ops a run's traced warm-ups launch (`monorl.speedups.preload`'s kept list): taken
    before the models exist, so `run_kernels_key`'s parts but the passes traced (a stale list costs only its
    misses), and torch's version."""
    return compile_key({"kernels": run_kernels_key(cfg, m, world_size, {}), "torch": torch.__version__})
