"""`monorl.speedups.preload`: the ATen ops a pass runs are recorded once per signature, kept as JSON, and replayed on
one-element tensors without touching the RNG; what cannot be replayed is counted, never raised."""

from __future__ import annotations

import pytest
import torch

from monorl.speedups.preload import AtenRecorder, load_ops, replay, save_ops, start_preload

CPU = torch.device("cpu")


def _pass(x: torch.Tensor) -> None:
    """Forward and backward of the kinds of ops a trainer step runs: elementwise, reductions, index ops, casts."""
    idx = torch.tensor([0, 2, 1], device=x.device)
    w = x.detach().requires_grad_()
    y = torch.nn.functional.embedding(idx, w).exp().clamp(-1, 1)
    z = torch.zeros(3, 4, device=x.device, dtype=x.dtype).index_add_(0, idx, y)
    loss = torch.minimum(z, y).pow(2).sum() + z.to(torch.bfloat16).float().max()
    loss.backward()
    torch.randn(4)  # a seeded random op: never recorded (a replay would move the RNG)


def test_records_each_op_once_and_round_trips(tmp_path):
    with AtenRecorder(cuda_only=False) as rec:
        _pass(torch.randn(8, 4))
        _pass(torch.randn(8, 4).double())  # the same ops again, other dtypes: nothing new
    ops = [o["op"] for o in rec.ops]
    assert {"aten::exp.default", "aten::clamp.default", "aten::index_add_.default", "aten::embedding.default",
            "aten::minimum.default", "aten::_to_copy.default"} <= set(ops)
    assert "aten::embedding_dense_backward.default" in ops  # backward ops are recorded too
    assert not any("rand" in o or "normal" in o for o in ops)  # seeded random ops never
    assert "aten::view.default" not in ops and "aten::expand.default" not in ops  # views launch nothing
    assert len(ops) == len(set(ops))
    assert all(leaf["t"] != "dtype.float64" for o in rec.ops for leaf in o["leaves"] if isinstance(leaf, dict)
               and "t" in leaf)
    path = tmp_path / "k.aten.json"
    save_ops(path, rec.ops)
    assert load_ops(path) == rec.ops
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_cuda_only_recorder_ignores_cpu_ops():
    with AtenRecorder() as rec:
        _pass(torch.randn(8, 4))
    assert rec.ops == []


def test_replay_runs_the_ops_and_leaves_the_rng_alone():
    with AtenRecorder(cuda_only=False) as rec:
        _pass(torch.randn(8, 4))
    state = torch.random.get_rng_state()
    ran, failed = replay(rec.ops, CPU)
    assert torch.equal(state, torch.random.get_rng_state())
    assert ran + failed == len(rec.ops)
    assert (ran, failed) == (len(rec.ops), 0)  # these all replay on one-element tensors


def test_unreplayable_entries_are_counted_not_raised(tmp_path):
    ops = [{"op": "aten::no_such_op.default", "spec": "", "leaves": []},
           {"op": "aten::exp.default", "spec": "not a spec", "leaves": []}]
    assert replay(ops, CPU) == (0, 2)
    bad = tmp_path / "bad.aten.json"
    bad.write_text("{not json", encoding="utf-8")
    assert load_ops(bad) is None
    assert load_ops(tmp_path / "none.aten.json") is None
    assert start_preload(bad, CPU) is None  # and never a thread off CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_preload_thread_replays_on_its_own_stream(tmp_path):
    dev = torch.device("cuda")
    with AtenRecorder() as rec:
        _pass(torch.randn(8, 4, device=dev))
    assert rec.ops and all(any(isinstance(x, dict) and x.get("cuda") for x in o["leaves"]) for o in rec.ops)
    path = tmp_path / "k.aten.json"
    save_ops(path, rec.ops)
    state = torch.cuda.get_rng_state(dev)
    pre = start_preload(path, dev)
    assert pre is not None
    pre.join()
    assert (pre.ran, pre.failed) == (len(rec.ops), 0)
    assert torch.equal(state, torch.cuda.get_rng_state(dev))
    # a capture right after the join is allowed (nothing of the thread's is still running)
    g = torch.cuda.CUDAGraph()
    x = torch.ones(4, device=dev)
    with torch.cuda.graph(g):
        y = x * 2
    g.replay()
    assert torch.equal(y, torch.full((4,), 2.0, device=dev))
