"""Checkpoints and resume: a resumed run equals an uninterrupted one step for step; a SIGKILL during a
checkpoint write leaves the previous checkpoint usable; bad files and changed configs are clear errors."""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from monorl.cli import main
from monorl.cliargs import run_config
from monorl.config import config_diff, config_from_dict
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.hf_checkpoint import CheckpointError
from monorl.presets import preset
from monorl.run.checkpoints.files import (
    LATEST_FILE,
    SLOW_WRITE_ENV,
    STATE_FILE,
    find_checkpoint,
    load_training_checkpoint,
    read_meta,
    rng_state,
    set_rng_state,
)
from monorl.run.grpo import GRPORun
from monorl.run.run_dir import truncate_jsonl
from monorl.tasks.stream import PromptStream
from monorl.tasks.sum_digits import SumDigitsTask
from monorl.train.trainer import Trainer, TrainerConfig


class DigitShareTask(SumDigitsTask):
    """sum_digits prompts with a reward an untrained model already varies on (share of digit characters),
    so advantages, losses and gradients are non-zero from the first step and a resume has something to get
    wrong."""

    def reward(self, prompt: Any, completion: str) -> dict[str, float]:
        return {"correctness": sum(c.isdigit() for c in completion) / max(1, len(completion)),
                "format": float(any(c in completion for c in "=+"))}


# A cut-down tiny run: seconds on CPU. Strings, so the same dict drives run_config and the CLI.
OVERRIDES = {
    "steps": "4", "device": "cpu", "model.shape": "tiny-untied", "task.name": f"{__file__}:DigitShareTask",
    "warm_start.steps": "1", "warm_start.batch_size": "4", "validation.num_prompts": "2",
    "validation.max_new_tokens": "4", "rollout.prompts_per_step": "2", "rollout.group_size": "4",
    "rollout.max_new_tokens": "6", "checkpoint.every": "1", "checkpoint.keep_last": "3", "samples_per_step": "8",
    # a new task.name drops the preset's task args: the tiny preset's short prompts, given explicitly
    "task.args.min_numbers": "2", "task.args.max_numbers": "2", "task.args.min_digits": "1",
    "task.args.max_digits": "1", "task.args.instructions": "false", "task.args.solution_style": "mixed",
}


def small_cfg(run_dir: Path, **extra: str):
    return run_config("tiny", {**OVERRIDES, "run_dir": str(run_dir), **extra})


def cli_args(run_dir: Path) -> list[str]:
    return [a for k, v in {**OVERRIDES, "run_dir": str(run_dir)}.items() for a in (f"--{k}", v)]


