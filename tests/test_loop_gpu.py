"""The whole loop on CUDA: bf16 generator with CUDA graphs + compiled blocks, flash varlen trainer."""

import math

import pytest
import torch

from monorl.compile import CompileConfig, compile_counters
from monorl.distributed.weight_sync import weight_pairs
from monorl.run.grpo import GRPORun
from tests.conftest import digits_cfg

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["none", "inductor"])
def test_loop_on_gpu(tmp_path, backend):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # the digits user task: reward signal from a random model; 4 steps, the 4th checked for steady state (a run
    # makes batches for its configured steps only: asking for a 4th of 3 found the rollout buffer empty)
    cfg = digits_cfg(tmp_path, steps=4)
    cfg.device = "cuda"
    cfg.compile = CompileConfig(backend=backend, cache_dir=str(tmp_path / "cache"))
    run = GRPORun(cfg, progress=False)
    assert run.attn_backend == "flash"
    run.warm_up()
    before = [p.detach().clone() for p in run.policy.parameters()]
    rows = [run.step(s) for s in range(3)]
    counters = compile_counters()
    rows.append(run.step(3))
    assert compile_counters()["frames_compiled"] == counters["frames_compiled"]  # steady state: no compile
    assert any(not torch.equal(a, b) for a, b in zip(before, run.policy.parameters(), strict=True))
    for r in rows:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
        # bf16 generator vs bf16-autocast trainer on the same weights: close, not bitwise
        assert r["logprob_diff_mean"] < 0.05
    # the generator's bf16 weights (fused projections) are the trainer's fp32 masters, rounded
    for name, view, p in weight_pairs(run.generator.model, run.policy):
        assert torch.equal(view, p.detach().to(torch.bfloat16)), name


def test_loop_batch_invariant_with_trainer_graphs(tmp_path):
    """--batch_invariant true under the Qwen3 presets' compile policy (inductor + trainer CUDA graphs): the
    attention backward runs inside the captured graphs (it once read lengths on the host and crashed the
    capture), every micro-batch replays a graph, and generator log-probs equal the trainer's bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = digits_cfg(tmp_path)
    cfg.device, cfg.batch_invariant = "cuda", True
    cfg.compile = CompileConfig(backend="inductor", trainer_cuda_graphs=True, cache_dir=str(tmp_path / "cache"))
    run = GRPORun(cfg, progress=False)
    run.warm_up()
    rows = [run.step(s) for s in range(3)]
    stats = run.trainer_graph_stats()
    assert stats is not None and stats["replays"] >= 3
    for r in rows:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
        assert r["logprob_diff_max"] == 0.0


def test_kernels_compiled_ahead_cover_the_warm_up(tmp_path, monkeypatch):
    """The preset's path (batch-invariant, no compile, trainer CUDA graphs): the traced passes find the Triton
    kernels the warm-ups launch, `compile_ahead` compiles them in threads, and the warm-ups then compile none
    at a launch; the steps that follow are bitwise (generator log-probs equal the trainer's). A second run loads
    the list the first kept instead of tracing, and covers the warm-up as well."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import threading

    from triton import knobs

    from monorl.run import startup
    from monorl.speedups.precompile import COMPILE_THREADS, _NoLaunch, monorl_kernels

    monkeypatch.setattr(startup, "specs_path", lambda key: tmp_path / "specs" / f"{key}.json")
    kernels = monorl_kernels()
    for kept in (False, True):
        for k in kernels:
            k.device_caches.clear()  # what earlier runs compiled in this process: the pass must find all
        cfg = digits_cfg(tmp_path / f"kept_{kept}")
        cfg.device, cfg.batch_invariant = "cuda", True
        cfg.compile = CompileConfig(backend="none", trainer_cuda_graphs=True, kernel_compile_threads=4)
        run = GRPORun(cfg, progress=False)
        at_launch = []
        before = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = lambda *, repr, at_launch=at_launch, **_: None if (
            threading.current_thread().name.startswith(COMPILE_THREADS)) else at_launch.append(repr)  # main, autograd's
        try:
            run.warm_up()
        finally:
            knobs.runtime.jit_post_compile_hook = before
        assert run.startup["kernel_compile_s"] > 0
        assert (run.startup["kernel_trace_s"] == 0.0) == kept  # the second run traced nothing
        assert len(list((tmp_path / "specs").glob("*[0-9a-f].json"))) == 1
        assert len(list((tmp_path / "specs").glob("*.aten.json"))) == 1  # the trainer pass's ATen ops
        assert ("aten_preload_wait_s" in run.startup) == kept  # the second run launched them ahead
        assert at_launch == []
        left = [key for k in kernels for cache, *_ in k.device_caches.values() for key in cache.values()
                if isinstance(key, _NoLaunch)]
        assert left == []  # the recording's stand-ins are all gone
        rows = [run.step(s) for s in range(2)]
        for r in rows:
            assert math.isfinite(r["loss"]) and r["logprob_diff_max"] == 0.0


def test_recording_skips_kernels_compiled_before():
    """Inside `recording()` a monorl kernel this process compiled earlier is skipped as well (launched, it would
    read what skipped kernels left: garbage indices crashed the GPU tests once), and it is back after."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from monorl.ops.entropy import _entropy_kernel
    from monorl.speedups.precompile import recording

    x = torch.randn(3, 1000, device="cuda")
    out = torch.full((3,), -1.0, device="cuda")
    launch = lambda: _entropy_kernel[(3,)](x, out, 1000, x.stride(0), 1.0, BLOCK_V=2048, num_warps=8)  # noqa: E731
    launch()  # compiled and run
    expected = out.clone()
    assert (expected > 0).all()
    out.fill_(-1.0)
    with recording() as rec:
        launch()
    assert [fn for fn, _ in rec.specs] == [_entropy_kernel]
    assert (out == -1.0).all()  # skipped
    launch()
    assert torch.equal(out, expected)  # the compiled kernel is back
