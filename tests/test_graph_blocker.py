"""When the trainer's step cannot be one CUDA-graph replay (`monorl.train.graphs.graph_blocker`): the trainer and the
memory plan ask the same function. A hybrid's Gated DeltaNet layers walk cu_seqlens on the host on the references'
paths (the chunked reference, the batch-invariant rule): its steps run eagerly there; where fla serves them with
their backward (`gated_delta_padded.capturable`), on one padded sequence, they are captured like any other layer.
The plan assumes fla serves (the larger plan: graphs keep fixed gradients and a pool)."""

from __future__ import annotations

from monorl.model.config import model_shape
from monorl.plan import GiB, plan_memory
from monorl.presets import preset
from monorl.train.graphs import graph_blocker


def test_what_keeps_a_step_out_of_a_graph():
    dense, moe, hybrid = (model_shape(n) for n in ("qwen3-0.6b", "qwen3-30b-a3b", "qwen3_5-0.8b"))
    assert graph_blocker(dense, batch_invariant=False, flash=True, experts_grouped=False) is None
    assert graph_blocker(dense, batch_invariant=True, flash=False, experts_grouped=False) is None
    assert "flash" in graph_blocker(dense, batch_invariant=False, flash=False, experts_grouped=False)
    assert graph_blocker(moe, batch_invariant=False, flash=True, experts_grouped=True) is None
    for invariant, grouped in ((True, True), (False, False)):
        assert "experts" in graph_blocker(moe, batch_invariant=invariant, flash=True, experts_grouped=grouped)
    for invariant in (False, True):
        assert "Gated DeltaNet" in graph_blocker(hybrid, batch_invariant=invariant, flash=True, experts_grouped=True)
    assert graph_blocker(hybrid, batch_invariant=False, flash=True, experts_grouped=True,
                         linear_capturable=lambda: True) is None
    assert "Gated DeltaNet" in graph_blocker(hybrid, batch_invariant=True, flash=True, experts_grouped=True,
                                             linear_capturable=lambda: True)


def test_only_a_hybrid_asks_whether_fla_serves_its_layers():
    """Asking imports fla (seconds): a dense or MoE model's trainer must not pay it."""
    def ask() -> bool:
        raise AssertionError("asked for a model without linear-attention layers")

    for name in ("qwen3-0.6b", "qwen3-30b-a3b"):
        graph_blocker(model_shape(name), batch_invariant=False, flash=True, experts_grouped=True,
                      linear_capturable=ask)
    asked = []
    graph_blocker(model_shape("qwen3_5-0.8b"), batch_invariant=False, flash=True, experts_grouped=True,
                  linear_capturable=lambda: asked.append(1) or True)
    assert asked == [1]


def test_the_plan_counts_a_graph_pool_for_a_hybrid_outside_the_mode():
    cfg = preset("qwen3_0_6b_sum_digits")
    notes = {}
    for invariant in (False, True):
        cfg.batch_invariant = invariant
        notes[invariant] = plan_memory(cfg, model_shape("qwen3_5-0.8b"), 392, int(79.2 * GiB)).row(
            "trainer activations").note
    assert "CUDA-graph pool" in notes[False] and "CUDA-graph pool" not in notes[True]
