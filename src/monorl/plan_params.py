"""How many parameters of each kind a model holds: by kind (projections, experts, head, embedding, norms), those
one token reads (a mixture of experts'), its LoRA adapters, and one rank's shard of a tensor-parallel generator
copy. Counted from the config alone, so the memory plan (`monorl.plan`) and the benchmarks need no model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from monorl.model.config import ModelConfig
from monorl.model.vision_config import VisionConfig

if TYPE_CHECKING:
    from monorl.model.lora import LoRAConfig


def param_counts(m: ModelConfig) -> dict[str, int]:
    """Parameters by kind: `linear` (the layers' projections: attention, dense MLPs, routers), `experts` (every
    expert of the sparse layers, `monorl.model.moe`; 0 for a dense model), `lm_head` (0 when tied), `embed`, `norm`."""
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    sparse = sum(map(m.sparse_layer, range(m.num_layers)))
    per_layer_attn = m.hidden_size * (2 * q + 2 * kv)
    per_layer_attn += (q + 2 * kv) * m.qkv_bias + m.hidden_size * m.o_bias  # the family's biases
    dense_mlp = 3 * m.hidden_size * m.intermediate_size
    per_layer_norm = 2 * m.hidden_size + 2 * m.head_dim * m.qk_norm
    return {
        "linear": m.num_layers * per_layer_attn + (m.num_layers - sparse) * dense_mlp
        + sparse * m.num_experts * m.hidden_size,
        "experts": sparse * m.num_experts * 3 * m.hidden_size * m.moe_intermediate_size,
        "lm_head": 0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size,
        "embed": m.vocab_size * m.hidden_size,
        "norm": m.num_layers * per_layer_norm + m.hidden_size,
        "vision": 0 if m.vision is None else vision_param_count(m.vision),
    }


def vision_param_count(v: VisionConfig) -> int:
    """A vision tower's parameters (`monorl.model.vision`): the patch embedding, the position grid, the blocks, the
    merger and one DeepStack merger per listed block."""
    h, i, wide = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size ** 2
    block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)  # norms, qkv, proj, MLP
    merger = wide * wide + wide + wide * v.out_hidden_size + v.out_hidden_size
    return (v.patch_dim * h + h + v.num_position_embeddings * h + v.depth * block + merger + 2 * h
            + len(v.deepstack_visual_indexes) * (merger + 2 * wide))


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
