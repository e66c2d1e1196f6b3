"""Several ranks on CPU (gloo, FSDP2), against one: a 2-rank run's per-step metrics and final weights equal the
1-rank run's on the same global batch; its sharded (DCP) checkpoint resumes on one process; its HF export loads
in transformers; two "nodes" (two torchrun launchers over a localhost rendezvous) run the same step; a job
torchrun restarts after a rank died resumes from its last checkpoint (the 2-rank run above is such a job); without
restarts the job ends, naming the dead rank.

Tolerance: the ranks' gradients are summed in another order than one rank accumulates them (fp32), so trainer
metrics agree to rtol 1e-4 (atol 1e-6) and weights to atol 1e-4 after 2 AdamW steps at lr 1e-3 (AdamW moves a
weight by ~lr whatever its gradient's size, so a near-zero gradient's last bits can move it by a fraction of
lr); what the rollouts decide (completions, rewards, lengths) is equal exactly, as sampling is keyed by the
prompt group's index in the whole batch."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from monorl.cliargs import run_config
from monorl.distributed.world import World
from monorl.distributed.world_fit import check_world
from monorl.run.elastic import DIE_ENV
from monorl.run.grpo import GRPORun, train
from tests.test_resume import killed_copy

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = {
    "device": "cpu", "steps": "2", "task.name": "tests.conftest:DigitsTask", "warm_start.steps": "0",
    "validation.num_prompts": "2", "rollout.prompts_per_step": "4", "rollout.group_size": "4",
    "rollout.max_new_tokens": "8", "trainer.lr": "1e-3", "checkpoint.every": "1", "checkpoint.keep_last": "2",
    "samples_per_step": "2", "distributed.timeout_s": "60",
}
RTOL, ATOL, WEIGHT_ATOL = 1e-4, 1e-6, 1e-4
ROLLOUT_KEYS = ("reward", "reward_std", "rewards/", "completions/", "frac_reward_zero_std", "num_tokens",
                "train_tokens")


def cli_args(run_dir: Path, **extra: str) -> list[str]:
    return [a for k, v in {**OVERRIDES, "run_dir": str(run_dir), **extra}.items() for a in (f"--{k}", v)]


def env() -> dict[str, str]:
    # one thread per rank (torchrun's default too): the 2-core CI machine runs two ranks at once
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}


def run(cmd: list[str], timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=kw.pop("env", env()), capture_output=True, text=True,
                          timeout=timeout, **kw)


def step_rows(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # timings differ run to run; micro-batches are counted over ranks (each rank packs its own share)
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "micro_batches"))}
            for r in rows if "step" in r]


def assert_tp_rows_close(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """`assert_rows_close` for a run with tensor-parallel generation: its generator's log-probs move in their last
    bits (the row-parallel sums split K), so the log-prob mismatch metrics only have to stay below 1e-4."""
    for rows in (got, want):
        for row in rows:
            for k in [k for k in row if k.startswith("logprob_diff")]:
                assert row.pop(k) < 1e-4, k
    assert_rows_close(got, want)


def assert_rows_close(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want, strict=True):
        assert set(g) == set(w)
        for k, v in w.items():
            if isinstance(v, float) and not k.startswith(ROLLOUT_KEYS):
                assert math.isclose(g[k], v, rel_tol=RTOL, abs_tol=ATOL), (g["step"], k, g[k], v)
            else:
                assert g[k] == v, (g["step"], k, g[k], v)


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / "final" / "model.safetensors")


def assert_weights_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= WEIGHT_ATOL, worst
    assert any(not torch.equal(a[k], b[k]) for k in a) or worst == 0.0


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """In-process runs on one thread, as each rank runs (a loaded 2-core machine crawls with more)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("one") / "run"
    train(run_config("tiny", {**OVERRIDES, "run_dir": str(d)}), progress=False)
    return d


@pytest.fixture(scope="module")
def two_ranks_restarted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """The 2-rank run, as a job torchrun restarts once: rank 1 dies after step 1's checkpoint (first attempt
    only), the restarted job resumes there. (One launch serves the equality and the restart tests.)"""
    d = tmp_path_factory.mktemp("two") / "run"
    r = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             "--max-restarts", "1", "-m", "monorl.cli", "train", *cli_args(d)], env={**env(), DIE_ENV: "1:1"})
    assert r.returncode == 0, r.stderr[-4000:]
    return d, r


