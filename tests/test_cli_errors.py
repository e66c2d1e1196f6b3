"""User errors end in one line (exit 2, no traceback) and leave no run directory behind; Ctrl-C says where
the run stands; a model path always means its weights; a reward that always fails stops the run."""

from __future__ import annotations

import json

import pytest
import torch

from monorl.cli import main
from monorl.cliargs import run_config
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.hf_checkpoint import save_checkpoint
from monorl.model.source import load_policy
from monorl.model.tokenizer import CharTokenizer
from monorl.run.grpo import GRPORun
from monorl.run.trainer_steps import TrainerSteps
from monorl.tasks.base import RewardError
from monorl.tasks.reward_context import RewardFunctionError
from tests.conftest import DigitsTask, digits_cfg

# a cut-down tiny run (seconds on CPU): what the cases below add to it is the only thing wrong
FAST = ["--device", "cpu", "--steps", "1", "--warm_start.steps", "0", "--validation.num_prompts", "2",
        "--rollout.prompts_per_step", "2", "--rollout.group_size", "2", "--rollout.max_new_tokens", "4",
        "--checkpoint.final", "false"]


def _write(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def _cases(tmp_path):
    not_a_task = _write(tmp_path, "not_a_task.py", "class Thing:\n    pass\n\ndef factory():\n    return 3\n")
    syntax = _write(tmp_path, "syntax_task.py", "def f(:\n")
    no_tok = tmp_path / "no_tokenizer"
    save_checkpoint(build_model(model_shape("tiny"), seed=0), no_tok)  # config + weights, no tokenizer.json
    return [
        (["--task.name", "no_such_mod_xyz:Task"], "cannot import module 'no_such_mod_xyz'"),
        (["--task.name", f"{not_a_task}:Nope"], "has no attribute 'Nope'"),
        (["--task.name", f"{not_a_task}:Thing"], "not a monorl.tasks.Task subclass"),
        (["--task.name", f"{not_a_task}:factory"], "returned int"),
        (["--task.name", f"{syntax}:f"], "SyntaxError"),
        (["--task.args.max_digit", "3"], "no argument 'max_digit'"),
        (["--task.name", "gsm8k"], "gsm8k needs train_path"),  # the tiny preset's sum_digits args are dropped
        (["--rollout.temperature", "nan"], "expected a finite number"),
        (["--rollout.group_size", "1"], "group_size must be >= 2"),
        (["--generator.max_model_len", "8"], "fits none of the first"),
        (["--rollout.top_k", "-1"], "top_k must be >= 0"),
        (["--seed", "99", "--task.args.val_seed", "99"], "equals the validation seed"),
        (["--trainer.schedule", "foo"], "trainer.schedule must be one of"),
        (["--batch_invariant", "maybe"], "batch_invariant must be one of true, false, auto"),
        (["--model.path", str(no_tok)], "has no tokenizer.json"),
        (["--preset", "qwen3_0_6b_sum_digits"], "model.path is not set"),
    ]


def test_user_errors_are_one_line_and_leave_no_run_dir(tmp_path, capsys):
    for i, (args, message) in enumerate(_cases(tmp_path)):
        run_dir = tmp_path / f"run{i}"
        code = main(["train", *FAST, "--run_dir", str(run_dir), *args])
        err = capsys.readouterr().err.strip()
        assert code == 2, (args, err)
        assert "Traceback" not in err and err.startswith("monorl: error: ") and message in err, (args, err)
        assert len(err.splitlines()) == 1, (args, err)
        assert not run_dir.exists(), args


def test_model_path_means_its_weights(tmp_path):
    """The tiny preset builds random weights of its shape; a --model.path overrides that and loads the path's
    weights, unless --model.random_init true asks for random weights of the path's config.json."""
    saved = build_model(model_shape("tiny"), seed=5)
    save_checkpoint(saved, tmp_path / "ckpt", tokenizer=CharTokenizer())
    cfg = run_config("tiny", ["--model.path", str(tmp_path / "ckpt")])
    model, _, source = load_policy(cfg.model, torch.device("cpu"))
    assert source == f"weights of {tmp_path / 'ckpt'}"
    for (name, p), q in zip(model.named_parameters(), saved.parameters(), strict=True):
        assert torch.equal(p, q), name
    cfg.model.random_init = True
    model, _, source = load_policy(cfg.model, torch.device("cpu"))
    assert source.startswith("random init (seed 0) of ") and "model.random_init=true" in source
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), saved.parameters(), strict=True))


