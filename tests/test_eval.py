"""`monorl eval` (greedy, pass@k, mean@k), `monorl generate` (greedy, the task's rendering, exactly the given
checkpoint, a run's config as base), `--model.path ORG/NAME` through the Hugging Face cache, both verbs with a
tensor-parallel generator on 2 gloo ranks, and what batch composition may change in a greedy run's log-probs."""

from __future__ import annotations

import json
import subprocess
import sys
from math import comb
from pathlib import Path

import pytest

from monorl.cli import main
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.hf_checkpoint import save_checkpoint
from monorl.model.hub import resolve_model_path
from monorl.model.tokenizer import CharTokenizer
from monorl.presets import preset
from monorl.rl.rollouts.passk import mean_at_k, mean_pass_at_k, pass_at_k
from monorl.tasks.base import Prompt, Task
from tests.test_distributed import env, run

SMALL = ["--device", "cpu", "--validation.num_prompts", "3", "--rollout.max_new_tokens", "6",
         "--task.name", "tests.test_eval:AnyDigit"]


class AnyDigit(Task):
    """Passes when the completion holds a digit: a random tiny model passes some and fails some."""

    name, reward_components = "any_digit", ("correctness", "length")

    def train_prompts(self, seed=0, start=0):
        while True:
            yield Prompt("Say a number", None)

    def val_prompts(self, n):
        return [Prompt(f"Say a number like {i}", None) for i in range(n)]

    def reward(self, prompt, completion):
        return {"correctness": float(any(c.isdigit() for c in completion)), "length": -len(completion) / 100}