@pytest.fixture(scope="module")
def two_ranks(two_ranks_restarted: tuple[Path, subprocess.CompletedProcess]) -> Path:
    return two_ranks_restarted[0]


def test_two_ranks_equal_one_rank(one_rank: Path, two_ranks: Path) -> None:
    assert_rows_close(step_rows(two_ranks), step_rows(one_rank))  # step 2 ran after the restart
    assert_weights_close(weights(two_ranks), weights(one_rank))
    meta = json.loads((two_ranks / "checkpoints" / "step_000002" / "meta.json").read_text())
    assert (meta["storage"], meta["world_size"]) == ("dcp", 2)
    # startup ends when the slowest rank is ready: rank 0's wait for the others is part of it
    startup = json.loads((two_ranks / "summary.json").read_text())["startup"]
    assert startup["rank_wait_s"] >= 0 and "rank_wait_s" not in json.loads(
        (one_rank / "summary.json").read_text())["startup"]


def test_sharded_checkpoint_resumes_on_one_process(two_ranks: Path, tmp_path: Path) -> None:
    d = tmp_path / "run"
    killed_copy(two_ranks, d, 1)  # as if killed after step 1's checkpoint
    cfg = run_config("tiny", {**OVERRIDES, "run_dir": str(d)})
    GRPORun(cfg, progress=False, resume=d / "checkpoints" / "step_000001").run()
    assert_rows_close(step_rows(d), step_rows(two_ranks))  # step 1 kept, step 2 recomputed on one process
    assert_weights_close(weights(d), weights(two_ranks))