def test_ctrl_c_says_where_the_run_stands(tmp_path, monkeypatch, capsys):
    step = TrainerSteps.step

    def interrupted_at_second(self, i):
        if i == 1:
            raise KeyboardInterrupt
        return step(self, i)

    monkeypatch.setattr(TrainerSteps, "step", interrupted_at_second)
    code = main(["train", *FAST, "--steps", "3", "--checkpoint.every", "1", "--run_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    assert "interrupted after 1/3 steps" in err and "step_000001" in err
    assert f"monorl train --resume {tmp_path / 'run'}" in err
    # console.log keeps the line too (under `| tee` the console loses it)
    assert f"continue with: monorl train --resume {tmp_path / 'run'}" in (tmp_path / "run" / "console.log").read_text()


class AlwaysFails(DigitsTask):
    def reward(self, prompt, completion):
        raise KeyError("no such column")


def test_reward_failing_everywhere_stops_the_run(tmp_path, caplog):
    cfg = digits_cfg(tmp_path, steps=6)
    cfg.task.name = "tests.test_cli_errors:AlwaysFails"
    run = GRPORun(cfg, progress=False)
    with pytest.raises(RewardError, match=r"failed on every completion of 3 steps in a row.*KeyError"):
        run.run()
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert sum('"step"' in r for r in rows) == 2  # steps 1 and 2 ran (and logged); step 3 stopped the run
    # what ran is kept: a checkpoint of the 2 steps, and a summary saying why the run stopped
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "meta.json").is_file()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and "failed on every completion of 3 steps" in summary["stopped"]
    assert "reward failed on 24 of 24 completions" in caplog.text


class ShortBatch(DigitsTask):
    def score_batch(self, prompts, completions, completion_ids, context=None):
        return super().score_batch(prompts, completions, completion_ids)[1:]  # one result short


def test_wrong_shaped_reward_stops_the_run_at_the_first_step(tmp_path):
    """A reward of the wrong shape is a bug in user code: the first step raises RewardFunctionError (a ValueError:
    one line from the CLI), instead of scoring 0 and warning every step."""
    cfg = digits_cfg(tmp_path, steps=3)
    cfg.task.name = "tests.test_cli_errors:ShortBatch"
    cfg.validation.num_prompts = 0
    run = GRPORun(cfg, progress=False)
    with pytest.raises(RewardFunctionError, match=r"task 'digits': score_batch returned 23 results for 24 completions"):
        run.run()
    assert '"step"' not in (tmp_path / "run" / "metrics.jsonl").read_text()


@pytest.mark.parametrize("text,key", [("rollout: 5\n", "rollout"), ("trainer:\n  loss: null\n", "trainer.loss")])
def test_a_config_file_giving_a_section_a_value_is_the_clis_one_line_error(tmp_path, capsys, text, key):
    """`rollout: 5` in a file ended in `AttributeError: 'int' object has no attribute 'group_size'`; the command
    line's `--rollout 5` gives one line: the file gives the same, naming the file."""
    assert main(["config", f"--{key}", "5"]) == 2
    cli = capsys.readouterr().err.strip()
    assert cli.startswith("monorl: error: ") and len(cli.splitlines()) == 1
    path = _write(tmp_path, "run.yaml", text)
    assert main(["config", "--config", path]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert err.startswith(f"monorl: error: {path}: {cli.removeprefix('monorl: error: ')}")


def test_a_raising_reward_shows_its_traceback_once_and_keeps_every_one(tmp_path):
    """`reward 'boom' raised RuntimeError: ...` alone gave no file or line to debug: the first failure of each reward
    function prints its traceback to the console, and console.log keeps every failure's (a real `monorl train`
    process: its console and console.log as a user gets them)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": f"say {i}"}) + "\n" for i in range(8)))
    rw = tmp_path / "rw.py"
    rw.write_text("def boom(completions, **kw):\n    raise RuntimeError('no column x')\n")
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": f"{root / 'src'}{os.pathsep}{root}"}
    proc = subprocess.run([sys.executable, "-m", "monorl.cli", "train", *FAST, "--steps", "2", "--task.name",
                           "dataset", "--task.args.path", str(tmp_path / "d.jsonl"), "--task.args.reward",
                           f"{rw}:boom", "--run_dir", str(run_dir)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    where = f'File "{rw}", line 2, in boom'
    console = proc.stdout + proc.stderr
    assert console.count(where) == 1 and "RuntimeError: no column x" in console
    log = (run_dir / "console.log").read_text()
    assert log.count(where) == 2  # one reward call a step, each failing
