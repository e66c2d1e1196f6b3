"""What a vision-language run's images add to the memory plan (`monorl.plan`): the tower's activations in the trainer's
largest micro-batch and in the generator's largest prefill. The tower's weights are in `param_counts` ("vision"),
and image tokens are prompt tokens: `image_tokens_bound` adds them to the longest prompt the plan sizes the KV cache,
the packs and the prefill with. An agent episode's tools may return images too (inserted tokens of a later turn,
within rollout.max_new_tokens): `tool_image_tokens_bound` is what the plan counts of them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from monorl.model.config import ModelConfig
from monorl.plan_activations import ACTIVATION_COEFFS

_GEN_BYTES_PER_PATCH_WIDTH = 2 * 4  # a block's transient in the generator: ~4 bf16 [patches, width] (no saved acts)


def max_image_tokens(max_pixels: int, patch_size: int, merge_size: int) -> int:
    """The placeholder tokens of the largest image the processor makes (`max_pixels`, merged patches)."""
    return max(1, max_pixels // (patch_size * merge_size) ** 2)


def image_tokens_bound(prompts: Sequence[Any], processor: Any) -> int:
    """The most image tokens a prompt adds beyond its placeholders' one pad each: its images (`meta["images"]`, the
    most any of `prompts` holds) each at the processor's max_pixels. 0 without images or a processor."""
    most = max((len(p.meta.get("images") or ()) for p in prompts), default=0)
    if not most or processor is None:
        return 0
    return most * (max_image_tokens(processor.max_pixels, processor.patch_size, processor.merge_size) - 1)


def tool_image_tokens_bound(max_tool_images: int, max_new_tokens: int, is_agent_task: bool, processor: Any) -> int:
    """The most image tokens an agent episode's tools and environment insert: `max_tool_images` (rollout's) images at
    the processor's max_pixels, within the completion budget they count against (`max_new_tokens`). 0 for a task
    that plays no episodes or a policy without a processor (a text model)."""
    if not is_agent_task or processor is None:
        return 0
    each = max_image_tokens(processor.max_pixels, processor.patch_size, processor.merge_size)
    return min(max_tool_images * each, max_new_tokens)


def vision_activation_bytes(m: ModelConfig, pack_tokens: int, image_fraction: float, compute: str,
                            training: bool) -> tuple[int, int]:
    """(bytes, patches) of the tower's forward over the images of a pack (or a prefill) of `pack_tokens` tokens,
    `image_fraction` of them image tokens (each merge^2 patches): in training every block's saved activations (the
    decoder's per-token coefficients at the tower's widths: attention q, k, v of its hidden size), in the generator
    one block's transient at a time."""
    v = m.vision
    if v is None or image_fraction <= 0:
        return 0, 0
    patches = math.ceil(pack_tokens * min(1.0, image_fraction)) * v.spatial_merge_size ** 2
    if not training:
        return _GEN_BYTES_PER_PATCH_WIDTH * patches * (v.hidden_size + v.intermediate_size), patches
    co = ACTIVATION_COEFFS[compute if compute in ACTIVATION_COEFFS else "float32"]
    per_patch = co.h * v.hidden_size + co.i * v.intermediate_size + (co.q + co.kv) * v.hidden_size + co.c
    return int(per_patch * patches * v.depth), patches
