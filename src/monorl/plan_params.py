"""How many parameters of each kind a model holds: by kind (projections, experts, head, embedding, norms), those
one token reads (a mixture of experts'), its LoRA adapters, and one rank's shard of a tensor-parallel generator
copy. From the config alone (the model built on the meta device: no weights, no memory), so the memory plan
(`monorl.plan`) and the benchmarks need no checkpoint."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from monorl.model.config import ModelConfig

if TYPE_CHECKING:
    from monorl.model.lora import LoRAConfig


def param_counts(m: ModelConfig) -> dict[str, int]:
    """Parameters by kind: `linear` (the layers' projections: attention, dense MLPs, routers, and a family's small
    extras: sinks, a linear-attention layer's conv and decay), `experts` (every expert of the sparse layers,
    `monorl.model.moe`; 0 for a dense model), `lm_head` (0 when tied), `embed`, `norm`, `vision` (the tower).
    Counted on the model built on the meta device (no memory, ~0.1 s for a 20B shape), so every family's layer
    kinds count as they are built, not as one family's formula would have them."""
    return dict(_param_counts(m))


@functools.lru_cache(maxsize=32)
def _param_counts(m: ModelConfig) -> tuple[tuple[str, int], ...]:
    from monorl.model.decoder import build_model  # the model layer, only when a plan is made

    counts = dict.fromkeys(("linear", "experts", "lm_head", "embed", "norm", "vision"), 0)
    model = build_model(m, device="meta", dtype=torch.bfloat16, seed=None)
    for name, p in model.named_parameters():  # a tied lm_head is the embedding's parameter: named (counted) once
        counts[_kind(name)] += p.numel()
    return tuple(counts.items())


def _kind(name: str) -> str:
    parts = name.split(".")
    if parts[:2] == ["model", "visual"]:
        return "vision"
    if "embed_tokens" in parts:
        return "embed"
    if parts[0] == "lm_head":
        return "lm_head"
    if "experts" in parts:
        return "experts"
    return "norm" if any("norm" in x for x in parts[-2:]) else "linear"


def active_param_count(m: ModelConfig) -> int:
    """Parameters one token's forward reads: every parameter, less the experts it is not routed to."""
    total = sum(param_counts(m).values())
    if not m.is_moe:
        return total
    sparse = sum(map(m.sparse_layer, range(m.num_layers)))
    return total - sparse * (m.num_experts - m.num_experts_per_tok) * 3 * m.hidden_size * m.moe_intermediate_size


def projection_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of a layer, by HF name."""
    h, i, q, kv = m.hidden_size, m.intermediate_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def lora_param_count(m: ModelConfig, lora: LoRAConfig) -> int:
    """Adapter parameters: the targeted projections of every layer (a sparse layer has no dense MLP projections:
    its experts take no adapters)."""
    if not lora.enabled:
        return 0
    shapes = projection_shapes(m)
    names = {t if t.endswith("_proj") else f"{t}_proj" for t in lora.targets}
    dense = m.num_layers - sum(map(m.sparse_layer, range(m.num_layers)))
    return sum((dense if n in ("gate_proj", "up_proj", "down_proj") else m.num_layers) * lora.rank * sum(shapes[n])
               for n in names)


def tensor_parallel_copy_params(m: ModelConfig, tp: int) -> int:
    """Parameters of one rank's shard of a tensor-parallel generator copy: the projections, the experts and the head
    divided by `tp` (a tied head too: its own V/tp rows), the embedding, the norms, the routers and o_proj's bias
    whole (rank 0's is the bias, the others' zeros: `TensorParallelPlacement`), a vision tower whole."""
    counts = param_counts(m)
    o_bias = m.num_layers * m.hidden_size * m.o_bias
    routers = sum(map(m.sparse_layer, range(m.num_layers))) * m.num_experts * m.hidden_size
    return (counts["linear"] - o_bias - routers + counts["experts"]) // tp + o_bias + routers \
        + m.vocab_size * m.hidden_size // tp + counts["embed"] + counts["norm"] + counts["vision"]
