"""A vision-language checkpoint monorl writes (#59) holds its image processor's files beside the tokenizer's
(preprocessor_config.json, video_preprocessor_config.json), so transformers (the oracle) loads the processor from the
directory and makes from an image the pixel values and grid monorl's own processor makes: a saved model, and a run's
final checkpoint (the run's processor: a named shape's bounds, or the source checkpoint's file)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from monorl.cliargs import run_config
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.hf_checkpoint import save_checkpoint
from monorl.model.image_processing import ImageProcessor
from monorl.model.tokenizer import CharTokenizer

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")


def _images() -> list:
    rng = np.random.default_rng(0)
    return [Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)) for h, w in [(20, 30), (70, 33), (5, 9)]]


def _same_as_transformers(path: Path, ours: ImageProcessor) -> None:
    theirs = transformers.AutoImageProcessor.from_pretrained(path)  # AutoProcessor's image processor
    ref = theirs(_images(), return_tensors="pt")
    pixels, grid = ours(_images())
    assert grid.tolist() == ref["image_grid_thw"].tolist()
    assert torch.equal(pixels, ref["pixel_values"])
    tok = transformers.AutoTokenizer.from_pretrained(path)
    vision = model_shape("tiny-vl").vision
    assert tok.convert_tokens_to_ids("<|image_pad|>") == vision.image_token_id
    video = json.loads((path / "video_preprocessor_config.json").read_text())
    assert video["video_processor_type"] == "Qwen3VLVideoProcessor"
    assert (video["patch_size"], video["merge_size"]) == (vision.patch_size, vision.spatial_merge_size)


def test_a_saved_vision_language_model_loads_its_processor_in_transformers(tmp_path: Path) -> None:
    m = model_shape("tiny-vl")
    pre = {"min_pixels": 64, "max_pixels": 2304, "image_mean": [0.4, 0.45, 0.5], "image_std": [0.2, 0.25, 0.3]}
    ours = ImageProcessor.for_model(m.vision, preprocessor=pre)
    save_checkpoint(build_model(m, seed=1), tmp_path / "out", tokenizer=CharTokenizer(vision=True), processor=ours)
    _same_as_transformers(tmp_path / "out", ours)
    # without a processor: the tower's patch sizes with Qwen3-VL's defaults, read back as such by monorl too
    save_checkpoint(build_model(m, seed=1), tmp_path / "bare", tokenizer=CharTokenizer(vision=True))
    default = ImageProcessor.for_model(m.vision)
    assert ImageProcessor.for_model(m.vision, tmp_path / "bare") == default
    _same_as_transformers(tmp_path / "bare", default)
    # a text model's checkpoint has none
    save_checkpoint(build_model(model_shape("tiny"), seed=1), tmp_path / "text", tokenizer=CharTokenizer())
    assert not (tmp_path / "text" / "preprocessor_config.json").exists()


def test_a_runs_final_checkpoint_holds_the_runs_processor(tmp_path: Path) -> None:
    from monorl.model.section import ModelSection
    from monorl.model.source import image_processor
    from monorl.run.grpo import GRPORun

    cfg = run_config("tiny_vision", {"device": "cpu", "steps": "1", "warm_start.steps": "0",
                                     "validation.num_prompts": "0", "run_dir": str(tmp_path / "run")})
    GRPORun(cfg, progress=False).run()
    final = tmp_path / "run" / "checkpoints" / "final"
    ours = image_processor(ModelSection(shape="tiny-vl"), model_shape("tiny-vl"))  # the shape's small bounds
    vision = model_shape("tiny-vl").vision
    assert ImageProcessor.for_model(vision, final) == ours != ImageProcessor.for_model(vision)
    _same_as_transformers(final, ours)


def test_auto_processor_loads_the_export(tmp_path: Path) -> None:
    """The whole `AutoProcessor` (Qwen3VLProcessor: its video processor needs torchvision)."""
    pytest.importorskip("torchvision")
    m = model_shape("tiny-vl")
    ours = ImageProcessor.for_model(m.vision, preprocessor={"min_pixels": 64, "max_pixels": 2304})
    save_checkpoint(build_model(m, seed=1), tmp_path / "out", tokenizer=CharTokenizer(vision=True), processor=ours)
    processor = transformers.AutoProcessor.from_pretrained(tmp_path / "out")
    out = processor(text=["a <|vision_start|><|image_pad|><|vision_end|> b"], images=_images()[:1], return_tensors="pt")
    pixels, grid = ours(_images()[:1])
    assert out["image_grid_thw"].tolist() == grid.tolist() and torch.equal(out["pixel_values"], pixels)
    assert int((out["input_ids"] == m.vision.image_token_id).sum()) == ours.token_count(grid[0].tolist())
