"""`monorl parity`: the report on the tiny model, with the mode (PASS, bitwise) and without (FAIL at tolerance 0,
PASS at a tolerance above fp32's rounding), through the function and the CLI verb."""

from __future__ import annotations

import math

import pytest
import torch

from monorl.cli import main
from monorl.parity import check_parity, compare_logprobs
from monorl.presets import preset

FAST = ["--device", "cpu", "--rollout.max_new_tokens", "6", "--validation.num_prompts", "3",
        "--prompts", "3", "--samples", "2"]


def _cfg(batch_invariant: bool):
    cfg = preset("tiny")
    cfg.device, cfg.batch_invariant = "cpu", batch_invariant
    cfg.rollout.max_new_tokens, cfg.validation.num_prompts = 6, 3
    return cfg


def test_compare_logprobs_counts_and_verdict():
    gen = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    tr = [torch.tensor([-1.0, -2.25]), torch.tensor([-0.5])]
    r = compare_logprobs(gen, tr)
    assert (r.tokens_checked, r.tokens_different, r.sequences) == (3, 1, 2)
    assert r.max_abs_diff == 0.25 and r.mean_abs_diff == pytest.approx(0.25 / 3)
    assert not r.passed and r.text().endswith("FAIL (bitwise): expected without the mode, as bit-for-bit equality "
                                              "needs --batch_invariant true; or accept this much with --tolerance 1")
    assert compare_logprobs(gen, tr, batch_invariant=True).text().endswith("FAIL (bitwise)")  # the mode failed: no hint
    assert compare_logprobs(gen, tr, tolerance=0.25).passed
    nan = compare_logprobs([torch.tensor([float("nan")])], [torch.tensor([-1.0])], tolerance=1.0)
    assert math.isnan(nan.max_abs_diff) and not nan.passed
    assert not compare_logprobs([], []).passed  # nothing checked is no evidence
    with pytest.raises(ValueError, match="2 generator log-probs against 1"):
        compare_logprobs([torch.zeros(2)], [torch.zeros(1)])


def test_parity_report_on_the_tiny_model():
    cfg = _cfg(batch_invariant=True)
    r = check_parity(cfg, num_prompts=3, samples=2)
    assert r.passed and r.tokens_different == 0 and r.max_abs_diff == 0.0
    assert r.sequences == 6 and 6 <= r.tokens_checked <= 36 and r.batch_invariant
    assert cfg.run_dir is None  # the caller's config is untouched
    off = check_parity(_cfg(batch_invariant=False), num_prompts=3, samples=2)
    assert not off.passed and off.tokens_different > 0 and 0 < off.max_abs_diff < 1e-4  # negative control
    assert check_parity(_cfg(batch_invariant=False), num_prompts=3, samples=2, tolerance=1e-4).passed


def test_parity_verb(capsys):
    assert main(["parity", *FAST, "--batch_invariant", "true"]) == 0
    out = capsys.readouterr().out
    assert "tokens checked" in out and "tokens different 0" in out and out.strip().endswith("PASS (bitwise)")
    assert main(["parity", *FAST]) == 1  # CPU without the mode: the FAIL line says what bitwise equality needs
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("FAIL (bitwise): ") and "needs --batch_invariant true" in last and "--tolerance 1e-" in last
    assert main(["parity", *FAST, "--batch_invariant", "auto"]) == 1  # auto on CPU: off, and reported so
    assert "parity (batch_invariant=false," in capsys.readouterr().out
    assert main(["parity", *FAST, "--tolerance", "-1"]) == 2
