"""Images -> the vision tower's inputs, as transformers' Qwen2-VL image processor (the PIL one, which Qwen3-VL uses)
makes them, with PIL and numpy only: each image resized (bicubic) to multiples of patch * merge pixels within
[min_pixels, max_pixels] (`smart_resize`), scaled to [0, 1], normalised, and cut into flattened patches
(`pixel_values [patches, C * t * p * p]`, merge blocks contiguous) with its grid (`grid_thw` [1, h, w] patches).
`placeholder` is the prompt text an image takes: <|vision_start|> + one <|image_pad|> per merged patch +
<|vision_end|>."""

from __future__ import annotations

import functools
import io
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from monorl.fsutil import read_json
from monorl.model.vision_config import VisionConfig

PREPROCESSOR_FILE = "preprocessor_config.json"
VIDEO_PREPROCESSOR_FILE = "video_preprocessor_config.json"
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("images in prompts need Pillow: pip install pillow") from None
    return Image


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen's resize rule: sides rounded to multiples of factor, the area brought into [min_pixels, max_pixels]
    keeping the aspect ratio as closely as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio must be under 200, got {max(height, width) / min(height, width)}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def load_image(image: Any) -> Any:
    """A PIL RGB image from what a dataset row holds (TRL's convention): a PIL image, a file path, bytes, or a
    `datasets` Image feature's undecoded {"bytes": ..., "path": ...}."""
    Image = _pil()
    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    if isinstance(image, bytes | bytearray):
        image = Image.open(io.BytesIO(image))
    elif isinstance(image, str | os.PathLike):
        if not Path(image).is_file():
            raise ValueError(f"image file {image} does not exist")
        image = Image.open(image)
    if not isinstance(image, Image.Image):
        raise ValueError(f"an image must be a PIL image, a path or bytes, got {type(image).__name__}")
    return image.convert("RGB")


