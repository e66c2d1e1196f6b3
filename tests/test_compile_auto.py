"""compile.backend auto: inductor only when the run's steps pay for the compile, judged by whether the compile
cache already holds this configuration's code (a marker written after a compiled warm-up)."""

from __future__ import annotations

from pathlib import Path

import torch

from monorl.cliargs import run_config
from monorl.compile_auto import (
    COLD_COMPILE_S,
    SAVED_PER_STEP_S,
    SAVED_PER_STEP_S_BATCH_INVARIANT,
    WARM_COMPILE_S,
    auto_backend,
    compile_key,
    mark_compiled,
)
from monorl.run.grpo import GRPORun

CUDA = torch.device("cuda")  # a device object only: auto_backend reads its type, no GPU needed


def test_auto_compiles_when_the_steps_pay_for_it(tmp_path: Path) -> None:
    key = compile_key({"model": "a"})
    cold_even, warm_even = COLD_COMPILE_S / SAVED_PER_STEP_S, WARM_COMPILE_S / SAVED_PER_STEP_S
    assert warm_even < 10 * 3 < cold_even  # 30 steps: compile with a warm cache only
    assert auto_backend(10, CUDA, tmp_path, key)[0] == "none"  # the reference's 10 steps, cold cache
    assert auto_backend(30, CUDA, tmp_path, key)[0] == "none"
    assert auto_backend(int(cold_even) + 1, CUDA, tmp_path, key)[0] == "inductor"
    mark_compiled(tmp_path, key, 38.9)
    backend, why = auto_backend(30, CUDA, tmp_path, key)
    assert backend == "inductor" and "warm compile cache" in why
    assert auto_backend(10, CUDA, tmp_path, key)[0] == "none"  # even warm, 10 steps do not pay
    other = compile_key({"model": "b"})  # another shape: its cache is cold
    assert other != key and auto_backend(30, CUDA, tmp_path, other)[0] == "none"
    assert compile_key({"model": "a"}) == key
    assert auto_backend(10_000, torch.device("cpu"), tmp_path, key)[0] == "none"
    # batch-invariant mode: compiling saves nothing per step (the trainer runs the same Triton kernels either way),
    # so no step count pays for it, warm cache or cold
    assert SAVED_PER_STEP_S_BATCH_INVARIANT == 0.0
    for k in (key, other):
        backend, why = auto_backend(10_000, CUDA, tmp_path, k, batch_invariant=True)
        assert backend == "none" and "batch-invariant" in why


def test_auto_resolves_before_the_run_and_is_recorded(tmp_path: Path) -> None:
    cfg = run_config("tiny", {"compile.backend": "auto", "compile.cache_dir": str(tmp_path / "cache"),
                              "run_dir": str(tmp_path / "run"), "steps": "1"})
    run = GRPORun(cfg, progress=False)
    assert run.cfg.compile.backend == "none" and not run.cfg.compile.enabled  # on CPU (resolved before the plan)
    assert '"backend": "none"' in (tmp_path / "run" / "config.json").read_text()


def test_the_kernel_list_of_one_seed_serves_another(monkeypatch):
    """The kept Triton specialisation list (`run_kernels_key`) is shared by a run's seeds, not by other settings."""
    import sys
    import types

    from monorl.compile_auto import run_kernels_key
    from monorl.model.config import model_shape
    from monorl.presets import preset

    if "triton" not in sys.modules:  # the key reads only Triton's version (CPU CI has no Triton)
        monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.6.0"))
    a, b = preset("tiny"), preset("tiny")
    b.seed = a.seed + 1
    m, traced = model_shape("gemma3-270m"), {"trainer": True, "generator": True}
    assert run_kernels_key(a, m, 1, traced) == run_kernels_key(b, m, 1, traced)
    b.rollout.group_size += 1
    assert run_kernels_key(a, m, 1, traced) != run_kernels_key(b, m, 1, traced)
