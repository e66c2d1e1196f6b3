"""The memory plan's Gated DeltaNet term (`monorl.plan_activations.linear_attention_bytes`): what a linear-attention
layer saves for backward beyond an attention layer of the same widths, against autograd's saved tensors (bf16 eager,
CPU: sizes, not values, so the same on every CPU) on a linear shape other than the one it was measured on; and the
plan of Qwen3.5-0.8B's RL run on an 80 GB GPU turning checkpointing on (without the term it planned 60.5 GiB and
the run ran out of memory on an H100, 2026-12-07)."""

from __future__ import annotations

import pytest
import torch

from monorl.model.attention import VarlenContext
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.plan import GiB, auto_checkpointing, plan_memory
from monorl.plan_activations import linear_attention_bytes
from monorl.presets import preset

# 4 key heads of 32 and 8 value heads of 32 (conv_dim 512), not the released 16 x 128 the term was measured on
SHAPE = model_shape("qwen3_5-0.8b").replace(
    num_layers=1, layer_types=("linear_attention",), hidden_size=256, intermediate_size=512, vocab_size=256,
    linear_num_key_heads=4, linear_key_head_dim=32, linear_num_value_heads=8, linear_value_head_dim=32)


def _saved_bytes(kind: str, tokens: int, invariant: bool) -> int:
    m = build_model(SHAPE.replace(layer_types=(kind,)), "cpu", torch.bfloat16, seed=0)
    if invariant:
        make_batch_invariant_(m)
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ctx = VarlenContext.from_lengths([tokens // 4] * 4, torch.device("cpu"), "sdpa")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(torch.randint(0, 256, (tokens,)), ctx.positions, ctx)
    return sum(v for k, v in seen.items() if k not in params)


@pytest.mark.parametrize("invariant", [False, True])
def test_linear_layers_save_what_the_plan_counts(invariant: bool) -> None:
    slope = {kind: (_saved_bytes(kind, 1024, invariant) - _saved_bytes(kind, 512, invariant)) / 512
             for kind in ("linear_attention", "full_attention")}
    measured = slope["linear_attention"] - slope["full_attention"]
    planned = linear_attention_bytes(SHAPE, 1, invariant)
    assert abs(planned - measured) / measured < 0.25, (planned, measured)


def test_the_hybrid_rl_run_is_planned_checkpointed_on_an_80_gb_gpu() -> None:
    cfg = preset("qwen3_0_6b_sum_digits")
    m = model_shape("qwen3_5-0.8b")
    for invariant in (False, True):
        cfg.batch_invariant = invariant
        full = plan_memory(cfg, m, 392, int(79.2 * GiB), activation_checkpointing=False)
        assert full.row("trainer activations").bytes > 60 * GiB  # 18 linear layers of 16384 tokens
        assert auto_checkpointing(cfg, m, 392, int(79.2 * GiB))  # what the run then does
        assert plan_memory(cfg, m, 392, int(79.2 * GiB), activation_checkpointing=True).fits