@dataclass(frozen=True)
class ImageProcessor:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536  # Qwen3-VL's preprocessor_config.json ("size": shortest_edge / longest_edge)
    max_pixels: int = 16777216
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def for_model(cls, vision: VisionConfig, path: str | os.PathLike | None = None,
                  preprocessor: dict[str, Any] | None = None) -> ImageProcessor:
        """The tower's patch sizes, with the rest from a checkpoint directory's preprocessor_config.json when it has
        one, else from `preprocessor` (the same keys: a named shape's, `SHAPE_PREPROCESSORS`), else Qwen3-VL's.
        ValueError (one line, naming the file and key) for a setting monorl does not run."""
        base = cls(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                   merge_size=vision.spatial_merge_size)
        file = None if path is None else Path(path) / PREPROCESSOR_FILE
        if file is not None and file.is_file():
            pre, where = read_json(file, ValueError), str(file)
        elif preprocessor is not None:
            pre, where = preprocessor, "the shape's preprocessor"
        else:
            return base
        size = pre.get("size") or {}
        kw: dict[str, Any] = {
            "min_pixels": int(pre.get("min_pixels", size.get("shortest_edge", base.min_pixels))),
            "max_pixels": int(pre.get("max_pixels", size.get("longest_edge", base.max_pixels)))}
        for key in ("image_mean", "image_std"):
            if key in pre:
                kw[key] = tuple(float(v) for v in pre[key])
        for key in ("patch_size", "temporal_patch_size", "merge_size"):
            if key in pre and pre[key] != getattr(base, key):
                raise ValueError(f"{where}: {key}={pre[key]} is not the model's {getattr(base, key)}")
        check_preprocessor(pre, kw, where)
        return cls(**{**base.__dict__, **kw})

    def preprocessor_config(self) -> dict[str, Any]:
        """This processor as a preprocessor_config.json (what `for_model` reads back; transformers' Qwen2-VL image
        processor reads it too)."""
        return {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "do_rescale": True,
                "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
                "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
                "patch_size": self.patch_size, "temporal_patch_size": self.temporal_patch_size,
                "merge_size": self.merge_size, "image_mean": list(self.image_mean), "image_std": list(self.image_std)}

    def video_preprocessor_config(self) -> dict[str, Any]:
        """video_preprocessor_config.json for transformers' `Qwen3VLProcessor`, which loads a video processor beside the
        image one (monorl runs no videos): the tower's patch sizes and this normalisation, its other settings
        transformers' Qwen3-VL defaults."""
        return {"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": self.patch_size,
                "temporal_patch_size": self.temporal_patch_size, "merge_size": self.merge_size,
                "image_mean": list(self.image_mean), "image_std": list(self.image_std)}

    def write(self, directory: str | os.PathLike) -> None:
        """This processor's files in a checkpoint directory, beside its tokenizer's, so that transformers'
        `AutoProcessor.from_pretrained(directory)` makes the pixel values and grids this processor makes."""
        for name, data in ((PREPROCESSOR_FILE, self.preprocessor_config()),
                           (VIDEO_PREPROCESSOR_FILE, self.video_preprocessor_config())):
            (Path(directory) / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """[t, h, w] patches of an image of this size once resized."""
        h, w = smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def token_count(self, grid: Sequence[int]) -> int:
        """The placeholder tokens of an image of `grid`."""
        t, h, w = grid
        return t * h * w // self.merge_size ** 2

    def placeholder(self, grid: Sequence[int]) -> str:
        """The prompt text of one image: its placeholder tokens between the vision start and end tokens."""
        return VISION_START + IMAGE_PAD * self.token_count(grid) + VISION_END

    def _write_patches(self, image: Any, grid: tuple[int, int, int], out: np.ndarray) -> None:
        """An RGB PIL image's patches of `grid` into out [h * w, C * t * p * p]: resized (bicubic), each channel's
        levels through its table (`normalise_table`: HF's arithmetic, once per level), cut into patches in one copy."""
        _, gh, gw = grid
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        resized = np.asarray(image.resize((gw * p, gh * p), resample=_pil().Resampling.BICUBIC))  # [H, W, C] uint8
        table = normalise_table(self.image_mean, self.image_std)
        c = resized.shape[2]
        x = np.empty((c, *resized.shape[:2]), np.float32)
        for ch in range(c):
            x[ch] = table[ch][resized[..., ch]]
        x = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (gh, gw, mh, mw, C, p, p)
        # each patch's frame repeated t times (an image is t identical frames)
        np.copyto(out.reshape(*x.shape[:5], t, p, p), x[:, :, :, :, :, None])

    def __call__(self, images: Sequence[Any]) -> tuple[Tensor, Tensor]:
        """(pixel_values [patches, C * t * p * p] float32, grid_thw [images, 3] long) of images, in order: written
        straight into one array (no per-image arrays to concatenate)."""
        if not images:
            raise ValueError("no images to process")
        loaded = [load_image(image) for image in images]
        grids = [self.grid(im.height, im.width) for im in loaded]
        pixels = np.empty((sum(h * w for _, h, w in grids), 3 * self.temporal_patch_size * self.patch_size ** 2),
                          np.float32)
        start = 0
        for im, g in zip(loaded, grids, strict=True):
            self._write_patches(im, g, pixels[start:start + g[1] * g[2]])
            start += g[1] * g[2]
        return torch.from_numpy(pixels), torch.tensor(grids, dtype=torch.long)


@functools.lru_cache(maxsize=8)
def normalise_table(mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """[channels, 256] float32: each channel's normalised value of each 8-bit level, by HF's order of roundings
    (float64 * (1 / 255) -> float32, then (x - mean) / std in float32). A lookup gives every pixel exactly that
    value at a fifth of the arithmetic's host time (a 448 x 448 image: ~2 ms for ~10 ms)."""
    levels = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)
    return (levels[None, :] - np.array(mean, np.float32)[:, None]) / np.array(std, np.float32)[:, None]


# a named shape's preprocessor_config.json (no checkpoint directory to hold one): tiny-vl's images stay small
SHAPE_PREPROCESSORS: dict[str, dict[str, Any]] = {"tiny-vl": {"min_pixels": 64, "max_pixels": 1024}}
_ALWAYS_ON = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")


def check_preprocessor(pre: dict[str, Any], kw: dict[str, Any], where: str) -> None:
    """ValueError (one line) for a preprocessor setting other than what `ImageProcessor` does: every step on, 1/255
    rescaling, pixel bounds 0 < min <= max, one mean and std per channel."""
    if off := [k for k in _ALWAYS_ON if pre.get(k) is False]:
        raise ValueError(f"{where}: {off[0]}=false; monorl's image processor always resizes, rescales, normalises "
                         "and converts to RGB (remove the key)")
    if abs(float(pre.get("rescale_factor", 1 / 255)) - 1 / 255) > 1e-12:
        raise ValueError(f"{where}: rescale_factor={pre['rescale_factor']}; monorl runs 1/255 only")
    if not 0 < kw["min_pixels"] <= kw["max_pixels"]:
        raise ValueError(f"{where}: need 0 < min_pixels <= max_pixels, got {kw['min_pixels']}, {kw['max_pixels']}")
    for key in ("image_mean", "image_std"):
        if key in kw and len(kw[key]) != 3:
            raise ValueError(f"{where}: {key} has {len(kw[key])} values; an RGB image needs 3")
