"""A sequence's images as the model takes them: `ImageInputs` (the tower's pixel_values and grid_thw, the M-RoPE
positions of the tokens up to the last image's, each image's placeholder rows) and the tokens with each image's one
<|image_pad|> expanded to its token count (what transformers' Qwen3-VL processor does to the rendered text). A
prompt's images (`encode_with_images`), then, in an episode, the images a tool or environment returned, inserted
with the next turn's tokens (`append_images`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from monorl.model.image_processing import ImageProcessor
from monorl.model.mrope import mrope_positions
from monorl.model.vision_config import VisionConfig


@dataclass(frozen=True)
class ImageInputs:
    """One sequence's images: pixel_values [patches, C * t * p * p], grid_thw [images, 3]; positions [3, length]
    (M-RoPE) of its first `length` tokens (a prompt's; an episode's up to its last inserted image's turn) and
    next_position: the position of token `length` (a later token at index i sits at next_position + i - length on
    all three rows); spans: each image's placeholder rows [start, end) in the sequence, in order (only these take
    the tower's embeddings: a sampled <|image_pad|> token stays text)."""

    pixel_values: Tensor
    grid_thw: Tensor
    positions: Tensor
    next_position: int
    spans: tuple[tuple[int, int], ...]

    @property
    def length(self) -> int:
        return self.positions.shape[1]

    @property
    def position_offset(self) -> int:
        """How far a later token's position runs behind its index in the sequence (>= 0: an image of n tokens
        moves the positions on by its longer merged side only)."""
        return self.length - self.next_position


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
    return expanded, ImageInputs(pixel_values, grid_thw, positions, nxt, placeholder_runs(expanded, grids, vision))


def placeholder_runs(ids: Sequence[int], grids: Sequence[Sequence[int]], vision: VisionConfig,
                     start: int = 0) -> tuple[tuple[int, int], ...]:
    """Each image's placeholder rows [a, b) in `ids` (every image-pad token of which is a placeholder, images in
    `grids`' order), shifted by `start`."""
    pads = [i for i, t in enumerate(ids) if t == vision.image_token_id]
    spans, k = [], 0
    for t, h, w in ((int(v) for v in g) for g in grids):
        n = t * h * w // vision.spatial_merge_size ** 2
        spans.append((start + pads[k], start + pads[k] + n))
        k += n
    return tuple(spans)


def append_images(inputs: ImageInputs | None, length: int, new_ids: Sequence[int], images: Sequence[Any],
                  vision: VisionConfig, processor: ImageProcessor) -> tuple[list[int], ImageInputs]:
    """Tokens inserted after a sequence's first `length` tokens (a tool result's, one image-pad per image) and
    their images -> (the inserted tokens expanded, the sequence's `ImageInputs` laid out through them): the tokens
    between `inputs`' layout and `length` (text: sampled turns, inserted text) continue its positions, then the new
    tokens' positions continue from theirs (transformers' `get_rope_index` over the whole sequence). ValueError (one
    line) when the new tokens' pads and `images` differ in number."""
    pixel_values, grid_thw = processor(images)
    grids = grid_thw.tolist()
    expanded = expand_image_pads(new_ids, grids, vision)
    before = inputs.length if inputs is not None else 0
    nxt = inputs.next_position if inputs is not None else 0
    if length < before:
        raise ValueError(f"images laid out over {before} tokens, the sequence has {length}")
    text = torch.arange(nxt, nxt + length - before).expand(3, -1)
    new, after = mrope_positions(expanded, grids, vision.image_token_id, vision.spatial_merge_size,
                                 start=nxt + length - before)
    spans = placeholder_runs(expanded, grids, vision, start=length)
    if inputs is None:
        return expanded, ImageInputs(pixel_values, grid_thw, torch.cat([text, new], 1), after, spans)
    return expanded, ImageInputs(torch.cat([inputs.pixel_values, pixel_values.to(inputs.pixel_values.dtype)]),
                                 torch.cat([inputs.grid_thw, grid_thw.to(inputs.grid_thw.dtype)]),
                                 torch.cat([inputs.positions, text, new], 1), after, inputs.spans + spans)
