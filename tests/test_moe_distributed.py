"""A tiny Qwen3-MoE on two ranks (gloo, FSDP2: each block one unit, its stacked experts sharded on the expert dim)
against one rank: the same per-step metrics and final weights (tests/test_distributed.py's tolerances), and the
2-rank HF export has the per-expert names transformers reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from monorl.cliargs import run_config
from monorl.rl.loop import train
from tests.test_distributed import (
    OVERRIDES,
    assert_rows_close,
    assert_weights_close,
    cli_args,
    run,
    step_rows,
    weights,
)

# (no load-balancing loss: it is a function of each micro-batch's tokens together, and ranks pack other micro-batches)
MOE = {"model.shape": "tiny-moe", "checkpoint.every": "0"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_two_ranks_equal_one_rank(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    train(run_config("tiny", {**OVERRIDES, **MOE, "run_dir": str(one)}), progress=False)
    r = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             "-m", "monorl.cli", "train", *cli_args(two, **MOE)], timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert_rows_close(step_rows(two), step_rows(one))
    assert_weights_close(weights(two), weights(one))
    with safe_open(two / "checkpoints" / "final" / "model.safetensors", "pt") as f:
        assert "model.layers.1.mlp.experts.7.down_proj.weight" in f.keys()