def step_rows(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl step rows without timings and throughputs (the only part allowed to differ between runs)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows if "step" in r]


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def killed_copy(run_dir: Path, to: Path, step: int) -> None:
    """A copy of a finished run as it stood after step `step`'s checkpoint (a resume continues the newest one)."""
    shutil.copytree(run_dir, to)
    for path in (to / "checkpoints").iterdir():
        if path.is_dir() and path.name != f"step_{step:06d}":
            shutil.rmtree(path)
    (to / "checkpoints" / LATEST_FILE).write_text(f"step_{step:06d}\n")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted 4-step run, checkpointing every step (keep_last=3): the reference."""
    run_dir = tmp_path_factory.mktemp("resume") / "full"
    GRPORun(small_cfg(run_dir), progress=False).run()
    return run_dir


def test_checkpoint_layout(uninterrupted: Path, load_hf_model) -> None:
    ckpts = uninterrupted / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["final", LATEST_FILE, "step_000002", "step_000003",
                                                       "step_000004"]  # keep_last=3, no temp dirs left
    assert (ckpts / LATEST_FILE).read_text().strip() == "step_000004"
    assert find_checkpoint(uninterrupted) == ckpts / "step_000004"
    meta = read_meta(ckpts / "step_000003")
    assert meta["step"] == 3
    # data position = warm start's prompts + 2 prompts per completed step
    assert meta["data_position"] == 4 + 3 * 2
    assert meta["pre_validation"]["components"].keys() == {"correctness", "format"}
    # the step checkpoint's policy is an HF checkpoint: transformers loads it, with the run's final weights
    hf = load_hf_model(ckpts / "step_000004")
    from safetensors.torch import load_file

    final = load_file(ckpts / "final" / "model.safetensors")
    for name, p in hf.state_dict().items():
        torch.testing.assert_close(p, final[name], rtol=0, atol=0)


def test_resume_equals_uninterrupted(uninterrupted: Path, tmp_path: Path) -> None:
    """Resume the reference run from its step-2 checkpoint (a fresh GRPORun, in a process whose RNGs have
    moved on): steps 3 and 4 reproduce exactly, logs hold each step once, later checkpoints are rewritten."""
    run_dir = tmp_path / "resumed"
    killed_copy(uninterrupted, run_dir, 2)
    torch.manual_seed(12345)
    random.seed(12345)
    result = GRPORun(small_cfg(run_dir), progress=False, resume=run_dir / "checkpoints" / "step_000002").run()
    assert [r["step"] for r in result.steps] == [0, 1, 2, 3]
    assert step_rows(run_dir) == step_rows(uninterrupted)
    assert any(r["loss"] != 0.0 for r in step_rows(run_dir))  # the comparison covers real updates
    assert jsonl(run_dir / "samples.jsonl") == jsonl(uninterrupted / "samples.jsonl")
    val = [r for r in jsonl(run_dir / "metrics.jsonl") if "validation/post" in r]
    assert val == [r for r in jsonl(uninterrupted / "metrics.jsonl") if "validation/post" in r]
    for name in ("final", "step_000004"):
        a = (run_dir / "checkpoints" / name / "model.safetensors").read_bytes()
        assert a == (uninterrupted / "checkpoints" / name / "model.safetensors").read_bytes()


def test_sigkill_during_checkpoint_write_then_resume(uninterrupted: Path, tmp_path: Path) -> None:
    """The CLI run is killed while step 2's checkpoint is half written (the test hook holds the write open
    after the policy files); step 1's checkpoint is then the latest and loads; `--resume` finishes the run
    with metrics equal to the uninterrupted run's."""
    run_dir = tmp_path / "killed"
    env = {**os.environ, SLOW_WRITE_ENV: "1.5"}
    proc = subprocess.Popen([sys.executable, "-m", "monorl.cli", "train", *cli_args(run_dir)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    ckpts = run_dir / "checkpoints"
    half_written = None
    deadline = time.monotonic() + 120  # a hang guard, not a speed check
    try:
        while half_written is None and proc.poll() is None and time.monotonic() < deadline:
            for p in ckpts.glob(".step_000002.tmp-*") if ckpts.is_dir() else []:
                if (p / "model.safetensors").is_file():  # policy written, trainer state not yet
                    half_written = p
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        out = proc.communicate()[0].decode()
    assert half_written is not None, f"never saw step 2's checkpoint being written; output:\n{out}"
    assert not (ckpts / "step_000002").exists()
    assert (ckpts / LATEST_FILE).read_text().strip() == "step_000001"
    # the previous checkpoint loads
    policy = build_model(model_shape("tiny-untied"), "cpu", torch.float32, seed=1)
    ckpt = load_training_checkpoint(find_checkpoint(run_dir), policy, Trainer(policy, TrainerConfig(), 4))
    assert (ckpt.step, ckpt.data_position) == (1, 4 + 2)

    done = subprocess.run([sys.executable, "-m", "monorl.cli", "train", "--resume", str(run_dir)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resumed from" in done.stdout and "step_000001" in done.stdout
    assert step_rows(run_dir) == step_rows(uninterrupted)
    assert jsonl(run_dir / "samples.jsonl") == jsonl(uninterrupted / "samples.jsonl")
    assert not list(ckpts.glob(".*"))  # the killed write's temp dir was cleaned by the next save



def test_resume_keeps_the_kl_reference(tmp_path: Path) -> None:
    """kl_coef > 0: each checkpoint stores the KL reference (the policy after the warm start), so a resumed run
    anchors where the uninterrupted one did, rather than to the weights it loads before the warm start."""
    kl = {"trainer.loss.kl_coef": "0.1", "steps": "2"}
    full = GRPORun(small_cfg(tmp_path / "full", **kl), progress=False)
    full.run()
    killed_copy(tmp_path / "full", tmp_path / "resumed", 1)
    resumed = GRPORun(small_cfg(tmp_path / "resumed", **kl), progress=False,
                      resume=tmp_path / "resumed" / "checkpoints" / "step_000001")
    resumed.run()
    assert "kl" in step_rows(tmp_path / "full")[1]
    assert step_rows(tmp_path / "resumed") == step_rows(tmp_path / "full")
    ref = resumed.trainer.ref_model.state_dict()
    for k, v in full.trainer.ref_model.state_dict().items():
        assert torch.equal(ref[k], v), k

# ---- bad files --------------------------------------------------------------------------------------------

def _policy_trainer() -> tuple[Any, Trainer]:
    policy = build_model(model_shape("tiny-untied"), "cpu", torch.float32, seed=1)
    return policy, Trainer(policy, TrainerConfig(), total_steps=4)


def _garble(file: Path) -> None:
    """Same size, different bytes: only parsing can tell."""
    data = bytearray(file.read_bytes())
    data[: min(len(data), 64)] = b"\x00" * min(len(data), 64)
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, file", [
    ("delete", "meta.json"), ("garble", "meta.json"), ("delete", STATE_FILE), ("garble", STATE_FILE),
    ("truncate", STATE_FILE), ("garble", "model.safetensors"), ("delete", "model.safetensors"),
])
def test_bad_checkpoint_file_is_named(uninterrupted: Path, tmp_path: Path, damage: str, file: str) -> None:
    ckpt = tmp_path / "step_000003"
    shutil.copytree(uninterrupted / "checkpoints" / "step_000003", ckpt)
    target = ckpt / file
    if damage == "delete":
        target.unlink()
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:100])
    else:
        _garble(target)
    policy, trainer = _policy_trainer()
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    with pytest.raises(CheckpointError, match=str(target).replace(".", r"\.")):
        load_training_checkpoint(ckpt, policy, trainer)
    for k, v in policy.state_dict().items():  # nothing half-restored
        assert torch.equal(v, before[k]), k


