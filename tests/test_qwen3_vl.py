"""Qwen3-VL in monorl against transformers' Qwen3VLForConditionalGeneration (the oracle; eager attention, fp32,
CPU): logits of prompts holding 1-3 images of different sizes, the images preprocessed by monorl
(`monorl.model.image_processing`, itself checked against transformers' PIL image processor), the checkpoint
loaded through monorl's HF loader and saved back."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from monorl.model.attention import VarlenContext
from monorl.model.config import ModelConfig, model_shape
from monorl.model.decoder import build_model
from monorl.model.hf_checkpoint import load_checkpoint, save_checkpoint
from monorl.model.image_processing import ImageProcessor
from monorl.model.mrope import mrope_positions
from monorl.model.qwen3_vl import embed_images
from monorl.model.qwen3_vl_hf import HF_TEXT_DEFAULTS, QWEN3_VL_2B
from monorl.model.vision_config import HF_VISION_DEFAULTS, HF_VL_TOKEN_DEFAULTS
from monorl.model.vision_inputs import vision_inputs
from tests.conftest import randomize_hf_model

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

IMAGE, START, END = 150, 152, 153
PROCESSOR = ImageProcessor(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=64, max_pixels=48 * 48,
                           image_mean=(0.48, 0.45, 0.41), image_std=(0.27, 0.26, 0.28))


def tiny_hf_config(tie: bool = False) -> object:
    text = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 2])
    return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                      video_token_id=151, vision_start_token_id=START, vision_end_token_id=END,
                                      tie_word_embeddings=tie)


def images(seed: int, sizes: list[tuple[int, int]]) -> list:
    g = torch.Generator().manual_seed(seed)
    return [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())
            for h, w in sizes]


def prompt(seed: int, grids: list, texts: int = 4) -> list[int]:
    """Random text tokens around each image's placeholder run."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 150, (texts,), generator=g).tolist()
    for grid in grids:
        ids += [START] + [IMAGE] * PROCESSOR.token_count(grid) + [END]
        ids += torch.randint(0, 150, (texts,), generator=g).tolist()
    return ids


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.Qwen3VLForConditionalGeneration(tiny_hf_config(request.param)).eval()
    with torch.no_grad():
        randomize_hf_model(hf, seed=1)
    path = tmp_path_factory.mktemp("qwen3_vl")
    hf.save_pretrained(path)
    hf.config._attn_implementation = "eager"
    for sub in (hf.config.text_config, hf.config.vision_config):
        sub._attn_implementation = "eager"
    return hf, path


def test_preprocessing_equals_transformers_pil_processor():
    ours = PROCESSOR
    theirs = transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil(
        patch_size=4, temporal_patch_size=2, merge_size=2, image_mean=list(ours.image_mean),
        image_std=list(ours.image_std), size={"shortest_edge": 64, "longest_edge": 48 * 48})
    imgs = images(3, [(20, 30), (70, 33), (5, 9), (64, 64)])  # below min, above max, non-multiples
    ref = theirs(imgs, return_tensors="pt")
    pixels, grid = ours(imgs)
    assert grid.tolist() == ref["image_grid_thw"].tolist()
    assert torch.equal(pixels, ref["pixel_values"])


@pytest.mark.parametrize("sizes", [[(16, 24)], [(24, 16), (40, 40)], [(8, 8), (17, 33), (30, 12)]])
def test_logits_equal_transformers(checkpoint, sizes):
    hf, path = checkpoint
    model = load_checkpoint(path, dtype=torch.float32)
    assert model.config.vision is not None and model.config.rope_kind(0) == "mrope"
    seqs, pix, grids = [], [], []
    for k in range(2):  # two prompts packed into one monorl forward, each its own HF forward
        pixel_values, grid_thw = PROCESSOR(images(10 * k + len(sizes), sizes[k:] + sizes[:k]))
        seqs.append(prompt(k, grid_thw.tolist()))
        pix.append(pixel_values)
        grids.append(grid_thw)
    ref = []
    with torch.no_grad():
        for ids, pixel_values, grid_thw in zip(seqs, pix, grids, strict=True):
            input_ids = torch.tensor([ids])
            out = hf(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=grid_thw,
                     mm_token_type_ids=(input_ids == IMAGE).int())
            ref.append(out.logits[0])
        ids = torch.tensor([t for s in seqs for t in s])
        positions = torch.cat([mrope_positions(s, g.tolist(), IMAGE, 2)[0]
                               for s, g in zip(seqs, grids, strict=True)], dim=1)
        ctx = VarlenContext.from_lengths([len(s) for s in seqs], "cpu", "sdpa")
        rows = (ids == IMAGE).nonzero().squeeze(1)  # every placeholder takes an image
        prepared = vision_inputs(model.config.vision, torch.cat(pix), torch.cat(grids), rows, "cpu")
        embeds, deepstack = embed_images(model, ids, prepared)
        logits = model.compute_logits(model(ids, positions, ctx, inputs_embeds=embeds, deepstack=deepstack))
    diff = (logits - torch.cat(ref)).abs().max().item()
    print(f"max |logit diff| vs transformers: {diff:.3g}")
    assert diff <= 1e-4


