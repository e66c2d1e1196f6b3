"""A user's finished work survives what users do (#41): a closed console (`| head`, Ctrl-C through `| tee`), a
reused --run_dir, relative paths resumed from elsewhere, a resume from an older checkpoint; and the friction a new
user hit: the TRL path on the default preset, a run directory as --model.path, task arguments in --help, negative
values, characters a saved vocabulary lacks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from monorl.cli import main
from monorl.console import LOG_FILE
from monorl.run.summary import compile_roi

ROOT = Path(__file__).resolve().parents[1]
# a cut-down tiny run: a second or two of CPU per step at most
FAST = ["--device", "cpu", "--warm_start.steps", "0", "--validation.num_prompts", "2", "--rollout.prompts_per_step",
        "2", "--rollout.group_size", "2", "--rollout.max_new_tokens", "4"]


def _cli(*args: str, cwd: Path = ROOT, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    return subprocess.Popen([sys.executable, "-m", "monorl.cli", *args], cwd=cwd, env=env, **kw)


def _wait_for_step(run_dir: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout  # a hang guard, not a speed check
    while time.monotonic() < deadline and proc.poll() is None:
        rows = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
        if any('"step"' in r for r in rows):
            return
        time.sleep(0.05)
    raise AssertionError(f"no step logged (exit code {proc.poll()})")


def test_a_closed_stdout_does_not_end_the_run(tmp_path):
    """`monorl train | head -1`: the pipe closes after one line; the run still finishes and writes its final
    checkpoint, and console.log holds what the console lost."""
    run_dir = tmp_path / "run"
    proc = _cli("train", *FAST, "--steps", "3", "--run_dir", str(run_dir), stdout=subprocess.PIPE,
                stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert (run_dir / "checkpoints" / "final" / "model.safetensors").is_file()
    log = (run_dir / LOG_FILE).read_text()
    assert "model: " in log and "step 3/3" in log and "Post:" in log


@pytest.mark.skipif(sys.platform == "win32", reason="process groups")
def test_ctrl_c_through_tee_writes_the_checkpoint(tmp_path):
    """`monorl train ... | tee out.log` and Ctrl-C (SIGINT to the whole process group): tee dies first, so the
    run's next console write meets a closed pipe; it must still finish its step and write a checkpoint."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    cmd = (f"{sys.executable} -m monorl.cli train {' '.join(FAST)} --steps 1000 --run_dir {run_dir} "
           f"| tee {tmp_path / 'out.log'}")
    proc = subprocess.Popen(["bash", "-c", cmd], cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _wait_for_step(run_dir, proc)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    latest = run_dir / "checkpoints" / "latest"
    assert latest.is_file(), err.decode()[-2000:]
    assert (run_dir / "checkpoints" / latest.read_text().strip() / "meta.json").is_file()
    log = (run_dir / LOG_FILE).read_text()
    assert "SIGINT: stopping after the step under way" in log
    # the line saying how to continue, which the console (tee, dead) lost
    assert "monorl: stopped by SIGINT after " in log and f"continue with: monorl train --resume {run_dir}" in log


def test_a_run_stopped_before_its_first_checkpoint_says_start_over(tmp_path, monkeypatch, capsys):
    """Ctrl-C during the warm start: no training checkpoint exists, so the interrupt line, a rerun in the same
    --run_dir and `--resume` all say what works (starting over), never `--resume` (which could only fail)."""
    from monorl.run.colocated import Colocated

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Colocated, "warm_start", interrupted)
    run_dir = tmp_path / "run"
    start_over = f"start over: the same command with a new --run_dir, or after `rm -r {run_dir}`"
    assert main(["train", *FAST, "--steps", "2", "--run_dir", str(run_dir)]) == 130
    err = capsys.readouterr().err
    assert "interrupted before the first RL step" in err and start_over in err and "--resume" not in err
    assert f"monorl: interrupted before the first RL step; {run_dir} has nothing to resume" in \
        (run_dir / LOG_FILE).read_text()
    for argv in (["train", *FAST, "--run_dir", str(run_dir)], ["train", "--resume", str(run_dir)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and start_over in err and "continue it with" not in err, (argv, err)


def test_a_run_dir_holding_a_run_is_refused_and_left_alone(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "1", "--run_dir", str(run_dir)]) == 0
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["train", *FAST, "--steps", "2", "--run_dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and f"--resume {run_dir}" in err and len(err.strip().splitlines()) == 1
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", *FAST, "--steps", "1", "--run_dir", str(empty), "--checkpoint.final", "false"]) == 0


def test_resuming_an_older_checkpoint_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "2", "--checkpoint.every", "1", "--run_dir", str(run_dir)]) == 0
    rows = (run_dir / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir / "checkpoints" / "step_000001")]) == 2
    err = capsys.readouterr().err
    assert "older than the run's newest checkpoint step_000002" in err
    assert (run_dir / "metrics.jsonl").read_text() == rows
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"


