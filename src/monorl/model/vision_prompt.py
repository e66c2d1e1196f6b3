"""A prompt's images as the model takes them: `ImageInputs` (the tower's pixel_values and grid_thw, the prompt's
M-RoPE positions) and the prompt's tokens with each image's one <|image_pad|> expanded to its token count (what
transformers' Qwen3-VL processor does to the rendered text)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from monorl.model.image_processing import ImageProcessor
from monorl.model.mrope import mrope_positions
from monorl.model.vision_config import VisionConfig


@dataclass(frozen=True)
class ImageInputs:
    """One prompt's images: pixel_values [patches, C * t * p * p], grid_thw [images, 3]; positions [3, prompt
    tokens] (M-RoPE) and next_position: the position of the token after the prompt (a completion token at index
    i of the sequence, i >= prompt length, sits at next_position + i - prompt length on all three rows)."""

    pixel_values: Tensor
    grid_thw: Tensor
    positions: Tensor
    next_position: int

    @property
    def prompt_len(self) -> int:
        return self.positions.shape[1]

    @property
    def position_offset(self) -> int:
        """How far a later token's position runs behind its index in the sequence (>= 0: an image of n tokens
        moves the positions on by its longer merged side only)."""
        return self.prompt_len - self.next_position


def expand_image_pads(ids: Sequence[int], grids: Sequence[Sequence[int]], vision: VisionConfig) -> list[int]:
    """ids with its k-th image-pad token repeated as many times as image k has tokens (t * h * w / merge^2).
    ValueError (one line) when the prompt's pads and its images differ in number."""
    pads = [i for i, t in enumerate(ids) if t == vision.image_token_id]
    if len(pads) != len(grids):
        raise ValueError(f"the prompt has {len(pads)} image placeholder(s) for {len(grids)} image(s)")
    result: list[int] = []
    image = 0
    for tok in ids:
        if tok != vision.image_token_id:
            result.append(tok)
            continue
        t, h, w = (int(v) for v in grids[image])
        result.extend([tok] * (t * h * w // vision.spatial_merge_size ** 2))
        image += 1
    return result


def encode_with_images(ids: Sequence[int], images: Sequence[Any], vision: VisionConfig,
                       processor: ImageProcessor) -> tuple[list[int], ImageInputs]:
    """A rendered prompt's tokens (one image-pad per image) and its images -> (the expanded tokens, ImageInputs)."""
    pixel_values, grid_thw = processor(images)
    grids = grid_thw.tolist()
    expanded = expand_image_pads(ids, grids, vision)
    positions, nxt = mrope_positions(expanded, grids, vision.image_token_id, vision.spatial_merge_size)
    return expanded, ImageInputs(pixel_values, grid_thw, positions, nxt)
