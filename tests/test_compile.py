"""Steady state compiles nothing: after warm-up, RL steps with varying rollout lengths trigger no recompile."""

import pytest
import torch

from monorl.compile import CompileConfig, compile_counters
from monorl.config import preset
from monorl.rl.loop import GRPORun


def _cfg(tmp_path, backend: str):
    cfg = preset("tiny")
    cfg.run_dir = str(tmp_path / "run")
    cfg.warm_start.steps = 3
    cfg.validation.num_prompts = 4
    cfg.rollout.prompts_per_step, cfg.rollout.group_size = 3, 4
    cfg.compile = CompileConfig(backend=backend, cache_dir=str(tmp_path / "cache"))
    return cfg


def test_compile_config_validation():
    with pytest.raises(ValueError, match="compile.backend"):
        CompileConfig(backend="tvm")
    with pytest.raises(ValueError, match="needs compile.backend=inductor"):
        CompileConfig(backend="eager", mode="max-autotune")
    with pytest.raises(ValueError, match="kernel_compile_threads"):
        CompileConfig(kernel_compile_threads=-1)


def test_no_recompiles_in_steady_state(tmp_path):
    torch._dynamo.reset()
    run = GRPORun(_cfg(tmp_path, "aot_eager"), progress=False)
    run.warm_up()
    run.warm_start()
    run.validate()
    run.step(0)
    run.step(1)
    before = compile_counters()
    assert before["frames_compiled"] > 0  # the blocks really are compiled
    lengths = set()
    torch._dynamo.config.error_on_recompile = True
    try:
        for step in range(2, 6):
            row = run.step(step)
            lengths.add(round(row["completions/mean_length"], 3))
        run.validate()
    finally:
        torch._dynamo.config.error_on_recompile = False
    after = compile_counters()
    assert len(lengths) > 1  # rollout lengths (so pack shapes) really varied
    assert after["frames_compiled"] == before["frames_compiled"]
    assert after["unique_graphs"] == before["unique_graphs"]
    assert after["graph_breaks"] == before["graph_breaks"]
