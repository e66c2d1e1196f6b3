"""Qwen3-VL's multimodal RoPE (M-RoPE): each token has three positions (time, row, column) and the decoder's
rotary frequencies are shared among them, interleaved (`mrope_cos_sin`); `mrope_positions` lays the three rows out
by transformers' `Qwen3VLModel.get_rope_index` rules. A text token's three positions are equal, so a text-only
sequence rotates exactly as plain RoPE does."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from monorl.ops import custom_op


@custom_op("monorl::mrope_cos_sin", mutates_args=())
def mrope_cos_sin(positions: Tensor, head_dim: int, theta: float, section: list[int],
                  dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos / sin [T, head_dim] of positions [3, T] (or [T]: every row equal). Frequency pair j rotates by the row
    position for j = 1 mod 3 (j < 3 * section[1]), the column position for j = 2 mod 3 (j < 3 * section[2]), the
    time position otherwise (HF's Qwen3VLTextRotaryEmbedding). A custom op, as `rope_cos_sin` is: a compiled
    trainer and the eager generator rotate by the same bits."""
    if positions.dim() == 1:
        positions = positions[None].expand(3, -1)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [3, T, head_dim / 2]
    out = freqs[0].clone()
    for row in (1, 2):
        idx = slice(row, section[row] * 3, 3)
        out[..., idx] = freqs[row, ..., idx]
    emb = torch.cat((out, out), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@mrope_cos_sin.register_fake
def _(positions, head_dim, theta, section, dtype):
    shape = (positions.shape[-1], head_dim)
    return positions.new_empty(shape, dtype=dtype), positions.new_empty(shape, dtype=dtype)


def mrope_positions(token_ids: Sequence[int] | Tensor, grids: Sequence[Sequence[int]], image_token_id: int,
                    spatial_merge_size: int, start: int = 0) -> tuple[Tensor, int]:
    """([3, len(token_ids)] positions, the next text position) of one sequence whose image placeholders (runs of
    `image_token_id`, one run of t * h * w / merge^2 tokens per image, in `grids`' order) hold the images of
    `grids` ([t, h, w] patches each). Text advances all three rows by one a token; an image's tokens take (start,
    start + row, start + column) over its merged grid and move the text position on by max(h, w) / merge. start:
    the position of the first token (a continuation's). ValueError when the runs do not match the grids."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    is_image = (ids == image_token_id).tolist()
    rows: list[Tensor] = []
    pos, i, n, image = start, 0, len(is_image), 0
    while i < n:
        j = i
        while j < n and is_image[j] == is_image[i]:
            j += 1
        if not is_image[i]:
            rows.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
            i = j
            continue
        while i < j:  # one run may hold several images back to back
            if image >= len(grids):
                raise ValueError(f"the sequence has more image tokens than its {len(grids)} image(s) fill")
            t, h, w = (int(v) for v in grids[image])
            gh, gw = h // spatial_merge_size, w // spatial_merge_size
            count = t * gh * gw
            if i + count > j:
                raise ValueError(f"image {image} needs {count} image tokens, the sequence has {j - i} there")
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
            rows.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
            pos += max(gh, gw)
            i += count
            image += 1
    if image != len(grids):
        raise ValueError(f"the sequence has image tokens for {image} image(s), it comes with {len(grids)}")
    positions = torch.cat(rows, dim=1) if rows else torch.zeros(3, 0, dtype=torch.long)
    return positions, pos
