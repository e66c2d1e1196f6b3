"""Qwen3-VL (dense): monorl's Qwen3 decoder with M-RoPE (`monorl.model.mrope`) and DeepStack, fed by the vision
tower (`monorl.model.vision`). What this module adds to the shared decoder: the config.json mapping (a
`Qwen3VLForConditionalGeneration` config: text_config + vision_config), the checkpoint names (HF's
`model.language_model.*` are the decoder's `model.*`; `model.visual.*` and `lm_head` are the same), and
`embed_images`: a sequence's token embeddings with its image placeholders replaced by the tower's output, plus the
DeepStack features the decoder adds at those tokens (`DecoderForCausalLM.forward(inputs_embeds=, deepstack=)`), of
images made ready on the device beforehand (`pack_images`: a trainer pack's, a prefill's).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from monorl.model.vision_config import VisionConfig
from monorl.model.vision_inputs import VisionInputs, vision_inputs
from monorl.model.vision_prompt import ImageInputs

_TEXT_PREFIX, _DECODER_PREFIX = "model.language_model.", "model."


def hf_name(name: str) -> str:
    """A decoder parameter's checkpoint name: `model.X` -> `model.language_model.X` (the tower and lm_head keep
    theirs)."""
    if name.startswith(_DECODER_PREFIX) and not name.startswith("model.visual."):
        return _TEXT_PREFIX + name[len(_DECODER_PREFIX):]
    return name


def monorl_name(name: str) -> str:
    """The inverse of `hf_name`."""
    return _DECODER_PREFIX + name[len(_TEXT_PREFIX):] if name.startswith(_TEXT_PREFIX) else name


def embed_images(model: nn.Module, input_ids: Tensor, images: VisionInputs
                 ) -> tuple[Tensor, tuple[Tensor, list[Tensor]]]:
    """(inputs_embeds [T, hidden], deepstack) for `DecoderForCausalLM.forward`: the token embeddings of input_ids
    [T] with the rows `images.rows` replaced, in order, by the tower's embeddings of the images; deepstack: (those
    rows, the tower's DeepStack features). Reads nothing from the host (a trainer CUDA graph captures it). ValueError
    when the rows and the images' token counts differ."""
    x = model.model.embed_tokens(input_ids)
    image_embeds, deep = model.model.visual(images)
    index = images.rows
    if index.numel() != image_embeds.shape[0]:
        raise ValueError(f"the tokens hold {index.numel()} image placeholder(s), the images fill "
                         f"{image_embeds.shape[0]} (grid_thw {list(images.grids)})")
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
    """M-RoPE positions [3, length] of a sequence: those its images lay out (`ImageInputs.positions`), then each
    later token (a sampled or inserted one) one past the last on all three rows (text-only: 0, 1, 2, .. on each
    row)."""
    if inputs is None:
        return torch.arange(length).expand(3, -1)
    n = inputs.length
    if length < n:
        raise ValueError(f"a sequence of {length} tokens is shorter than its images' layout ({n})")
    after = torch.arange(inputs.next_position, inputs.next_position + length - n).expand(3, -1)
    return torch.cat([inputs.positions, after], dim=1)


def pack_images(vision: VisionConfig, images: Sequence[ImageInputs | None], spans: Sequence[tuple[int, int]],
                device: torch.device | str) -> VisionInputs | None:
    """The `VisionInputs` of flat tokens whose image placeholder runs hold, in order, the images of `images` (each a
    sequence's, or None: that one has none), for a tower of `vision` on `device`: the tower runs once over them all
    (each image attends only within itself, so this equals one run per sequence). spans: the rows [start, end) of
    each image's placeholders (`placeholder_spans`): only placeholders there take images (a completion that samples
    the placeholder token keeps it as text, as the generator's decode does). None without images."""
    with_images = [im for im in images if im is not None]
    if not with_images:
        return None
    # the rows come from the spans on the host (every row of a span is a placeholder: `placeholder_runs` lays them
    # out so), never from reading the tokens back; the copies are queued
    pixels = torch.cat([im.pixel_values for im in with_images])
    grids = torch.cat([im.grid_thw for im in with_images])
    rows = torch.cat([torch.arange(start, end) for start, end in spans]) if spans else torch.zeros(0, dtype=torch.long)
    return vision_inputs(vision, pixels, grids, rows, device)


