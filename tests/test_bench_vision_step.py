"""benchmarks/bench_vision_step.py --smoke on a smaller batch (CPU, tiny-vl against tiny): every case runs its RL
steps (images through the generator and the trainer; the VL case also with its tower frozen), and the JSON carries
the comparisons the lead's GPU run reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("PIL.Image")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_vision_step  # noqa: E402


def test_smoke_runs_both_cases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "vision_step.json"
    monkeypatch.setattr(sys, "argv", ["bench_vision_step.py", "--smoke", "--prompts", "2", "--n", "2", "--new", "6",
                                      "--out", str(out)])
    threads = torch.get_num_threads()
    bench_vision_step.main()
    assert torch.get_num_threads() == threads  # the process's later tests (and their subprocesses) keep theirs
    d = json.loads(out.read_text())
    text, vl, frozen = d["cases"]["text"], d["cases"]["vl"], d["cases"]["vl_frozen"]
    assert "error" not in text and "error" not in vl and "error" not in frozen
    assert vl["image_tokens"] == 16  # tiny-vl's processor: a 448 x 448 picture down to 32 x 32 pixels
    assert vl["prompt_tokens_max"] == max(d["text_tokens"]) + 3 - 1 + 16  # start, pads, end around the same text
    assert text["prompt_tokens_max"] == max(d["text_tokens"])
    assert all(len(c["steps"]["train_s"]) == 2 and c["rl_step_s"] > 0 for c in (text, vl))
    assert d["rl_step_ratio"] > 0 and d["rl_step_ratio_frozen"] > 0
    assert frozen["params_b"] == vl["params_b"] and frozen["image_tokens"] == vl["image_tokens"]
