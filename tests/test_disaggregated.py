"""The disaggregated placement through the whole loop, on CPU (gloo, torchrun): one generator rank and two FSDP2
trainer ranks (`--placement.generator_ranks 1 --nproc 3`).

- K = 0 (on-policy) equals the 1-rank run, as the colocated 2-rank run does (tests/test_distributed.py, same
  tolerances): the generator rank makes every group of the step, sampling is keyed by the group's index in the
  whole batch, and the trainers are the 2-rank run's FSDP2 pair (here with shares that split a prompt group: 3
  groups over 2 trainers); so the rollouts are equal exactly and the weights and trainer metrics agree up to the
  order of the gradient sum. (Compared against one rank, not the colocated
  2-rank run, which itself equals one rank within these tolerances: one launch fewer.)
- K = 1 (in-flight updates on), as a job torchrun restarts after trainer rank 1 died after step 1's checkpoint:
  every sample's lag is <= 1, the resumed job draws exactly the prompts the uninterrupted run draws, and the
  generator's final weights equal the trainers' HF export (its weight sum, logged on the last metrics row).
- a dead generator rank ends the job naming it; bad placements are refused in one line before any process starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from monorl.cli import main
from monorl.cliargs import run_config
from monorl.distributed.placement import PlacementSection
from monorl.distributed.world import World
from monorl.distributed.world_fit import check_world
from monorl.run.elastic import DIE_ENV
from monorl.run.grpo import train
from tests.test_distributed import OVERRIDES, assert_rows_close, assert_weights_close, cli_args, env, run, step_rows

STEPS = "3"
# 3 prompt groups of 4: the 2 trainers' shares split a group (12 sequences, 6 each); every rollout is in
# samples.jsonl (its prompt)
OVER = {**OVERRIDES, "steps": STEPS, "samples_per_step": "16", "rollout.prompts_per_step": "3"}
DISAGG = {"placement.generator_ranks": "1", "steps": STEPS, "samples_per_step": "16", "rollout.prompts_per_step": "3"}


def torchrun(run_dir: Path, *extra: str, die: str = "", **overrides: str) -> subprocess.CompletedProcess:
    """1 generator + 2 trainers; die "RANK:STEP": that rank exits after that step (`DIE_ENV`)."""
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3", *extra,
                "-m", "monorl.cli", "train", *cli_args(run_dir, **{**DISAGG, **overrides})],
               env={**env(), DIE_ENV: die} if die else env())


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    d = tmp_path_factory.mktemp("one") / "run"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(run_config("tiny", {**OVER, "run_dir": str(d)}), progress=False)
    finally:
        torch.set_num_threads(n)
    return d


@pytest.fixture(scope="module")
def on_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("k0") / "run"
    r = torchrun(d)
    assert r.returncode == 0, r.stderr[-4000:]
    return d


@pytest.fixture(scope="module")
def one_ahead_restarted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """K = 1, trainer rank 1 dies after step 1's checkpoint (first attempt only); the restarted job resumes. With
    in-flight updates (the generator polls for an update between decode chunks; whether one lands mid-generation
    depends on timing) and a validation every 2 steps (the generators validate, the trainers log it)."""
    d = tmp_path_factory.mktemp("k1") / "run"
    r = torchrun(d, "--max-restarts", "1", die="1:1", **{
        "rollout.max_staleness": "1", "rollout.inflight_updates": "true", "validation.every": "2"})
    assert r.returncode == 0, r.stderr[-4000:]
    return d, r


def weights(run_dir: Path) -> dict[str, Any]:
    return load_file(run_dir / "checkpoints" / "final" / "model.safetensors")


def prompts_by_step(run_dir: Path) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["step"], []).append(row["prompt"])
    return out


def last_row(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def test_on_policy_equals_one_rank(one_rank: Path, on_policy: Path) -> None:
    got, want = step_rows(on_policy), step_rows(one_rank)
    assert_rows_close(got, want)
    assert_weights_close(weights(on_policy), weights(one_rank))
    assert last_row(on_policy)["validation/post"] == last_row(one_rank)["validation/post"]  # the generator's
    meta = json.loads((on_policy / "checkpoints" / "step_000003" / "meta.json").read_text())
    assert (meta["storage"], meta["world_size"], meta["data_position"]) == ("dcp", 2, 9)  # the trainers'


def test_one_step_ahead_lags_at_most_one_version(one_ahead_restarted: tuple[Path, Any]) -> None:
    d, _ = one_ahead_restarted
    rows = step_rows(d)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(0 <= r["staleness/max"] <= 1 and 0 <= r["staleness/mean"] <= 1 for r in rows)
    assert rows[0]["staleness/max"] == 0  # the first batch: the weights the run starts with
    assert all(r["staleness/token_mean"] <= r["staleness/mean"] for r in rows)  # tokens are no older than samples
    assert rows[1]["val/policy_version"] == 2 and "val/pass@1" in rows[1]  # after step 2: the weights it made
    assert not any(k.startswith("val/") for k in rows[0]) and not any(k.startswith("val/") for k in rows[2])
    times = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert all(r["time/producer_idle_s"] >= 0 and r["time/consumer_idle_s"] >= 0 for r in times if "step" in r)


def test_generator_ends_with_the_trainers_weights(one_ahead_restarted: tuple[Path, Any]) -> None:
    d, _ = one_ahead_restarted
    final = last_row(d)
    export = weights(d)
    assert final["generator/final_version"] == int(STEPS)
    want = sum(t.double().sum().item() for t in export.values())
    assert math.isclose(final["generator/weight_sum"], want, rel_tol=1e-12, abs_tol=1e-9), (final, want)


def test_resumed_job_draws_the_uninterrupted_runs_prompts(one_rank: Path,
                                                           one_ahead_restarted: tuple[Path, Any]) -> None:
    d, r = one_ahead_restarted
    assert "failed (exitcode: 3) local_rank: 1" in r.stderr, r.stderr[-3000:]
    assert f"resumed from {d / 'checkpoints' / 'step_000001'} at step 1/3" in r.stdout, r.stdout
    assert r.stdout.count("step 2/3 |") == 1 and r.stdout.count("step 3/3 |") == 1, r.stdout
    assert prompts_by_step(d) == prompts_by_step(one_rank)
    assert len(prompts_by_step(d)[2]) == 12


def test_dead_generator_ends_the_job_naming_it(tmp_path: Path) -> None:
    r = run([sys.executable, "-m", "monorl.cli", "train", "--nproc", "3",
             *cli_args(tmp_path / "run", **{**DISAGG, "steps": "2"})], env={**env(), DIE_ENV: "2:1"})
    assert r.returncode == 1
    assert "monorl: error: rank 2 failed first (exit code 3)" in r.stderr, r.stderr[-3000:]


@pytest.mark.parametrize("nproc, g, prompts, words", [
    (2, 2, 4, "placement.generator_ranks=2 leaves no trainer among 2 ranks"),
    (1, 1, 4, "placement.generator_ranks=1 needs several processes"),
    (4, 3, 4, "prompts_per_step=4 does not divide over the 3 generator rank(s)"),
    (5, 2, 3, "prompts_per_step=3 does not divide over the 2 generator rank(s)"),
])
def test_bad_placements_refused_before_any_process(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                   nproc: int, g: int, prompts: int, words: str) -> None:
    args = cli_args(tmp_path / "run", **{"placement.generator_ranks": str(g),
                                         "rollout.prompts_per_step": str(prompts)})
    assert main(["train", "--nproc", str(nproc), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err, err
    assert not (tmp_path / "run").exists()
    cfg = run_config("tiny", {**OVERRIDES, "placement.generator_ranks": "1", "run_dir": str(tmp_path)})
    check_world(cfg, World(rank=0, size=4))  # 4 prompts over 1 generator; 3 trainers take uneven shares


def test_plan_shows_a_generator_gpu_and_a_trainer_gpu(tmp_path: Path) -> None:
    from monorl.plan import GiB
    from monorl.plan_report import plan_report

    cfg = run_config("tiny", {**OVERRIDES, "placement.generator_ranks": "1", "run_dir": str(tmp_path)})
    text, fits = plan_report(cfg, 80 * GiB, ranks=3)
    assert fits
    gen, trainer = text.split("a generator GPU (1 of 3")[1].split("a trainer GPU (2 of 3, FSDP2 over them)")
    assert "KV cache" in gen and "generator weights" in gen and "optimizer state" not in gen
    assert "(1/2: sharded)" in trainer and "KV cache" not in trainer and "generator weights" not in trainer
    colocated, _ = plan_report(dataclasses.replace(cfg, placement=PlacementSection()), 80 * GiB, ranks=2)
    assert "(1/2: sharded)" in colocated and "KV cache" in colocated and "a trainer GPU" not in colocated


@pytest.mark.parametrize("inflight", [False, True])
def test_reward_failing_on_the_generator_stops_the_trainers_with_a_checkpoint(tmp_path: Path, inflight: bool) -> None:
    """As colocated (tests/test_cli_errors.py): the steps that ran are kept, the summary says why the run stopped;
    in flight the generator makes continuous batches, and the failure comes from the batch it takes."""
    d = tmp_path / "run"
    r = torchrun(d, **{"task.name": "tests.test_cli_errors:AlwaysFails", "steps": "6", "checkpoint.every": "0",
                       "rollout.max_staleness": "1", "rollout.inflight_updates": str(inflight).lower()})
    assert r.returncode == 1
    assert "the reward failed on every completion of 3 steps in a row" in r.stderr, r.stderr[-3000:]
    assert [row["step"] for row in step_rows(d)] == [0, 1]
    assert (d / "checkpoints" / "step_000002" / "meta.json").is_file()
    assert "failed on every completion" in json.loads((d / "summary.json").read_text())["stopped"]


@pytest.mark.parametrize("inflight", [False, True])
def test_two_generators_one_step_ahead(tmp_path: Path, inflight: bool) -> None:
    """G = 2 (2 generators + 2 trainers, K = 1): each generator makes its share of every step's groups, the two
    agree on when to take an update (a small all-reduce among them), and the trainers take the step whole: the run
    finishes, every sample is at most one version old, and the generators end with the trainers' weights. With
    in-flight updates the two agree at every decode chunk (`InflightUpdates`), the one done first keeping its part
    until the other is done: a chunk boundary without its partner would hang the job."""
    d = tmp_path / "run"
    # in flight: long generations (400 tokens, EOS ignored; sum_digits, whose reward never raises) so that the
    # trainers publish while the generators decode (on this box token lag 0.64 against 1.0; not asserted: timing)
    # in flight the generators make continuous batches (`rl.rollouts.continuous`); a validation after step 2 drains
    # their engines first, the two together
    long = {"rollout.max_new_tokens": "400", "rollout.ignore_eos": "true", "generator.max_model_len": "512",
            "task.name": "sum_digits", "validation.every": "2"} if inflight else {}
    r = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
             "-m", "monorl.cli", "train", *cli_args(d, **{**DISAGG, "placement.generator_ranks": "2",
                                                        "rollout.prompts_per_step": "4",
                                                        "rollout.max_staleness": "1",
                                                        "rollout.inflight_updates": str(inflight).lower(), **long})])
    assert r.returncode == 0, r.stderr[-4000:]
    rows = step_rows(d)
    assert [row["step"] for row in rows] == list(range(int(STEPS)))
    if inflight:  # whether an update lands mid-generation depends on timing
        assert rows[0]["staleness/max"] == 0 and all(0 <= row["staleness/max"] <= 1 for row in rows)
        assert all(row["staleness/token_mean"] <= row["staleness/mean"] for row in rows)
    else:
        assert [row["staleness/max"] for row in rows] == [0, 1, 1]
    assert all(math.isfinite(row["loss"]) for row in rows)
    if inflight:  # the generators' validation with the weights step 2 published
        assert rows[1]["val/policy_version"] == 2
    assert len(prompts_by_step(d)[0]) == 16  # both generators' groups: 4 prompts x 4
    export = sum(float(t.double().sum()) for t in weights(d).values())
    assert math.isclose(last_row(d)["generator/weight_sum"], export, rel_tol=1e-12)
