"""Which warm-up passes the Triton compile-ahead traces (`monorl.run.startup.trace_passes`): a trace pass skips
Triton launches and runs its PyTorch ops on their garbage outputs, so a generator whose cache maps the step's slots
with PyTorch index ops (Qwen3.5's recurrent rows, Gemma 3's recycled windows) must not be traced: on an H100 the
hybrid's trace read garbage rows (`index out of bounds`, 2026-12-07) and the run died at start-up."""

from __future__ import annotations

import pytest

from monorl.generate.cache import CACHE_KINDS, traceable
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.run.startup import trace_passes

SMALL = dict(num_layers=4, hidden_size=64, intermediate_size=128, vocab_size=256, num_heads=2, num_kv_heads=1,
             head_dim=32)


def small(name: str, **kw):
    cfg = model_shape(name)
    kinds = tuple(cfg.layer_type(i) for i in range(cfg.num_layers))[: SMALL["num_layers"]]
    if len(set(kinds)) == 1 and kinds[0] != "full_attention":
        kinds = kinds[:-1] + ("full_attention",)
    return cfg.replace(**SMALL, **({"layer_types": kinds} if cfg.layer_types else {}), **kw)


@pytest.mark.parametrize("name, generator_traced", [("qwen3-0.6b", True), ("qwen3_5-0.8b", False),
                                                    ("gemma3-270m", False)])
def test_the_generator_is_traced_only_where_every_cache_kind_allows_it(name, generator_traced):
    cfg = small(name)
    assert cfg.qk_norm  # all three would be traced by the q/k-norm rule alone
    model = build_model(cfg)
    assert traceable(cfg) is generator_traced
    assert trace_passes(model, model, cfg) == {"trainer": False, "generator": generator_traced}
    make_batch_invariant_(model)
    assert trace_passes(model, model, cfg)["trainer"]


def test_every_cache_kind_says_whether_a_trace_can_run_it():
    assert {k: v.traceable for k, v in CACHE_KINDS.items()} == {
        "full_attention": True, "sliding_attention": False, "linear_attention": False}
