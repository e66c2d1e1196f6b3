"""Qwen3-VL's config.json, to and from monorl's: the text decoder is a Qwen3 one (`ModelConfig`), the tower a
`VisionConfig`. Dicts in, dicts out, so `monorl.model.config` can call it without an import cycle."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from monorl.model.vision_config import (
    DEFAULT_MROPE_SECTION,
    HF_VISION_DEFAULTS,
    HF_VL_TOKEN_DEFAULTS,
    VisionConfig,
)

ARCHITECTURE = "Qwen3VLForConditionalGeneration"
# transformers' Qwen3VLTextConfig defaults (tests/test_qwen3_vl.py checks them against the installed transformers)
HF_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "attention_bias": False}
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")
# Qwen/Qwen3-VL-2B-Instruct's released config.json (the keys that set numbers; `MODEL_SHAPES["qwen3-vl-2b"]`, for
# random-init benchmarks, #59). Its text decoder is Qwen3-1.7B's shape at rope_theta 5e6; every key it leaves out
# (the tower's rope_theta 10000, in_channels 3) is transformers' Qwen3VL default, and the token ids equal
# transformers' Qwen3VLConfig defaults (tests/test_qwen3_vl.py builds this config in transformers).
QWEN3_VL_2B: dict[str, Any] = {
    "architectures": [ARCHITECTURE], "model_type": "qwen3_vl", "tie_word_embeddings": True,
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "text_config": {
        "model_type": "qwen3_vl_text", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_act": "silu", "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "rope_theta": 5000000,
        "rope_scaling": {"rope_type": "default", "mrope_interleaved": True, "mrope_section": [24, 20, 20]},
        "attention_bias": False, "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645},
    "vision_config": {
        "model_type": "qwen3_vl", "depth": 24, "hidden_size": 1024, "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": 4096, "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
        "temporal_patch_size": 2, "out_hidden_size": 2048, "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [5, 11, 17]}}


def split_config(hf: Mapping[str, Any]) -> tuple[dict[str, Any], VisionConfig]:
    """A Qwen3-VL config.json -> (its text decoder's config.json as a Qwen3 one, the `VisionConfig`): keys left out
    take transformers' defaults. ValueError (one line, naming the key) for what monorl does not run.
    `ModelConfig.from_hf` reads the first and sets the second as its `vision`."""
    archs = hf.get("architectures") or []
    if archs and ARCHITECTURE not in archs:
        raise ValueError(f"config.json: model_type qwen3_vl with architectures {archs}; monorl runs {ARCHITECTURE}")
    text = {**HF_TEXT_DEFAULTS, **(hf.get("text_config") or {})}
    section = DEFAULT_MROPE_SECTION
    for key in ("rope_scaling", "rope_parameters"):  # strip the M-RoPE keys; the rest is plain RoPE
        if isinstance(rope := text.get(key), dict):
            if "mrope_section" in rope:
                section = tuple(rope["mrope_section"])
            if rope.get("mrope_interleaved") is False:
                raise ValueError("config.json: text_config.rope_parameters.mrope_interleaved=false is Qwen2-VL's "
                                 "M-RoPE; monorl runs Qwen3-VL's interleaved one")
            text[key] = {k: v for k, v in rope.items() if k not in _MROPE_KEYS} or None
    if len(section) != 3 or sum(section) != text["head_dim"] // 2:
        raise ValueError(f"config.json: mrope_section {list(section)} must be 3 numbers summing to head_dim / 2 "
                         f"({text['head_dim'] // 2})")
    tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    text.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=tie,
                use_sliding_window=False)
    for key in ("bos_token_id", "eos_token_id"):
        text.setdefault(key, hf.get(key))
    vis = {**HF_VISION_DEFAULTS, **(hf.get("vision_config") or {})}
    if vis["hidden_act"] != "gelu_pytorch_tanh":
        raise ValueError(f"config.json: vision_config.hidden_act {vis['hidden_act']!r} is not Qwen3-VL's "
                         "gelu_pytorch_tanh")
    if vis["out_hidden_size"] != text["hidden_size"]:
        raise ValueError(f"config.json: vision_config.out_hidden_size ({vis['out_hidden_size']}) must equal "
                         f"text_config.hidden_size ({text['hidden_size']})")
    tokens = {k: hf.get(k, v) for k, v in HF_VL_TOKEN_DEFAULTS.items()}
    vision = VisionConfig(
        depth=vis["depth"], hidden_size=vis["hidden_size"], intermediate_size=vis["intermediate_size"],
        num_heads=vis["num_heads"], out_hidden_size=vis["out_hidden_size"], patch_size=vis["patch_size"],
        temporal_patch_size=vis["temporal_patch_size"], spatial_merge_size=vis["spatial_merge_size"],
        in_channels=vis["in_channels"], num_position_embeddings=vis["num_position_embeddings"],
        deepstack_visual_indexes=tuple(vis["deepstack_visual_indexes"]),
        rope_theta=float((vis.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        mrope_section=section, **tokens)
    return text, vision


def join_config(text: dict[str, Any], v: VisionConfig, dtype: str) -> dict[str, Any]:
    """The config.json transformers loads as Qwen3VLForConditionalGeneration, from the text decoder's Qwen3
    config.json (`ModelConfig.to_hf` of the model without its vision) and the tower's config."""
    text = dict(text)
    tie, bos, eos = text["tie_word_embeddings"], text.get("bos_token_id"), text.get("eos_token_id")
    for key in ("architectures", "use_sliding_window", "sliding_window", "torch_dtype", "rope_scaling"):
        text.pop(key, None)
    text.update(model_type="qwen3_vl_text", rope_parameters={**text["rope_parameters"], "mrope_interleaved": True,
                                                             "mrope_section": list(v.mrope_section)})
    vision = {"model_type": "qwen3_vl_vision", "depth": v.depth, "hidden_size": v.hidden_size,
              "hidden_act": "gelu_pytorch_tanh", "intermediate_size": v.intermediate_size, "num_heads": v.num_heads,
              "in_channels": v.in_channels, "patch_size": v.patch_size, "spatial_merge_size": v.spatial_merge_size,
              "temporal_patch_size": v.temporal_patch_size, "out_hidden_size": v.out_hidden_size,
              "num_position_embeddings": v.num_position_embeddings,
              "deepstack_visual_indexes": list(v.deepstack_visual_indexes),
              "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}}
    return {"architectures": [ARCHITECTURE], "model_type": "qwen3_vl", "text_config": text, "vision_config": vision,
            "image_token_id": v.image_token_id, "video_token_id": v.video_token_id,
            "vision_start_token_id": v.vision_start_token_id, "vision_end_token_id": v.vision_end_token_id,
            "tie_word_embeddings": tie, "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": dtype,
            "dtype": dtype}
