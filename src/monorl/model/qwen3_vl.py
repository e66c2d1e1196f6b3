"""Qwen3-VL (dense): monorl's Qwen3 decoder with M-RoPE (`monorl.model.mrope`) and DeepStack, fed by the vision
tower (`monorl.model.vision`). What this module adds to the shared decoder: the config.json mapping (a
`Qwen3VLForConditionalGeneration` config: text_config + vision_config), the checkpoint names (HF's
`model.language_model.*` are the decoder's `model.*`; `model.visual.*` and `lm_head` are the same), and
`embed_images`: a sequence's token embeddings with its image placeholders replaced by the tower's output, plus the
DeepStack features the decoder adds at those tokens (`DecoderForCausalLM.forward(inputs_embeds=, deepstack=)`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from monorl.model.config import ModelConfig
from monorl.model.vision_config import (
    DEFAULT_MROPE_SECTION,
    HF_VISION_DEFAULTS,
    HF_VL_TOKEN_DEFAULTS,
    VisionConfig,
)
from monorl.model.vision_prompt import ImageInputs

ARCHITECTURE = "Qwen3VLForConditionalGeneration"
# transformers' Qwen3VLTextConfig defaults (tests/test_qwen3_vl.py checks them against the installed transformers)
HF_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "attention_bias": False}
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")
_TEXT_PREFIX, _DECODER_PREFIX = "model.language_model.", "model."


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """A Qwen3-VL config.json -> ModelConfig (the text decoder as Qwen3, `vision` set); keys left out take
    transformers' defaults. ValueError (one line, naming the key) for what monorl does not run."""
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
    base = ModelConfig.from_hf(text)
    vis = {**HF_VISION_DEFAULTS, **(hf.get("vision_config") or {})}
    if vis["hidden_act"] != "gelu_pytorch_tanh":
        raise ValueError(f"config.json: vision_config.hidden_act {vis['hidden_act']!r} is not Qwen3-VL's "
                         "gelu_pytorch_tanh")
    if vis["out_hidden_size"] != base.hidden_size:
        raise ValueError(f"config.json: vision_config.out_hidden_size ({vis['out_hidden_size']}) must equal "
                         f"text_config.hidden_size ({base.hidden_size})")
    tokens = {k: hf.get(k, v) for k, v in HF_VL_TOKEN_DEFAULTS.items()}
    vision = VisionConfig(
        depth=vis["depth"], hidden_size=vis["hidden_size"], intermediate_size=vis["intermediate_size"],
        num_heads=vis["num_heads"], out_hidden_size=vis["out_hidden_size"], patch_size=vis["patch_size"],
        temporal_patch_size=vis["temporal_patch_size"], spatial_merge_size=vis["spatial_merge_size"],
        in_channels=vis["in_channels"], num_position_embeddings=vis["num_position_embeddings"],
        deepstack_visual_indexes=tuple(vis["deepstack_visual_indexes"]),
        rope_theta=float((vis.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        mrope_section=section, **tokens)
    return base.replace(vision=vision)


def config_to_hf(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
    """The config.json transformers loads as Qwen3VLForConditionalGeneration."""
    v = cfg.vision
    assert v is not None
    text = cfg.replace(vision=None).to_hf(dtype)
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
            "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id, "torch_dtype": dtype, "dtype": dtype}


def hf_name(name: str) -> str:
    """A decoder parameter's checkpoint name: `model.X` -> `model.language_model.X` (the tower and lm_head keep
    theirs)."""
    if name.startswith(_DECODER_PREFIX) and not name.startswith("model.visual."):
        return _TEXT_PREFIX + name[len(_DECODER_PREFIX):]
    return name


def monorl_name(name: str) -> str:
    """The inverse of `hf_name`."""
    return _DECODER_PREFIX + name[len(_TEXT_PREFIX):] if name.startswith(_TEXT_PREFIX) else name


def embed_images(model: nn.Module, input_ids: Tensor, pixel_values: Tensor,
                 grid_thw: Tensor) -> tuple[Tensor, tuple[Tensor, list[Tensor]]]:
    """(inputs_embeds [T, hidden], deepstack) for `DecoderForCausalLM.forward`: the token embeddings of input_ids
    [T] with its image placeholder tokens, in order, replaced by the tower's embeddings of the images
    (pixel_values, grid_thw: `monorl.model.image_processing`'s); deepstack: (those tokens' indices, the tower's
    DeepStack features). ValueError when the placeholders and the images' token counts differ."""
    vision = model.config.vision
    x = model.model.embed_tokens(input_ids)
    image_embeds, deep = model.model.visual(pixel_values, grid_thw)
    index = (input_ids == vision.image_token_id).nonzero().squeeze(1)
    if index.numel() != image_embeds.shape[0]:
        raise ValueError(f"the tokens hold {index.numel()} image placeholder(s), the images fill "
                         f"{image_embeds.shape[0]} (grid_thw {grid_thw.tolist()})")
    x = x.index_copy(0, index, image_embeds.to(x.dtype))
    return x, (index, [d.to(x.dtype) for d in deep])


def image_token_count(grid: tuple[int, int, int] | list[int] | Tensor, spatial_merge_size: int) -> int:
    """How many placeholder tokens an image of `grid` ([t, h, w] patches) takes in the prompt."""
    t, h, w = (int(v) for v in grid)
    return t * h * w // spatial_merge_size ** 2


def vision_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The tower's parameters (`--model.freeze_vision` keeps them out of the optimizer, with no gradients)."""
    visual = getattr(model.model, "visual", None)
    return [] if visual is None else list(visual.parameters())


def freeze_vision_(model: nn.Module) -> int:
    """requires_grad off on the tower's parameters; returns how many."""
    params = vision_parameters(model)
    for p in params:
        p.requires_grad_(False)
    return len(params)



def sequence_positions(inputs: ImageInputs | None, length: int) -> Tensor:
    """M-RoPE positions [3, length] of a sequence: its prompt's (`ImageInputs.positions`), then each later token
    (a sampled or inserted one) one past the last on all three rows (text-only: 0, 1, 2, .. on each row)."""
    if inputs is None:
        return torch.arange(length).expand(3, -1)
    n = inputs.prompt_len
    if length < n:
        raise ValueError(f"a sequence of {length} tokens is shorter than its image prompt ({n})")
    after = torch.arange(inputs.next_position, inputs.next_position + length - n).expand(3, -1)
    return torch.cat([inputs.positions, after], dim=1)


def pack_inputs(model: nn.Module, sequences: Sequence[Sequence[int]], images: Sequence[ImageInputs | None]
                ) -> tuple[Tensor, Tensor, tuple[Tensor, list[Tensor]] | None]:
    """(inputs_embeds, positions [3, T], deepstack) of a pack of sequences (prompt + completion tokens each, the
    prompt's images or None), for `DecoderForCausalLM.forward`: the tower runs once over every prompt's images
    (each image attends only within itself, so this equals one run per prompt)."""
    dev = model.lm_head_weight.device
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=dev)
    positions = torch.cat([sequence_positions(im, len(s)) for s, im in zip(sequences, images, strict=True)], 1)
    with_images = [im for im in images if im is not None]
    if not with_images:
        return model.model.embed_tokens(ids), positions.to(dev), None
    pixels = torch.cat([im.pixel_values for im in with_images]).to(dev)
    grids = torch.cat([im.grid_thw for im in with_images])
    embeds, deepstack = embed_images(model, ids, pixels, grids)
    return embeds, positions.to(dev), deepstack
