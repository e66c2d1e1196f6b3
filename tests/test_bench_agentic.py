"""benchmarks/bench_agentic.py end to end on the tiny model (CPU): every way runs the same episodes and the JSON
carries both single-turn comparisons."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_agentic  # noqa: E402


def test_tiny_run_writes_every_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "agentic.json"
    monkeypatch.setattr(sys, "argv", ["bench_agentic.py", "--tiny", "--device", "cpu", "--out", str(out),
                                      "--turn-prefill", "auto,decode"])
    bench_agentic.main()
    d = json.loads(out.read_text())
    assert set(d["results"]) == {"kv_reuse", "kv_reuse_decode", "reprefill", "single_turn", "single_turn_total"}
    assert d["sampled_tokens"] == 4 * 3 * 8
    assert all(r["best_s"] > 0 for r in d["results"].values())
    # two turn boundaries of 4 episodes, each appending the turn's last sampled token and the 4 inserted ones
    assert [(c["sequences"], c["tokens"]) for c in d["results"]["kv_reuse"]["turn_prefills"]] == [(4, 20), (4, 20)]
    assert d["kv_reuse_vs_single_turn_total"] > 0 and d["kv_reuse_vs_reprefill"] > 0
