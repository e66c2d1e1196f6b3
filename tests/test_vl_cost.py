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


class _Calls(torch.overrides.TorchFunctionMode):
    """The torch functions called, with the dims of their first argument."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int | None]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        first = args[0] if args else None
        self.calls.append((getattr(func, "__name__", str(func)), first.dim() if isinstance(first, torch.Tensor)
                           else None))
        return func(*args, **(kwargs or {}))

    def count(self, name: str) -> int:
        return sum(n == name for n, _ in self.calls)


def tiny_tower():
    from monorl.model.config import model_shape
    from monorl.model.vision import VisionTower

    torch.manual_seed(0)
    tower = VisionTower(model_shape("tiny-vl").vision)
    for p in tower.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return tower


def prepared(tower, pixels: torch.Tensor, grids: torch.Tensor):
    """The tower's `VisionInputs` of these images (no placeholder rows: the tower alone)."""
    from monorl.model.vision_inputs import vision_inputs

    return vision_inputs(tower.config, pixels, grids, torch.zeros(0, dtype=torch.long), "cpu")


def test_tower_attends_images_of_one_size_in_one_fused_call_per_block():
    # three images of one size: one 4-D attention call per block (the fused kernels take 4-D inputs; the tower ran
    # one 3-D call per image, the math path on CUDA), each image's output as it is alone; the position and RoPE
    # tables are made once per grids (the second preparation makes none: no arange)
    tower = tiny_tower()
    grids = torch.tensor([[1, 4, 4]] * 3)
    pixels = torch.randn(48, tower.config.patch_dim)
    with torch.no_grad():
        tower(prepared(tower, pixels, grids))
        with _Calls() as calls:
            out, deep = tower(prepared(tower, pixels, grids))
        alone = [tower(prepared(tower, pixels[16 * i:16 * (i + 1)], grids[:1])) for i in range(3)]
    attention = [d for n, d in calls.calls if n == "scaled_dot_product_attention"]
    assert attention == [4] * tower.config.depth
    assert calls.count("arange") == 0
    assert torch.equal(out, torch.cat([a[0] for a in alone]))
    assert all(torch.equal(d, torch.cat([a[1][j] for a in alone])) for j, d in enumerate(deep))


def test_tower_tables_are_ordinary_tensors_for_training_after_inference():
    # a tower first run under inference mode (the generator sharing the trainer's fp32 model on CPU) keeps tables
    # that a training forward's backward can save
    tower = tiny_tower()
    grids = torch.tensor([[1, 4, 4]])
    pixels = torch.randn(16, tower.config.patch_dim)
    with torch.inference_mode():
        tower(prepared(tower, pixels, grids))
    out, deep = tower(prepared(tower, pixels, grids))
    (out.sum() + sum(d.sum() for d in deep)).backward()
    assert tower.blocks[0].attn.qkv.weight.grad is not None


def test_image_embeds_reads_nothing_back_from_the_device():
    # a pack's image inputs (each trainer micro-batch, each prefill with images): the placeholder rows come from the
    # spans on the host and the copies are queued; reading the tokens back (`ids.cpu()`, `nonzero`) or a blocking
    # copy waited for the GPU's queue. The rows are the same: each image's placeholders, a sampled pad left as text
    from monorl.model.config import model_shape
    from monorl.model.decoder import build_model
    from monorl.model.qwen3_vl import image_embeds, placeholder_spans
    from monorl.model.vision_prompt import encode_with_images

    cfg = model_shape("tiny-vl")
    vision = cfg.vision
    model = build_model(cfg, torch.device("cpu"), torch.float32, seed=0)
    proc = ImageProcessor.for_model(vision, preprocessor={"min_pixels": 64, "max_pixels": 1024})
    picture = Image.fromarray(np.random.default_rng(1).integers(0, 256, (20, 28, 3), dtype=np.uint8))
    prompt, inputs = encode_with_images([5, vision.vision_start_token_id, vision.image_token_id,
                                         vision.vision_end_token_id, 6], [picture], vision, proc)
    seq = prompt + [7, vision.image_token_id, 8]  # a completion that samples the placeholder token: text
    ids = torch.tensor(seq + seq)
    spans = placeholder_spans([len(seq)] * 2, [inputs, inputs])
    with torch.no_grad(), _Calls() as calls:
        embeds, (rows, deep) = image_embeds(model, ids, [inputs, inputs], spans)
    assert not {"cpu", "nonzero", "item"} & {n for n, _ in calls.calls}
    pads = [i for i, t in enumerate(ids.tolist()) if t == vision.image_token_id and i % len(seq) < len(prompt)]
    assert rows.tolist() == pads and len(pads) == 2 * inputs.spans[0][1] - 2 * inputs.spans[0][0]
    text = torch.ones(len(ids), dtype=torch.bool)
    text[rows] = False
    assert torch.equal(embeds[text], model.model.embed_tokens(ids)[text])