def test_hf_export_loads_in_transformers(one_rank: Path, two_ranks: Path) -> None:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(two_ranks / "checkpoints" / "final")
    ours = weights(one_rank)
    theirs = {k: v for k, v in model.state_dict().items() if k in ours}
    assert_weights_close(theirs, ours)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-rank run as two "nodes": two torchrun launchers of one rank each, over a localhost rendezvous."""
    d = tmp_path_factory.mktemp("nodes") / "run"
    port = free_port()
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
         "--node_rank", str(i), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-id", f"monorl-test-{port}", "-m", "monorl.cli", "train", *cli_args(d)],
        cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=120) for p in launchers]
    assert [p.returncode for p in launchers] == [0, 0], [o[1][-3000:] for o in outs]
    return d


def test_two_nodes_over_localhost_rendezvous(one_rank: Path, two_nodes: Path) -> None:
    assert_rows_close(step_rows(two_nodes), step_rows(one_rank))
    assert_weights_close(weights(two_nodes), weights(one_rank))


def test_restarted_job_resumes_from_last_checkpoint(
        two_ranks_restarted: tuple[Path, subprocess.CompletedProcess]) -> None:
    d, r = two_ranks_restarted
    assert "failed (exitcode: 3) local_rank: 1" in r.stderr, r.stderr[-3000:]  # the first attempt lost rank 1
    assert f"resumed from {d / 'checkpoints' / 'step_000001'} at step 1/2" in r.stdout, r.stdout
    # rank 0 alone prints; step 1 ran once (first attempt), step 2 once (after the restart)
    assert r.stdout.count("step 1/2 |") == 1 and r.stdout.count("step 2/2 |") == 1, r.stdout
    assert [row["step"] for row in step_rows(d)] == [0, 1]  # the metrics log has each step once



def test_restarted_job_equals_uninterrupted_one(two_ranks: Path, two_nodes: Path) -> None:
    """Deterministic resume: the restarted job's metrics and weights equal, bit for bit, those of the same two
    ranks run without interruption (the two "nodes" run)."""
    assert step_rows(two_ranks) == step_rows(two_nodes)
    a, b = weights(two_ranks), weights(two_nodes)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_dead_rank_ends_the_job_naming_it(tmp_path: Path) -> None:
    t = time.perf_counter()
    r = run([sys.executable, "-m", "monorl.cli", "train", "--nproc", "2",
             *cli_args(tmp_path / "run", steps="2")], env={**env(), DIE_ENV: "1:1"})
    assert r.returncode == 1
    assert "monorl: error: rank 1 failed first (exit code 3)" in r.stderr, r.stderr[-3000:]
    assert time.perf_counter() - t < 100


def test_hung_rank_times_out_the_job(tmp_path: Path) -> None:
    """A rank that hangs (not dead: torchrun sees nothing wrong) makes the others fail at their next collective
    after distributed.timeout_s, and torchrun then ends the job: never a hang."""
    t = time.perf_counter()
    r = run([sys.executable, "-m", "monorl.cli", "train", "--nproc", "2",
             *cli_args(tmp_path / "run", steps="1", **{"distributed.timeout_s": "3"})],
            env={**env(), DIE_ENV: "1:1:hang"})
    assert r.returncode == 1
    assert "Timed out" in r.stderr and "monorl: error: rank 0 failed first" in r.stderr, r.stderr[-3000:]
    assert time.perf_counter() - t < 100


def test_rank_count_must_divide_the_prompts(tmp_path: Path) -> None:
    cfg = run_config("tiny", {**OVERRIDES, "run_dir": str(tmp_path)})
    check_world(cfg, World(rank=1, size=2))
    with pytest.raises(ValueError, match=r"prompts_per_step=4 does not divide over 3 ranks"):
        check_world(cfg, World(rank=0, size=3))


def test_shares_cover_every_item_once() -> None:
    for size in (1, 2, 3, 4):
        for n in (0, 1, 5, 8):
            spans = [World(rank=r, size=size).share(n) for r in range(size)]
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
            assert max(hi - lo for lo, hi in spans) - min(hi - lo for lo, hi in spans) <= 1


def test_tensor_parallel_generation_in_the_loop(one_rank: Path, tmp_path: Path) -> None:
    """--generator.tensor_parallel_size 2 on 2 ranks: both ranks hold half of the generator's copy and generate the
    step's groups together (FSDP2 trains); the run equals the 1-rank run as the 2-rank run does, except that the
    generator's log-probs move in their last bits (the row-parallel sums split K), so the log-prob mismatch
    metrics are compared with a tolerance of their own."""
    d = tmp_path / "run"
    r = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             "-m", "monorl.cli", "train", *cli_args(d, **{"generator.tensor_parallel_size": "2"})])
    assert r.returncode == 0, r.stderr[-4000:]
    assert_tp_rows_close(step_rows(d), step_rows(one_rank))
    assert_weights_close(weights(d), weights(one_rank))


def one_and_two_ranks(tmp_path: Path, extra: dict[str, str]) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """The tiny run with `extra` in this process (one rank) and under torchrun on 2 gloo ranks: both run dirs, and
    the 2-rank launch (checked to have succeeded)."""
    one = tmp_path / "one"
    train(run_config("tiny", {**OVERRIDES, **extra, "run_dir": str(one)}), progress=False)
    two = tmp_path / "two"
    r = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             "-m", "monorl.cli", "train", *cli_args(two, **extra)], timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return one, two, r


def test_lora_batch_invariant_two_ranks_equal_one_rank(tmp_path: Path) -> None:
    """LoRA in batch-invariant mode on 2 ranks: the generator's copy (separate adapters beside the frozen base) is
    built from the FSDP shards once the policy is sharded, not shared with the unsharded policy; the run equals the
    1-rank run, and the generator's log-probs equal the trainer's at every step, as on one rank."""
    one, two, _ = one_and_two_ranks(tmp_path, {"lora.rank": "4", "lora.alpha": "8", "batch_invariant": "true",
                                               "checkpoint.every": "0", "rollout.max_new_tokens": "4"})
    got, want = step_rows(two), step_rows(one)
    assert [row["logprob_diff_max"] for row in got] == [0.0] * len(got) == [row["logprob_diff_max"] for row in want]
    assert_rows_close(got, want)


def test_a_sharded_teacher_two_ranks_equal_one_rank(tmp_path: Path) -> None:
    """Distillation under FSDP: the teacher is sharded over the trainer ranks as the policy is (a block gathered at
    a time in its forward, every rank running as many); the 2-rank run's teacher/kl, losses and weights equal the
    1-rank run's, where the teacher is whole."""
    from tests.test_distillation import save_tiny

    teacher = save_tiny(tmp_path / "teacher", seed=1)
    one, two, r = one_and_two_ranks(tmp_path, {"teacher.path": str(teacher), "trainer.loss.kind": "token_grpo",
                                               "checkpoint.every": "0", "rollout.max_new_tokens": "4"})
    assert "teacher: sharded over the 2 trainer ranks" in r.stdout
    assert "(1/2: sharded; two blocks gathered at a time)" in r.stdout  # the plan's teacher row
    got, want = step_rows(two), step_rows(one)
    assert all(row["teacher/kl"] != 0.0 for row in want)
    assert_rows_close(got, want)
    assert_weights_close(weights(two), weights(one))