def test_pass_at_k():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - comb(3, 2) / comb(5, 2))
    assert (pass_at_k(4, 0, 4), pass_at_k(4, 1, 4), pass_at_k(4, 3, 2)) == (0.0, 1.0, 1.0)
    assert mean_pass_at_k([[True, False], [False, False]], 2) == 0.5
    assert mean_at_k([[1.0, 0.0], [0.5, 0.5]]) == 0.5
    with pytest.raises(ValueError):
        pass_at_k(2, 0, 3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "ckpt"
    save_checkpoint(build_model(model_shape("tiny"), seed=3), path, tokenizer=CharTokenizer())
    return path


def test_eval_reports_greedy_and_pass_at_k(ckpt, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", *SMALL, "--model.path", str(ckpt), "--k", "4", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pass@4" in text and "greedy" in text and "sampled k=4" in text and f"wrote {out}" in text
    res = json.loads(out.read_text())
    assert res["model"] == f"weights of {ckpt}" and res["task"] == "any_digit" and res["num_prompts"] == 3
    rows = res["prompts"]
    assert res["greedy"]["pass@1"] == pytest.approx(sum(r["greedy_rewards"]["correctness"] for r in rows) / 3)
    s = res["sampled"]
    assert s["pass@1"] == pytest.approx(sum(r["sampled_passed"] for r in rows) / 12)
    assert s["pass@4"] == pytest.approx(sum(r["sampled_passed"] > 0 for r in rows) / 3)
    assert s["mean@4"] == pytest.approx(s["pass@1"])  # equal group sizes: the share of passing completions
    assert 0 < s["pass@1"] < 1  # the test task separates passes from failures here
    assert res["config"]["model"]["path"] == str(ckpt)
    bad = ["--validation.pass_component", "nope"]
    assert main(["eval", *SMALL, "--model.path", str(ckpt), *bad, "--out", str(out)]) == 2


def _generated(capsys, *args: str) -> list[dict]:
    assert main(["generate", *args]) == 0
    out = capsys.readouterr()
    _generated.err = out.err  # type: ignore[attr-defined]
    return [json.loads(line) for line in out.out.splitlines()]


def test_generate_greedy_uses_the_checkpoint_and_the_task_format(ckpt, tmp_path, capsys):
    rows = _generated(capsys, *SMALL, "--model.path", str(ckpt), "--temperature", "0", "--n", "2",
                      "--num_prompts", "3")
    assert [r["prompt"] for r in rows] == [p for i in range(3) for p in [f"Say a number like {i}"] * 2]
    assert all(a["completion"] == b["completion"] for a, b in zip(rows[::2], rows[1::2], strict=True))  # greedy
    assert all("rewards" in r for r in rows)  # held-out prompts are scored
    # what eval's greedy pass produced for the same prompts: same checkpoint, same rendering
    assert main(["eval", *SMALL, "--model.path", str(ckpt), "--k", "0", "--out", str(tmp_path / "e.json")]) == 0
    capsys.readouterr()
    greedy = [r["greedy"] for r in json.loads((tmp_path / "e.json").read_text())["prompts"]]
    assert [r["completion"] for r in rows[::2]] == greedy
    # a given prompt, rendered as the task renders (User: ... / Assistant:) unless --raw
    given = _generated(capsys, *SMALL, "--model.path", str(ckpt), "--temperature", "0", "--prompt",
                       "Say a number like 1")
    assert given[0]["completion"] == greedy[1] and "rewards" not in given[0]
    raw = _generated(capsys, *SMALL, "--model.path", str(ckpt), "--temperature", "0", "--prompt",
                     "Say a number like 1", "--raw")
    assert raw[0]["prompt"] == "Say a number like 1"


def test_generate_from_a_run_checkpoint_uses_the_runs_config(ckpt, tmp_path, capsys):
    run = tmp_path / "run"
    cfg = preset("tiny")
    cfg.task.name, cfg.task.args = "tests.test_eval:AnyDigit", {}
    cfg.rollout.max_new_tokens = 3
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    save_checkpoint(build_model(model_shape("tiny"), seed=3), run / "checkpoints" / "final", tokenizer=CharTokenizer())
    rows = _generated(capsys, "--device", "cpu", "--model.path", str(run / "checkpoints" / "final"),
                      "--temperature", "0")
    assert rows[0]["prompt"] == "Say a number like 0" and rows[0]["tokens"] <= 3


def test_eval_of_a_run_writes_into_the_run_directory(ckpt, tmp_path, monkeypatch, capsys):
    """`monorl eval --model.path RUN` (or one of its checkpoints) without --out: RUN/eval.json, not the working
    directory; a model outside a run: eval.json here, and the line says where."""
    run = tmp_path / "run"
    cfg = preset("tiny")
    cfg.task.name, cfg.task.args = "tests.test_eval:AnyDigit", {}
    cfg.rollout.max_new_tokens, cfg.validation.num_prompts = 3, 2
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    save_checkpoint(build_model(model_shape("tiny"), seed=3), run / "checkpoints" / "final", tokenizer=CharTokenizer())
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert main(["eval", "--device", "cpu", "--model.path", str(run), "--k", "0"]) == 0
    assert main(["eval", "--device", "cpu", "--model.path", str(run / "checkpoints" / "final"), "--k", "0"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {run / 'eval.json'}" in out and f"wrote {run / 'eval-2.json'}" in out
    assert json.loads((run / "eval.json").read_text())["task"] == "any_digit" and not list(here.iterdir())
    assert main(["eval", *SMALL, "--model.path", str(ckpt), "--k", "0"]) == 0
    assert f"wrote {here / 'eval.json'}" in capsys.readouterr().out and (here / "eval.json").is_file()


def _fake_hub_cache(root: Path, repo: str, ckpt: Path) -> Path:
    """huggingface_hub's cache layout: models--ORG--NAME/{refs/main, snapshots/<commit>/files}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in ckpt.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return snap


def test_model_path_by_hub_name_from_the_cache(ckpt, tmp_path, monkeypatch, capsys):
    snap = _fake_hub_cache(tmp_path / "hub", "someorg/tiny-qwen3", ckpt)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path, origin = resolve_model_path("someorg/tiny-qwen3")
    assert path == snap and origin == " (someorg/tiny-qwen3 from the Hugging Face cache)"
    assert resolve_model_path(str(ckpt)) == (ckpt, "")  # a local directory is itself
    rows = _generated(capsys, *SMALL, "--model.path", "someorg/tiny-qwen3", "--temperature", "0")
    assert rows and f"model: weights of {snap} (someorg/tiny-qwen3 from the Hugging Face cache)" in _generated.err
    assert main(["generate", "--device", "cpu", "--model.path", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err


# -- tensor-parallel generate / eval (torchrun, gloo) and the batch-composition contract ------------------------

TP_GENERATE = ["generate", "--preset", "tiny", "--device", "cpu", "--temperature", "0", "--prompt", "12+7=",
               "--logprobs"]
TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
              "monorl.cli"]


def test_tensor_parallel_generate_equals_one_rank(capsys):
    """`torchrun --nproc_per_node 2 ... generate --generator.tensor_parallel_size 2` forms the group a training run
    forms and prints rank 0's lines alone: the 1-rank greedy tokens, log-probs within the last bits (the
    row-parallel sums split K)."""
    one = _generated(capsys, *TP_GENERATE[1:])
    r = run([*TORCHRUN_2, *TP_GENERATE, "--generator.tensor_parallel_size", "2"])
    assert r.returncode == 0, r.stderr[-4000:]
    two = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(two) == 1 and two[0]["token_ids"] == one[0]["token_ids"]
    assert two[0]["logprobs"] == pytest.approx(one[0]["logprobs"], abs=1e-5)


def test_tensor_parallel_eval_equals_one_rank(tmp_path, capsys):
    """`eval` under tensor_parallel_size 2: every rank plays the prompts together, rank 0 alone writes its results
    (the default eval.json, once), which equal the 1-rank eval's."""
    args = ["eval", "--preset", "tiny", "--device", "cpu", "--validation.num_prompts", "2", "--k", "2"]
    assert main([*args, "--out", str(tmp_path / "one.json")]) == 0
    capsys.readouterr()
    work = tmp_path / "tp"
    work.mkdir()
    r = subprocess.run([*TORCHRUN_2, *args, "--generator.tensor_parallel_size", "2"], cwd=work, env=env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    assert [p.name for p in work.iterdir()] == ["eval.json"] and r.stdout.count("wrote ") == 1
    got, want = (json.loads(p.read_text()) for p in (work / "eval.json", tmp_path / "one.json"))
    assert [got[k] for k in ("prompts", "greedy", "sampled")] == [want[k] for k in ("prompts", "greedy", "sampled")]


def test_batch_composition_moves_logprobs_only_outside_batch_invariant_mode(capsys):
    """Three greedy samples of one prompt in 2 (or 3) decode slots against one sample alone. Default mode: the
    same tokens; their log-probs may differ in the last bits (a decode step's GEMMs run another row count, whose
    CPU kernels may round differently: docs/guides/parity.md), so only the tokens are compared.
    --batch_invariant true (which `generate` now applies to its copy, as a run does): the log-probs too, bit for
    bit."""
    base = TP_GENERATE[1:]
    for mode in ("false", "true"):
        one = _generated(capsys, *base, "--batch_invariant", mode)[0]
        for seqs in ("2", "3"):
            three = _generated(capsys, *base, "--batch_invariant", mode, "--n", "3", "--generator.max_num_seqs", seqs)
            assert [r["token_ids"] for r in three] == [one["token_ids"]] * 3, (mode, seqs)
            if mode == "true":
                assert [r["logprobs"] for r in three] == [one["logprobs"]] * 3, seqs
