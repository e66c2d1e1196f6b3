"""A batch of images as the vision tower (`monorl.model.vision`) and the embedding (`qwen3_vl.embed_images`) take
them: `VisionInputs`, every tensor already on the model's device -- the pixels, the placeholder rows the images
fill, and the constants of the images' grids (position-table taps, the 2-D RoPE's cos / sin). Made before the
forward (`vision_inputs`: the trainer's pack, the generator's prefill), so the forward copies nothing to the device
and reads nothing back: a trainer CUDA graph captures the tower, its backward included, and replays any pack of the
same grids (`VisionInputs.grids`, part of the pack's shape) with these tensors copied into its buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from monorl.model.vision_config import VisionConfig

TABLE_CACHE = 64  # grids whose tables are kept (`grid_tables`)
_table_cache: dict[tuple, tuple[Tensor, ...]] = {}

Grids = tuple[tuple[int, int, int], ...]


@dataclass
class VisionInputs:
    pixel_values: Tensor  # [patches, patch_dim] (`monorl.model.image_processing`'s order)
    rows: Tensor  # [image tokens] long: the placeholder rows of the flat tokens that take the images, in order
    pos_index: Tensor  # [patches, 4] long: the learned position grid's taps (bilinear) per patch
    pos_weight: Tensor  # [patches, 4] fp32: their weights
    cos: Tensor  # [patches, 1, 1, head_dim] fp32: the tower's 2-D RoPE
    sin: Tensor
    grids: Grids  # (frames, patch rows, patch columns) per image, host ints: every shape above follows from them
    tables_for: tuple  # the tower settings the tables were made for (`table_settings`): the tower checks them

    @property
    def lengths(self) -> list[int]:
        """Patches per frame of each image: the tower's attention runs within each."""
        return [h * w for t, h, w in self.grids for _ in range(t)]


def table_settings(cfg: VisionConfig) -> tuple:
    """The tower settings its grid tables depend on."""
    return cfg.spatial_merge_size, cfg.num_position_embeddings, cfg.head_dim, cfg.rope_theta


def vision_inputs(cfg: VisionConfig, pixel_values: Tensor, grids: Sequence[Sequence[int]] | Tensor, rows: Tensor,
                  device: torch.device | str) -> VisionInputs:
    """The `VisionInputs` of images (pixel_values, grids: `image_processing`'s, on any device) filling the placeholder
    `rows` (on any device), for a tower of `cfg` on `device`. The host-to-device copies are queued, not waited on.
    ValueError (one line) when pixel_values does not match the grids."""
    grids = tuple(tuple(int(v) for v in g) for g in (grids.tolist() if isinstance(grids, Tensor) else grids))
    patches = sum(t * h * w for t, h, w in grids)
    if tuple(pixel_values.shape) != (patches, cfg.patch_dim):
        raise ValueError(f"pixel_values has shape {list(pixel_values.shape)}; grid_thw {list(grids)} needs "
                         f"[{patches}, {cfg.patch_dim}]")
    device = torch.device(device)
    pixels = pixel_values.to(device, non_blocking=True)
    index, weight, cos, sin = grid_tables(cfg, grids, device)
    return VisionInputs(pixels, rows.to(device, non_blocking=True), index, weight, cos, sin, grids,
                        table_settings(cfg))


def grid_tables(cfg: VisionConfig, grids: Grids, device: torch.device) -> tuple[Tensor, ...]:
    """(position-table indices, their weights, RoPE cos, sin [patches, 1, 1, head_dim]) of images of `grids`:
    constants of the grids, made on `device` once per grids, settings and device and kept (a prompt's images recur at
    every step of its group's generation and training; ~100 small launches otherwise). Made as ordinary tensors
    (outside inference mode) so that a trainer's backward can save them; a graph copies them into its own buffers,
    so dropping one from the cache frees nothing a graph reads."""
    key = (table_settings(cfg), grids, str(device))
    if (hit := _table_cache.get(key)) is None:
        with torch.inference_mode(False), torch.no_grad():
            index, weight = _pos_taps(cfg, grids, device)
            cos, sin = _rope(cfg, grids, device)
            hit = (index, weight, cos[:, None, None], sin[:, None, None])
        if len(_table_cache) >= TABLE_CACHE:
            _table_cache.pop(next(iter(_table_cache)))  # the oldest
        _table_cache[key] = hit
    return hit


def _merge_order(cfg: VisionConfig, h: int, w: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(row, column) of each patch of an h x w grid in pixel_values' order: merge blocks row-major, each block's
    merge x merge patches row-major inside it."""
    m = cfg.spatial_merge_size
    rows = torch.arange(h, device=device)[:, None].expand(h, w).reshape(h // m, m, w // m, m)
    cols = torch.arange(w, device=device)[None, :].expand(h, w).reshape(h // m, m, w // m, m)
    return rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()


def _pos_taps(cfg: VisionConfig, grids: Grids, device: torch.device) -> tuple[Tensor, Tensor]:
    """The learned square position grid resampled bilinearly (align_corners) to each image's grid: 4 table indices
    and weights per patch (HF's get_vision_interpolation_indices_and_weights)."""
    side = round(cfg.num_position_embeddings ** 0.5)
    indices, weights = [], []
    for t, h, w in grids:
        rows, cols = _merge_order(cfg, h, w, device)
        (hi, hw), (wi, ww) = _axis_taps(rows, h, side), _axis_taps(cols, w, side)
        indices.append((hi[:, :, None] * side + wi[:, None, :]).reshape(-1, 4).repeat(t, 1))
        weights.append((hw[:, :, None] * ww[:, None, :]).reshape(-1, 4).repeat(t, 1))
    return torch.cat(indices), torch.cat(weights)


def _axis_taps(index: Tensor, size: int, side: int) -> tuple[Tensor, Tensor]:
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    return taps, (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)


def _rope(cfg: VisionConfig, grids: Grids, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos / sin [patches, head_dim] of the axial 2-D RoPE: the first half of each head's frequencies rotate by the
    patch's row, the second by its column (HF's Qwen3VLVisionRotaryEmbedding)."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float, device=device) / half))
    pos = torch.cat([torch.stack(_merge_order(cfg, h, w, device), -1).repeat(t, 1) for t, h, w in grids])
    freqs = (pos[..., None].float() * inv_freq).flatten(1)  # [N, 2 * head_dim / 4]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()