def test_text_only_prompt_equals_transformers(checkpoint):
    """No image: M-RoPE's three rows are equal, the rotation plain RoPE's."""
    hf, path = checkpoint
    model = load_checkpoint(path, dtype=torch.float32)
    ids = list(range(5, 40))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
        (logits,) = model.logits_for([ids])
    assert (logits - ref).abs().max().item() <= 1e-4


def test_save_loads_in_transformers(checkpoint, tmp_path):
    hf, path = checkpoint
    model = load_checkpoint(path, dtype=torch.float32)
    save_checkpoint(model, tmp_path / "out")
    again = transformers.Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    ours = again.state_dict()
    for name, t in hf.state_dict().items():
        assert torch.equal(ours[name], t), name
    assert load_checkpoint(tmp_path / "out").config == model.config


def test_mrope_positions_equal_get_rope_index(checkpoint):
    hf, _ = checkpoint
    grids = [[1, 4, 6], [1, 2, 2], [1, 6, 2]]
    ids = prompt(7, grids)
    input_ids = torch.tensor([ids])
    ref, delta = hf.model.get_rope_index(input_ids, (input_ids == IMAGE).int(), torch.tensor(grids))
    ours, next_pos = mrope_positions(ids, grids, IMAGE, 2)
    assert torch.equal(ours, ref[:, 0])
    assert next_pos == len(ids) + int(delta)
    with pytest.raises(ValueError, match="image 1 needs 100 image tokens, the sequence has 1"):
        mrope_positions(ids, [[1, 4, 6], [1, 2, 2 * 100], [1, 6, 2]], IMAGE, 2)


def test_hard_coded_defaults_equal_transformers():
    text, vision, top = (transformers.Qwen3VLTextConfig(), transformers.Qwen3VLVisionConfig(),
                         transformers.Qwen3VLConfig())
    for key, value in HF_TEXT_DEFAULTS.items():
        got = text.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(text, key)
        assert got == value, key
    for key, value in HF_VISION_DEFAULTS.items():
        assert list(v) == value if isinstance(v := getattr(vision, key), tuple | list) else v == value, key
    for key, value in HF_VL_TOKEN_DEFAULTS.items():
        assert getattr(top, key) == value, key


def test_vision_config_is_a_frozen_field():
    cfg = load_checkpoint.__globals__["ModelConfig"].from_hf(tiny_hf_config().to_dict())
    assert dataclasses.is_dataclass(cfg.vision) and cfg.vision.deepstack_visual_indexes == (0, 2)


def test_qwen3_vl_2b_shape_is_the_released_config_in_transformers():
    """The `qwen3-vl-2b` shape (`QWEN3_VL_2B`, the released config.json's numbers): transformers reads the same
    config from it, its token ids are Qwen3VLConfig's defaults, and both build a model of Qwen3-VL-2B's
    2,127,532,032 parameters (406,957,056 of them the tower's)."""
    cfg = model_shape("qwen3-vl-2b")
    hf = transformers.Qwen3VLConfig(**QWEN3_VL_2B)
    assert ModelConfig.from_hf(hf.to_dict()) == cfg
    assert hf.text_config.rope_parameters["rope_theta"] == cfg.rope_theta == 5e6
    assert {k: getattr(cfg.vision, k) for k in HF_VL_TOKEN_DEFAULTS} == HF_VL_TOKEN_DEFAULTS
    with torch.device("meta"):
        ref = transformers.Qwen3VLForConditionalGeneration(hf)
    ours = build_model(cfg, "meta", seed=None)
    counts = [sum(p.numel() for p in m.parameters()) for m in (ref, ours, ref.model.visual, ours.model.visual)]
    assert counts == [2_127_532_032] * 2 + [406_957_056] * 2
