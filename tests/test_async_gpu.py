"""Bounded staleness on CUDA: the producer running ahead and in-flight weight updates with the generator's CUDA
graphs and the trainer's (the trainer step runs inside `Generator.generate`, between decode chunks, on the same
stream; the weights are published in place, so the captured graphs read the new ones)."""

import math

import pytest
import torch

from monorl.compile import CompileConfig
from monorl.distributed.weight_sync import weight_pairs
from monorl.run.grpo import GRPORun
from tests.conftest import digits_cfg

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("inflight", [False, True])
def test_staleness_one_on_gpu(tmp_path, inflight):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = digits_cfg(tmp_path, steps=4)
    cfg.device = "cuda"
    cfg.compile = CompileConfig(backend="inductor", trainer_cuda_graphs=True, cache_dir=str(tmp_path / "cache"))
    cfg.rollout.max_staleness, cfg.rollout.inflight_updates = 1, inflight
    run = GRPORun(cfg, progress=False)
    run.warm_up()
    rows = [run.step(s) for s in range(4)]
    for r in rows:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
        assert r["staleness/max"] <= 1
    assert [r["staleness/max"] for r in rows][1:] == [1, 1, 1]  # batches 1.. were made one version back
    if inflight:  # the batch made during a trainer step took the new weights partway: token lag below 1
        assert all(r["staleness/token_mean"] < 1 for r in rows[1:])
    # after the last step the generator holds the trainer's weights (published in place)
    for name, view, p in weight_pairs(run.generator.model, run.policy):
        assert torch.equal(view, p.detach().to(torch.bfloat16)), name
