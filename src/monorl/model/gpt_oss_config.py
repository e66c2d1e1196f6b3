"""GPT-OSS's config.json keys (`GptOssConfig`), read and written the way transformers resolves them: the hooks
`ModelConfig.from_hf` / `to_hf` call for the `gpt_oss` family (`monorl.model.families.GPT_OSS`).

Beyond the shared keys: `layer_types` (absent: sliding and full attention alternating, sliding first),
`sliding_window`, `num_local_experts` (monorl's num_experts), `intermediate_size` (each expert's width: monorl's
moe_intermediate_size, every layer sparse), `swiglu_alpha` / `swiglu_limit`, and YaRN RoPE (`rope_parameters`, or
transformers 4's `rope_scaling` beside a top-level `rope_theta`; absent: GptOssConfig's factor-32 YaRN). A
quantized checkpoint (the released MXFP4 experts) is refused: monorl reads bf16 / fp32 weights."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from monorl.model.families import GPT_OSS
from monorl.model.yarn import YarnRopeScaling

if TYPE_CHECKING:
    from monorl.model.config import ModelConfig

KINDS = ("full_attention", "sliding_attention")
# GptOssConfig's RoPE when config.json gives none
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
# keys the shared writer adds for Qwen3-MoE that GptOssConfig has no field for
_QWEN_MOE_KEYS = ("num_experts", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")


def _number(key: str, value: Any) -> float:
    if not (isinstance(value, int | float) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"config.json: {key} must be a positive number, got {value!r}")
    return float(value)


def from_hf(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json as the shared reader reads it, the extra `ModelConfig` fields: layer_types, sliding_window,
    rope_scaling, swiglu_alpha, swiglu_limit). ValueError (one line, naming the key) for what monorl does not run."""
    d = GPT_OSS.defaults
    if (quant := hf.get("quantization_config")) is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(f"unsupported: a quantized checkpoint (quantization_config.quant_method={method!r}); "
                         "monorl reads GPT-OSS in bf16/fp32: dequantize it first (e.g. transformers' "
                         "Mxfp4Config(dequantize=True), then save_pretrained)")
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or DEFAULT_ROPE
    if not isinstance(rope, dict):
        raise ValueError(f"config.json: rope_parameters must be an object, got {rope!r}")
    theta = rope.get("rope_theta", hf.get("rope_theta", d["rope_theta"]))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"unsupported rope_type {rope_type!r} for gpt_oss (monorl implements default, yarn)")
    max_positions = hf.get("max_position_embeddings", d["max_position_embeddings"])
    scaling = YarnRopeScaling.from_hf(rope, max_positions) if rope_type == "yarn" else None

    layers = hf.get("num_hidden_layers", d["num_hidden_layers"])
    types = hf.get("layer_types", d["layer_types"])
    if types is None:  # HF: sliding on even layers, full on odd
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or any(t not in KINDS for t in types):
        raise ValueError(f"config.json: layer_types must list {KINDS} values, got {types!r}")
    window = hf.get("sliding_window", d["sliding_window"])
    if "sliding_attention" in types and not (isinstance(window, int) and not isinstance(window, bool) and window > 0):
        raise ValueError(f"config.json: sliding_window must be a positive integer, got {window!r}")
    experts = hf.get("num_local_experts", hf.get("num_experts", d["num_local_experts"]))
    read = {**hf, "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "rope_scaling": None,
            "num_experts": experts, "moe_intermediate_size": hf.get("intermediate_size", d["intermediate_size"]),
            "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": None}
    extra = dict(layer_types=tuple(types), sliding_window=window if "sliding_attention" in types else 0,
                 rope_scaling=scaling, swiglu_alpha=_number("swiglu_alpha", hf.get("swiglu_alpha", d["swiglu_alpha"])),
                 swiglu_limit=_number("swiglu_limit", hf.get("swiglu_limit", d["swiglu_limit"])))
    return read, extra


def to_hf(cfg: ModelConfig, out: dict[str, Any]) -> dict[str, Any]:
    """The shared config.json `out` as GptOssConfig reads it."""
    out = {k: v for k, v in out.items() if k not in _QWEN_MOE_KEYS}
    out.update(
        num_local_experts=cfg.num_experts, intermediate_size=cfg.moe_intermediate_size,
        layer_types=[cfg.layer_type(i) for i in range(cfg.num_layers)], sliding_window=cfg.sliding_window or None,
        swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit,
    )
    return out
