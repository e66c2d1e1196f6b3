"""Steady state compiles nothing: after warm-up, RL steps with varying rollout lengths trigger no recompile."""

import pytest
import torch

from monorl.compile import CompileConfig, compile_counters
from monorl.presets import preset
from monorl.run.grpo import GRPORun


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


def test_a_kept_kernel_list_that_cannot_be_read_is_skipped(tmp_path, capsys):
    """`monorl.speedups.precompile.load_specs`: no list -> None, silently; a damaged one -> None with a line naming it
    (the run then traces, as with none). The GPU test `test_kernels_compiled_ahead_cover_the_warm_up` loads a
    list a run kept."""
    from monorl.speedups.precompile import load_specs

    assert load_specs(tmp_path / "none.json") is None
    assert capsys.readouterr().out == ""
    bad = tmp_path / "bad.json"
    bad.write_text('[{"module": "monorl.ops.matmul_inv', encoding="utf-8")  # cut off mid-write
    assert load_specs(bad) is None
    assert f"skipping the kernel list {bad}" in capsys.readouterr().out
    bad.write_text('[{"module": "monorl.ops.matmul_invariant", "name": "bi_mm", "spec": "{}"}]', encoding="utf-8")
    assert load_specs(bad) is None  # not a Triton kernel (or, without Triton, no Triton)
    assert f"skipping the kernel list {bad}" in capsys.readouterr().out


def test_keeping_a_kernel_list_never_fails_the_run(tmp_path, capsys):
    """`save_specs` writes the list whole (JSON, no temporary file left) and, where it cannot write, says so in a
    line instead of raising: the list only saves the next run its trace."""
    import json
    import types

    from monorl.speedups.precompile import Recorded, save_specs

    kernel = types.SimpleNamespace(module="monorl.ops.matmul_invariant")
    kernel.__name__ = "_mm_kernel"
    rec = Recorded(specs=[(kernel, '{"key": 1}')])
    path = tmp_path / "specs" / "k.json"
    save_specs(path, rec)
    assert json.loads(path.read_text()) == [{"module": "monorl.ops.matmul_invariant", "name": "_mm_kernel",
                                             "spec": '{"key": 1}'}]
    assert [p.name for p in path.parent.iterdir()] == ["k.json"]
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    save_specs(blocked / "k.json", rec)  # its parent is a file: no directory can be made there
    assert "could not keep the kernel list" in capsys.readouterr().out


def test_triton_key_from_the_child_process_is_tritons_own(monkeypatch):
    """`TritonKeyPrefetch`: the key a child process computed is installed only when it is the one this process'
    Triton would compute (same Triton file, not computed here yet); otherwise Triton's own function stays."""
    pytest.importorskip("triton")
    import functools

    from triton.runtime import cache

    from monorl.speedups.precompile import TritonKeyPrefetch

    original = getattr(cache.triton_key, "__wrapped__", cache.triton_key)
    expected = original()
    monkeypatch.setattr(cache, "triton_key", functools.lru_cache()(original))  # nothing computed yet
    other = TritonKeyPrefetch.CODE.replace("print(triton.__file__)", "print('/elsewhere/triton/__init__.py')")
    monkeypatch.setattr(TritonKeyPrefetch, "CODE", other)
    assert not TritonKeyPrefetch().adopt()  # a child that saw another Triton
    assert cache.triton_key.cache_info().currsize == 0
    monkeypatch.undo()
    monkeypatch.setattr(cache, "triton_key", functools.lru_cache()(original))
    prefetch = TritonKeyPrefetch()
    assert prefetch.adopt() and cache.triton_key() == expected
    assert cache.triton_key.cache_info().hits == 0  # the installed function: its value came from the child
    assert not prefetch.adopt()  # once only

