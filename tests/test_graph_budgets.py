"""The trainer's CUDA-graph budget per owner (`monorl.train.graphs`): the frozen forwards (KL reference, teacher)
capture first in a step, so on one shared budget they left the student's step without graphs. The bookkeeping alone
(no CUDA here: the graphs' capture is tests/test_trainer_graphs_gpu.py's)."""

from __future__ import annotations

from monorl.train.graphs import TrainGraphs, graph_owner
from monorl.train.packing import PackShape


def bookkeeping(max_graphs: int) -> TrainGraphs:
    graphs = TrainGraphs.__new__(TrainGraphs)  # the pool and gradient buffers need CUDA; the counts do not
    graphs.graphs, graphs.max_graphs, graphs._warned_full = {}, max_graphs, set()
    return graphs


def shape(n: int) -> PackShape:
    return PackShape(tokens=64 * n, seqs=n, targets=32 * n, max_seqlen=64, full_tokens=64 * n, copies=1)


def test_each_owner_has_its_own_budget():
    graphs = bookkeeping(2)
    for n in (1, 2):  # the frozen forwards of a step, first: their keys as monorl.train.frozen makes them
        for field in ("ref_logprobs", "teacher_logprobs"):
            graphs.graphs[(field, shape(n), 1.0)] = None
    assert graphs.full("ref_logprobs") and graphs.full("teacher_logprobs")
    assert not graphs.full()  # the step's own graphs still have their room
    step_keys = [(shape(n), n, ("ref_logprobs",), 1.0) for n in (1, 2, 3)]  # as Trainer._graph_key makes them
    assert {graph_owner(k) for k in step_keys} == {"step"}
    assert graphs.new_captures(step_keys) == 2
    graphs.graphs[step_keys[0]] = None
    assert graphs.new_captures(step_keys) == 1 and not graphs.full()
    graphs.graphs[step_keys[1]] = None
    assert graphs.full() and graphs.new_captures(step_keys) == 0