def test_latest_naming_a_missing_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / LATEST_FILE).write_text("step_000007\n")
    with pytest.raises(CheckpointError, match="latest names checkpoint 'step_000007'"):
        find_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        find_checkpoint(tmp_path / "nope")


def test_cli_resume_with_corrupt_state_is_one_line(uninterrupted: Path, tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "corrupt"
    shutil.copytree(uninterrupted, run_dir)
    _garble(run_dir / "checkpoints" / "step_000004" / STATE_FILE)
    assert main(["train", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"corrupt checkpoint file {run_dir / 'checkpoints' / 'step_000004' / STATE_FILE}" in err
    assert "step_000002, step_000003" in err  # and it points at the checkpoints that remain


# ---- config changes ---------------------------------------------------------------------------------------

def test_resume_with_changed_config_lists_keys(uninterrupted: Path, tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "changed"
    shutil.copytree(uninterrupted, run_dir)
    assert main(["train", "--resume", str(run_dir), "--trainer.lr", "0.01", "--rollout.group_size", "2"]) == 2
    err = capsys.readouterr().err
    assert "trainer.lr: 0.0003 -> 0.01" in err and "rollout.group_size: 4 -> 2" in err
    assert "--allow-config-change" in err
    # with --preset the command line is the whole config, as for a fresh run: the preset's values differ
    assert main(["train", "--resume", str(run_dir), "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert f"steps: 4 -> {preset('tiny').steps}" in err and "model.shape: \"tiny-untied\" -> \"tiny\"" in err
    # allowed: one more step on top of the finished 4 (the stored config is updated)
    assert main(["train", "--resume", str(run_dir), "--steps", "5", "--allow-config-change"]) == 0
    assert "steps: 4 -> 5" in capsys.readouterr().err
    assert [r["step"] for r in step_rows(run_dir)] == [0, 1, 2, 3, 4]
    assert step_rows(run_dir)[:4] == step_rows(uninterrupted)
    assert json.loads((run_dir / "config.json").read_text())["steps"] == 5


def test_resume_config_from_an_older_monorl(uninterrupted: Path, tmp_path: Path) -> None:
    """A config.json without keys added since (they take their defaults) resumes with no config change."""
    from monorl.cli import _resume_config

    run_dir = tmp_path / "older"
    shutil.copytree(uninterrupted, run_dir)
    stored = json.loads((run_dir / "config.json").read_text())
    del stored["trainer"]["loss"]["kl_estimator"], stored["rollout"]["advantage"]
    (run_dir / "config.json").write_text(json.dumps(stored))
    cfg = _resume_config(str(run_dir), [], allow_change=False)
    assert cfg.trainer.loss.kl_estimator == "k3" and cfg.rollout.advantage == "grpo"


def test_config_diff_and_roundtrip() -> None:
    a = preset("tiny")
    b = run_config("tiny", {"trainer.loss.kind": "dapo", "run_dir": "/elsewhere"})
    assert config_diff(a.to_dict(), b.to_dict()) == [("trainer.loss.kind", "grpo", "dapo")]  # run_dir ignored
    assert config_from_dict(json.loads(json.dumps(b.to_dict()))) == b
    with pytest.raises(ValueError, match="unknown config keys: trainer.nope"):
        config_from_dict({"trainer": {"nope": 1}})
    # a config.json written before the generator's compile keys were retired still reads back, and its
    # retired keys are no config change
    old = json.loads(json.dumps(b.to_dict()))
    old["generator"].update({"compile": True, "compile_backend": "inductor", "compile_mode": None,
                             "cuda_graphs": True, "fuse_projections": True})
    assert config_from_dict(old) == b and config_diff(old, b.to_dict()) == []


# ---- pieces ------------------------------------------------------------------------------------------------

def test_truncate_jsonl_drops_later_rows_and_partial_line(tmp_path: Path) -> None:
    f = tmp_path / "m.jsonl"
    f.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"validation/post": {}}\n{"step": 3, "lo')
    kept = truncate_jsonl(f, lambda r: r.get("step", -1) < 2 and "validation/post" not in r)
    assert kept == [{"step": 0}, {"step": 1}]
    assert jsonl(f) == kept


def test_prompt_stream_position_and_start() -> None:
    task = SumDigitsTask()
    s = PromptStream(task, seed=3)
    first = [next(s) for _ in range(5)]
    assert s.position == 5
    resumed = PromptStream(task, seed=3, start=2)
    assert [next(resumed).text for _ in range(3)] == [p.text for p in first[2:]]

    class Ignores(SumDigitsTask):
        def train_prompts(self, seed: int = 42, start: int = 0):  # a task that forgets `start`
            return super().train_prompts(seed, 0)

    with pytest.raises(ValueError, match="must honour `start`"):
        next(PromptStream(Ignores(), seed=3, start=2))


def test_prompt_stream_peek_does_not_draw() -> None:
    """`peek` returns the prompts `next` yields after it (the same objects) without moving the position, so a
    checkpoint taken after a peek resumes at those prompts."""
    task = SumDigitsTask()
    s = PromptStream(task, seed=3)
    next(s)
    ahead = s.peek(3)
    assert s.position == 1 and s.peek(2) == ahead[:2] and s.peek(4)[:3] == ahead
    resumed = PromptStream(task, seed=3, start=s.position)
    drawn = [next(s) for _ in range(4)]
    assert all(a is b for a, b in zip(drawn, ahead, strict=False)) and s.position == 5
    assert [next(resumed).text for _ in range(4)] == [p.text for p in drawn]

    class Two(SumDigitsTask):
        def train_prompts(self, seed: int = 42, start: int = 0):  # a finite stream
            return itertools.islice(super().train_prompts(seed, start), 2 - start)

    finite = PromptStream(Two(), seed=3)
    assert len(finite.peek(5)) == 2 and finite.position == 0 and len(list(finite)) == 2


def test_rng_state_roundtrip() -> None:
    import numpy as np

    state = rng_state()
    draws = (random.random(), torch.rand(3), np.random.rand())
    random.random(), torch.rand(7), np.random.rand(5)
    set_rng_state(state)
    again = (random.random(), torch.rand(3), np.random.rand())
    assert draws[0] == again[0] and torch.equal(draws[1], again[1]) and draws[2] == again[2]