def image_embeds(model: nn.Module, ids: Tensor, images: Sequence[ImageInputs | None],
                 spans: Sequence[tuple[int, int]]) -> tuple[Tensor, tuple[Tensor, list[Tensor]] | None]:
    """(inputs_embeds, deepstack) of flat tokens `ids` holding `images` at `spans` (`pack_images`, made here: the
    generator's prefill), through `embed_images`. Without images: the token embeddings, None."""
    prepared = pack_images(model.config.vision, images, spans, ids.device)
    if prepared is None:
        return model.model.embed_tokens(ids), None
    return embed_images(model, ids, prepared)


def pack_positions(lengths: Sequence[int], images: Sequence[ImageInputs | None], total: int | None = None) -> Tensor:
    """M-RoPE positions [3, total] of sequences of `lengths` laid end to end (`sequence_positions` each), then
    zeros up to `total` tokens (fillers)."""
    positions = [sequence_positions(im, n) for n, im in zip(lengths, images, strict=True)]
    filler = (total or 0) - sum(lengths)
    return torch.cat([*positions, torch.zeros(3, max(filler, 0), dtype=torch.long)], 1)


def placeholder_spans(lengths: Sequence[int], images: Sequence[ImageInputs | None]) -> list[tuple[int, int]]:
    """`image_embeds`' spans of sequences of `lengths` laid end to end: each image's placeholder rows."""
    spans, start = [], 0
    for n, im in zip(lengths, images, strict=True):
        if im is not None:
            spans += [(start + a, start + b) for a, b in im.spans]
        start += n
    return spans


def window_images(inputs: ImageInputs, start: int, end: int) -> ImageInputs | None:
    """The images of a sequence's rows [start, end) (a turn boundary's new tokens) as the `ImageInputs` of those
    rows alone: positions [3, end - start] theirs in the sequence, spans from `start`; None when no image's
    placeholders lie there (those before `start` are in the KV cache). ValueError for an image the window cuts.
    `end` reaches the images' layout (a turn's new tokens end the sequence)."""
    patches = inputs.grid_thw.prod(dim=1).tolist()
    first = [sum(patches[:i]) for i in range(len(patches) + 1)]
    inside = [i for i, (a, b) in enumerate(inputs.spans) if b > start]
    if any(inputs.spans[i][0] < start or inputs.spans[i][1] > end for i in inside):
        raise ValueError(f"an image's placeholders cross the window [{start}, {end}) of its sequence")
    if not inside:
        return None
    lo, hi = inside[0], inside[-1] + 1
    return ImageInputs(inputs.pixel_values[first[lo]:first[hi]], inputs.grid_thw[lo:hi],
                       sequence_positions(inputs, end)[:, start:], inputs.next_position + end - inputs.length,
                       tuple((a - start, b - start) for a, b in inputs.spans[lo:hi]))


def window_inputs(model: nn.Module, ids: Tensor, positions: Tensor, lengths: Sequence[int],
                  windows: Sequence[ImageInputs | None]) -> tuple[Tensor, Tensor, tuple[Tensor, list[Tensor]] | None]:
    """(inputs_embeds, positions [3, T], deepstack) of flat tokens `ids` (sequences' windows of `lengths` laid end
    to end, then fillers) whose text positions are `positions` [T]: each window's images (`window_images`) at its
    placeholders, its M-RoPE positions over its rows."""
    embeds, deepstack = image_embeds(model, ids, windows, placeholder_spans(lengths, windows))
    rows, start = positions[None].expand(3, -1).clone(), 0
    for n, w in zip(lengths, windows, strict=True):
        if w is not None:
            rows[:, start:start + n] = w.positions.to(rows.device)
        start += n
    return embeds, rows, deepstack


def pack_inputs(model: nn.Module, sequences: Sequence[Sequence[int]], images: Sequence[ImageInputs | None]
                ) -> tuple[Tensor, Tensor, tuple[Tensor, list[Tensor]] | None]:
    """(inputs_embeds, positions [3, T], deepstack) of a pack of sequences (prompt + completion tokens each, their
    images or None), for `DecoderForCausalLM.forward` (`image_embeds`, `pack_positions`)."""
    dev = model.lm_head_weight.device
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=dev)
    embeds, deepstack = image_embeds(model, ids, images, placeholder_spans([len(s) for s in sequences], images))
    return embeds, pack_positions([len(s) for s in sequences], images).to(dev), deepstack