def test_relative_paths_are_stored_absolute_and_a_run_dir_is_a_model_path(tmp_path, monkeypatch, capsys):
    """A TRL user's data and reward file given relative to the working directory, on the default preset: the
    warm start (no solutions) and validation (no held-out split) are skipped with a notice; the stored config names
    the files absolutely, so `eval --model.path RUN_DIR` from another directory finds them."""
    work = tmp_path / "work"
    work.mkdir()
    rows = [{"prompt": f"say {i}", "solution": str(i)} for i in range(8)]
    (work / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "rw.py").write_text("def digits(completions, **kw):\n"
                                "    return [float(sum(ch.isdigit() for ch in c)) for c in completions]\n")
    monkeypatch.chdir(work)
    args = ["--device", "cpu", "--steps", "1", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
            "--rollout.max_new_tokens", "4", "--task.name", "dataset", "--task.args.path", "d.jsonl",
            "--task.args.reward", "rw.py:digits", "--run_dir", "run"]
    assert main(["train", *args]) == 0
    out = capsys.readouterr().out
    assert "warm start: skipped" in out and "validation: skipped (task 'dataset' has no held-out split" in out
    stored = json.loads((work / "run" / "config.json").read_text())["task"]["args"]
    assert stored == {"path": str(work / "d.jsonl"), "reward": f"{work / 'rw.py'}:digits"}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["generate", "--model.path", str(work / "run"), "--prompt", "say 3", "--temperature", "0",
                 "--device", "cpu", "--rollout.max_new_tokens", "3"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["prompt"] == "say 3"


def test_train_help_lists_the_chosen_tasks_arguments(capsys):
    with pytest.raises(SystemExit):
        from monorl.cli import run_verb

        run_verb("train", ["--task.name", "dataset", "--help"])
    out = capsys.readouterr().out
    assert "task.args of task 'dataset'" in out
    assert "--task.args.reward" in out and "TRL's reward-function signature" in out
    assert "--task.args.min_numbers" not in out


def test_negative_values_after_a_flag(capsys):
    assert main(["train", "--device", "cpu", "--trainer.lr", "-1e-3"]) == 2
    assert "trainer.lr must be > 0, got -0.001" in capsys.readouterr().err


def test_a_saved_char_vocabulary_refuses_characters_it_lacks(tmp_path):
    from monorl.model.hf_checkpoint import load_tokenizer
    from monorl.model.tokenizer import CharTokenizer

    CharTokenizer().save(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok.encode("ab c<eos>") == CharTokenizer().encode("ab c<eos>")
    with pytest.raises(ValueError, match="cannot encode 'ü' at position 0"):
        tok.encode("über")


def test_compile_line_of_a_one_step_run_has_no_nan():
    assert compile_roi(3.0, None, [{"time/step_s": 0.5}]) == "compile: 3.0s spent"


def test_path_lists_are_made_absolute_part_by_part(tmp_path, monkeypatch):
    from monorl.config_paths import absolute_value

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tools.py").write_text("")
    t = tmp_path / "tools.py"
    assert absolute_value("python tools.py:lookup") == f"python {t}:lookup"  # a tools spec: built-in + file
    assert absolute_value("tools.py:a,b") == f"{t}:a,b"
    assert absolute_value("accuracy,tools.py:f") == f"accuracy,{t}:f"
    assert absolute_value("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"  # not a local path: a Hub name, as given
