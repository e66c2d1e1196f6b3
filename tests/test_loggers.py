"""TensorBoard and W&B receive every metric, the validation results and the config: read back and compared with
metrics.jsonl."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from monorl.cli import main
from monorl.fsutil import install_hint
from monorl.rl.loggers import scalars
from tests.test_cli_errors import FAST

ROOT = Path(__file__).resolve().parents[1]


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_scalars_flatten_rows():
    row = {"step": 3, "loss": 0.5, "reward/format": 1, "note": "x", "bad": float("nan")}
    assert scalars(row) == {"loss": 0.5, "reward/format": 1.0}
    val = {"validation/post": {"mean_reward": 0.25, "components": {"correctness": 0.5}, "mean_length": 7}}
    assert scalars(val) == {"validation/mean_reward": 0.25, "validation/reward/correctness": 0.5,
                            "validation/mean_length": 7.0}


class FakeWandb:
    """Records what monorl hands W&B (the real client runs in test_wandb_offline_smoke)."""

    def __init__(self) -> None:
        self.init_kw: dict = {}
        self.logged: list[tuple[dict, int]] = []
        self.finished = False

    def init(self, **kw):
        self.init_kw = kw
        return self

    def log(self, data: dict, step: int) -> None:
        self.logged.append((dict(data), step))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory) -> tuple[Path, FakeWandb]:
    pytest.importorskip("tensorboard")
    run = tmp_path_factory.mktemp("logged") / "run"
    fake = FakeWandb()
    mp = pytest.MonkeyPatch()
    mp.setitem(sys.modules, "wandb", fake)
    try:
        assert main(["train", *FAST, "--steps", "2", "--run_dir", str(run), "--logging.tensorboard", "true",
                     "--logging.wandb", "true", "--logging.wandb_project", "monorl-test",
                     "--logging.wandb_tags", "[a,b]"]) == 0
    finally:
        mp.undo()
    return run, fake


def test_tensorboard_events_hold_every_metric(logged_run: tuple[Path, FakeWandb]):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = logged_run
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    rows = jsonl(run / "metrics.jsonl")
    steps = [r for r in rows if "step" in r]
    assert len(steps) == 2
    for r in steps:
        for key, value in scalars(r).items():
            assert key in tags, key
            got = {e.step: e.value for e in acc.Scalars(key)}
            assert got[r["step"] + 1] == pytest.approx(value, rel=1e-6), key
    pre, post = rows[-1]["validation/pre"], rows[-1]["validation/post"]
    got = {e.step: e.value for e in acc.Scalars("validation/mean_reward")}
    assert got == {0: pytest.approx(pre["mean_reward"]), 2: pytest.approx(post["mean_reward"])}
    assert "validation/reward/correctness" in tags
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"group_size": 2' in text  # the config


def test_wandb_receives_config_metrics_and_validation(logged_run: tuple[Path, FakeWandb]):
    run, fake = logged_run
    kw = fake.init_kw
    assert (kw["project"], kw["name"], kw["tags"]) == ("monorl-test", "run", ["a", "b"])
    assert kw["config"]["rollout"]["group_size"] == 2 and kw["id"] == (run / "wandb_id").read_text().strip()
    rows = jsonl(run / "metrics.jsonl")
    want = [(scalars({"validation/pre": rows[-1]["validation/pre"]}), 0)]
    want += [(scalars(r), r["step"] + 1) for r in rows if "step" in r]
    want += [(scalars({"validation/post": rows[-1]["validation/post"]}), 2)]
    assert fake.logged == want and fake.finished


def test_wandb_offline_smoke(tmp_path, monkeypatch):
    """The real client, offline (no network, no account): a run directory's W&B run is written under it."""
    pytest.importorskip("wandb")
    from monorl.rl.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    lg = WandbLogger(tmp_path, {"trainer": {"lr": 1e-6}}, "monorl-test", None, ("t",))
    lg.log({"reward": 0.5}, 1)
    lg.close()
    run_id = (tmp_path / "wandb_id").read_text().strip()
    assert list(tmp_path.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))


def test_missing_extra_is_one_line_and_no_run_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    assert main(["train", *FAST, "--run_dir", str(tmp_path / "run"), "--logging.tensorboard", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"monorl: error: logging.tensorboard needs tensorboard: {install_hint('tensorboard')}"
    # an editable install (a checkout, as in CI) is told to install from its checkout, else from the index
    hint = install_hint("tensorboard")
    assert hint == "pip install 'monorl[tensorboard]'" or (hint.startswith("pip install -e '/")
                                                             and hint.endswith("[tensorboard]'")), hint
    assert not (tmp_path / "run").exists()
