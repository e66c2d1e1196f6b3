"""The command line: help for every verb and every key (from the config itself), --version, bare `monorl`,
choices, config files that read back, presets."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest

from monorl.cli import VERBS, main
from monorl.cliargs import CONFIG_KEYS, SKIPPED_KEYS, config_file_text, run_config
from monorl.config import RunConfig
from monorl.config_docs import field_docs, key_doc
from monorl.presets import PRESETS, preset

KEYS = [k for k, tp in CONFIG_KEYS.items() if k not in SKIPPED_KEYS and not dataclasses.is_dataclass(tp)]


def test_bare_monorl_prints_help_and_starts_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for argv in ([], ["--help"], ["-h"], ["help"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: monorl VERB") and all(f"  {v} " in out for v in VERBS)
    assert not (tmp_path / "runs").exists()
    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("monorl ")
    assert main(["trian"]) == 2 and "unknown command 'trian'" in capsys.readouterr().err


def test_every_key_has_a_description():
    """Descriptions come from the comments beside the config fields: a new key without one fails here."""
    missing = [k for k in CONFIG_KEYS if k not in SKIPPED_KEYS and not key_doc(RunConfig, k)]
    assert not missing, f"add a comment beside these config fields: {missing}"


def test_field_docs_read_comments():
    @dataclasses.dataclass
    class Section:
        a: int = 1  # beside a
        #           and its continuation
        # above b
        b: str = "x"
        c: float = 0.5

    assert field_docs(Section) == {"a": "beside a and its continuation", "b": "above b"}


@pytest.mark.parametrize("verb", [v for v, spec in VERBS.items() if spec.config])
def test_verb_help_lists_every_key(verb, capsys):
    assert main([verb, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for key in KEYS:
        assert f"--{key} " in out, key
    assert "type: float, default: 0.0003" in out  # trainer.lr, tiny preset's default
    assert "--trainer.schedule {linear,cosine,constant}" in out
    assert key_doc(RunConfig, "rollout.group_size") in out
    # --preset picks the defaults shown
    assert main([verb, "--preset", "qwen3_0_6b_gsm8k", "--help"]) == 0
    assert "default: 1e-06" in " ".join(capsys.readouterr().out.split())


def test_choices_are_validated(capsys):
    literal = [k for k in KEYS if typing.get_origin(CONFIG_KEYS[k]) is typing.Literal]
    assert {"trainer.schedule", "trainer.loss.kind", "rollout.advantage", "compile.backend",
            "model.attn_backend"} <= set(literal)
    for key in literal:
        assert main(["config", f"--{key}", "nope"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("monorl: error: ") and f"{key} must be one of" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["--trainer.lr", "fast"], "bad value 'fast' for --trainer.lr: expected float"),
    (["--trainer.lrr", "1"], "unknown config key --trainer.lrr: trainer has no 'lrr' (did you mean --trainer.lr?)"),
    # a key's prefix is not that key (argparse would take the abbreviation and run with max_staleness 1)
    (["--rollout.max_stal", "1"], "unknown config key --rollout.max_stal: rollout has no 'max_stal' (did you mean "
                                  "--rollout.max_staleness?)"),
    (["--steps"], "missing value for --steps"),
    (["--rollout.temperature", "inf"], "expected a finite number"),
    (["--trainer.lr", ".nan"], "bad value nan for --trainer.lr: expected a finite number"),
    (["--generator.max_model_len", "3.5"], "expected int or null"),
    (["--trainer", "1"], "--trainer is a section"),
    (["--preset", "nope"], "unknown preset 'nope'"),
])
def test_parse_errors_are_one_line(args, message, capsys):
    assert main(["config", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("monorl: error: ") and message in err and len(err.splitlines()) == 1, err


def _config(capsys, *args: str) -> dict:
    assert main(["config", "--format", "json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_config_file_round_trips(tmp_path, capsys):
    args = ["--preset", "qwen3_0_6b_gsm8k", "--trainer.lr", "3e-6", "--task.args.max_value", "5",
            "--generator.max_model_len", "none", "--trainer.loss.kind", "cispo"]
    want = _config(capsys, *args)
    assert want["trainer"]["lr"] == 3e-6 and want["task"]["args"]["max_value"] == 5
    for name in ("run.yaml", "run.json"):
        assert main(["config", *args, "--out", str(tmp_path / name)]) == 0
        capsys.readouterr()
        assert _config(capsys, "--config", str(tmp_path / name)) == want, name
    text = (tmp_path / "run.yaml").read_text()
    assert "lr: 3.0e-06  # peak learning rate (AdamW)" in text  # commented with the key's description
    # keys after the file override it; keys before it are overridden by it
    got = _config(capsys, "--steps", "1", "--config", str(tmp_path / "run.yaml"), "--trainer.lr", "1e-5")
    assert got["trainer"]["lr"] == 1e-5 and got["steps"] == want["steps"]


def test_partial_config_file_fills_in_from_its_preset(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("preset: qwen3_0_6b_sum_digits\ntrainer:\n  lr: 5.0e-6\n")
    got = _config(capsys, "--config", str(tmp_path / "a.yaml"))
    ref = preset("qwen3_0_6b_sum_digits")
    ref.trainer.lr = 5e-6
    assert got == json.loads(config_file_text(ref, "json"))
    (tmp_path / "b.yaml").write_text("trainer:\n  lrr: 1\n")
    assert main(["config", "--config", str(tmp_path / "b.yaml")]) == 2
    err = capsys.readouterr().err
    assert "lrr" in err and len(err.strip().splitlines()) == 1


def test_list_keys_take_commas_or_brackets(capsys):
    for value in ("a,b", "[a,b]", "[a, b]"):
        assert _config(capsys, "--logging.wandb_tags", value)["logging"]["wandb_tags"] == ["a", "b"]
    assert _config(capsys, "--logging.wandb_tags=solo")["logging"]["wandb_tags"] == ["solo"]


def test_task_name_switch_drops_preset_task_args(capsys):
    got = _config(capsys, "--task.name", "gsm8k", "--task.args.train_path", "x.jsonl")
    assert got["task"] == {"name": "gsm8k", "args": {"train_path": "x.jsonl"}}
    got = _config(capsys, "--task.args.max_digits", "3")
    assert got["task"]["args"] == {**preset("tiny").task.args, "max_digits": 3}


def test_a_quoted_task_arg_is_its_yaml_string():
    """A task arg's value is YAML: in quotes it is that string, escapes read ("\\n" a line break), where the parser
    kept the quotes and the backslashes (demo_distill's judge template, JSON-quoted, graded nothing) and read
    unquoted 'Score: {x}' as a mapping. Unquoted text and the other types read as before."""
    template = "Question: {question}\n\nStudent: {completion}\nScore:"
    args = run_config("tiny", ["--task.name", "dataset", "--task.args.path", "x.jsonl",
                               "--task.args.judge_template", json.dumps(template), "--task.args.tail='Score: {x}'",
                               "--task.args.n", '"6"', "--task.args.m", "6", "--task.args.plain", "a\\nb",
                               "--task.args.inner", '"a" and "b"']).task.args
    assert args == {"path": "x.jsonl", "judge_template": template, "tail": "Score: {x}", "n": "6", "m": 6,
                    "plain": "a\\nb", "inner": '"a" and "b"'}


def test_presets_have_descriptions(capsys):
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(PRESETS) and all(len(line.split()) > 3 for line in lines)


def test_model_path_help_names_every_kind_of_path(capsys):
    """--model.path takes more than an HF checkpoint directory: its help says so."""
    doc = key_doc(RunConfig, "model.path")
    assert all(kind in doc for kind in ("HF checkpoint directory", "GGUF file", "Hub name", "monorl run directory"))
    assert main(["train", "--help"]) == 0
    assert doc in " ".join(capsys.readouterr().out.split())
