"""Qwen3.5's config.json keys beyond the shared ones (`ModelConfig.from_hf` / `to_hf` call these for a `hybrid`
family): the Gated DeltaNet shape, `layer_types` (or HF's `full_attention_interval`), the partial rotary factor, and
the text config nested in a vision-language checkpoint (`Qwen3_5(Moe)ForConditionalGeneration`: its language model's
weights are `model.language_model.*`, `monorl.model.hf_checkpoint` maps them). Plain dict functions, so config.py
imports them without a cycle."""

from __future__ import annotations

from typing import Any

LINEAR_KEYS = ("linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
               "linear_value_head_dim")
# transformers' defaults that Qwen3_5TextConfig sets in __post_init__ rather than as fields
PARTIAL_ROTARY_DEFAULT = 0.25
FULL_ATTENTION_INTERVAL_DEFAULT = 4
# the vision-language configs whose text_config is a Qwen3.5 language model -> its model_type and causal LM class
NESTED = {"qwen3_5": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
          "qwen3_5_moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")}


def is_nested(hf: dict[str, Any]) -> bool:
    """A `Qwen3_5(Moe)ForConditionalGeneration` config.json (its language model under text_config)."""
    return hf.get("model_type") in NESTED and isinstance(hf.get("text_config"), dict)


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json dict: `hf` itself, or a vision-language checkpoint's text_config (whose
    head is tied as the outer config says, as transformers ties it)."""
    if not is_nested(hf):
        return hf
    text = dict(hf["text_config"])
    model_type, architecture = NESTED[hf["model_type"]]
    text.setdefault("model_type", model_type)
    text["architectures"] = [architecture]
    text["tie_word_embeddings"] = hf.get("tie_word_embeddings", False)
    return text


def _positive_int(hf: dict[str, Any], defaults: Any, key: str) -> int:
    v = hf.get(key, defaults[key])
    if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
        raise ValueError(f"config.json: {key} must be a positive integer, got {v!r}")
    return v


def hybrid_from_hf(hf: dict[str, Any], defaults: Any) -> dict[str, Any]:
    """The `ModelConfig` fields of a Qwen3.5 text config.json, as transformers resolves them."""
    out: dict[str, Any] = {k: _positive_int(hf, defaults, k) for k in LINEAR_KEYS}
    layers = _positive_int(hf, defaults, "num_hidden_layers")
    types = hf.get("layer_types")
    if types is None:
        every = hf.get("full_attention_interval", FULL_ATTENTION_INTERVAL_DEFAULT)
        if not (isinstance(every, int) and every > 0):
            raise ValueError(f"config.json: full_attention_interval must be a positive integer, got {every!r}")
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        raise ValueError(f"config.json: layer_types must be a list of layer kinds, got {types!r}")
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", PARTIAL_ROTARY_DEFAULT))
    if not (isinstance(partial, int | float) and not isinstance(partial, bool) and 0 < partial <= 1):
        raise ValueError(f"config.json: partial_rotary_factor must be in (0, 1], got {partial!r}")
    return dict(out, layer_types=tuple(types), partial_rotary_factor=float(partial))


def hybrid_to_hf(cfg: Any) -> dict[str, Any]:
    """The keys `Qwen3_5TextConfig` reads beyond the shared ones."""
    out = {k: getattr(cfg, k) for k in LINEAR_KEYS}
    out["layer_types"] = [cfg.layer_type(i) for i in range(cfg.num_layers)]
    out["partial_rotary_factor"] = cfg.partial_rotary_factor
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta,
                              "partial_rotary_factor": cfg.partial_rotary_factor}
    out["rope_scaling"] = None
    return out


def check_linear_attention(cfg: Any) -> None:
    """A one-line ValueError for a linear-attention shape no Gated DeltaNet layer can have."""
    if not cfg.family.hybrid:
        raise ValueError(f"{cfg.model_type} has no linear_attention layers (use qwen3_5_text)")
    if min(getattr(cfg, k) for k in LINEAR_KEYS) < 1:
        raise ValueError(f"linear_attention layers need {', '.join(LINEAR_KEYS)} >= 1")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ValueError(f"linear_num_value_heads ({cfg.linear_num_value_heads}) must be a multiple of "
                         f"linear_num_key_heads ({cfg.linear_num_key_heads})")
    if cfg.rotary_dim < 2 or cfg.rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor {cfg.partial_rotary_factor} of head_dim {cfg.head_dim} gives "
                         f"{cfg.rotary_dim} rotary dims; RoPE needs an even number >= 2")


def from_hf(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The family's `hf_module` hook (`ModelConfig.from_hf`): config.json as the shared reader reads it, and the
    Qwen3.5 fields."""
    from monorl.model.families import QWEN3_5

    return hf, hybrid_from_hf(hf, QWEN3_5.defaults)


def to_hf(cfg: Any, out: dict[str, Any]) -> dict[str, Any]:
    """The family's `hf_module` hook (`ModelConfig.to_hf`): the shared config.json plus Qwen3.5's keys."""
    return {**out, **hybrid_to_hf(cfg)}
