"""The host and launch cost of a prompt's images (#59: the VL RL step against the text-only one), checked by counts
and values rather than times: the image processor's per-level table, the tower's attention calls and the trainer's
micro-batch inputs. Values stay as they were (tests/test_qwen3_vl.py: equal to transformers')."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from monorl.model.image_processing import ImageProcessor, normalise_table

Image = pytest.importorskip("PIL.Image")


@pytest.mark.parametrize("mean, std", [((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
                                       ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))])
def test_processor_normalises_through_a_table_by_hf_arithmetic(mean, std):
    # every 8-bit level of every channel, in a picture whose sides are already multiples of the patch grid (no
    # resampling): the processor's values are HF's float64-then-float32 arithmetic's, bit for bit
    levels = np.arange(256, dtype=np.uint8)
    rgb = np.stack([levels, levels[::-1], np.roll(levels, 7)], -1).reshape(16, 16, 3)
    proc = ImageProcessor(patch_size=4, merge_size=2, min_pixels=64, max_pixels=16 * 16, image_mean=mean,
                          image_std=std)
    pixels, grid = proc([Image.fromarray(rgb)])
    x = (rgb.astype(np.float64) * (1 / 255)).astype(np.float32)
    x = ((x - np.array(mean, np.float32)) / np.array(std, np.float32)).transpose(2, 0, 1)
    x = x.reshape(3, 2, 2, 4, 2, 2, 4).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], 2, 4, 4)).reshape(16, 96)
    assert grid.tolist() == [[1, 4, 4]]
    assert torch.equal(pixels, torch.from_numpy(np.ascontiguousarray(x)))
    table = normalise_table(mean, std)
    assert table.dtype == np.float32 and table.shape == (3, 256)
