"""A vision-language run's memory plan and image processor (#59): the plan's weight rows hold the tower (what the run
allocates), its prompts' image tokens at the processor's max_pixels size the packs and the KV cache, the tower's
activations add to the trainer's and the prefill's; a checkpoint's preprocessor_config.json sets the run's
processor, and a setting monorl does not run stops it in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from monorl.cliargs import run_config
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.hf_checkpoint import save_checkpoint
from monorl.model.section import ModelSection
from monorl.model.source import image_processor
from monorl.model.tokenizer import CharTokenizer
from monorl.plan import plan_memory
from monorl.plan_params import param_counts
from monorl.run.grpo import GRPORun

pytest.importorskip("PIL.Image")


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _cfg(tmp_path: Path, **extra: str):
    return run_config("tiny_vision", {"device": "cpu", "steps": "1", "warm_start.steps": "0",
                                      "validation.num_prompts": "0", "run_dir": str(tmp_path / "run"), **extra})


@pytest.mark.parametrize("freeze", [False, True])
def test_plan_counts_the_tower_and_the_image_tokens(tmp_path: Path, freeze: bool):
    run = GRPORun(_cfg(tmp_path, **{"model.freeze_vision": str(freeze).lower()}), progress=False)
    plan, m = run.plan, run.spec.model_config
    assert param_counts(m)["vision"] == _nbytes(run.policy.model.visual.parameters()) // 4 > 0
    assert plan.row("policy weights").bytes == _nbytes(run.policy.parameters())
    trainable = [p for p in run.policy.parameters() if p.requires_grad]
    assert plan.row("gradients").bytes == _nbytes(trainable)
    assert plan.row("optimizer state").bytes == 2 * _nbytes(trainable)
    # the longest prompt: its text (one pad per image) + its one image at max_pixels (1024 px: 16 tokens)
    text = max(len(run.spec.tokenizer.encode(run.spec.task.render(p, run.spec.tokenizer)))
               for p in [next(run.spec.task.train_prompts(0))])
    assert run.spec.max_prompt_tokens == text + 15
    # the tower's activations: in the trainer's pack and the prefill, more than the same plan without images
    bare = plan_memory(run.cfg, m, run.spec.max_prompt_tokens, None, on_gpu=False)
    with_images = plan_memory(run.cfg, m, run.spec.max_prompt_tokens, None, on_gpu=False, image_tokens=15)
    for row in ("trainer activations", "generator prefill"):
        assert with_images.row(row).bytes > bare.row(row).bytes, row
    assert "the tower" in with_images.row("trainer activations").note


def _checkpoint(tmp_path: Path, preprocessor: dict | None) -> Path:
    path = tmp_path / "tiny_vl"
    save_checkpoint(build_model(model_shape("tiny-vl"), seed=1), path, tokenizer=CharTokenizer(vision=True))
    if preprocessor is not None:
        (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return path


def test_checkpoint_preprocessor_sets_the_runs_processor(tmp_path: Path):
    pre = {"size": {"shortest_edge": 256, "longest_edge": 4096}, "patch_size": 4, "temporal_patch_size": 2,
           "merge_size": 2, "image_mean": [0.4, 0.45, 0.5], "image_std": [0.2, 0.25, 0.3]}
    path = _checkpoint(tmp_path, pre)
    run = GRPORun(_cfg(tmp_path, **{"model.path": str(path), "model.shape": ""}), progress=False)
    proc = run.generator.image_processor
    assert (proc.min_pixels, proc.max_pixels) == (256, 4096)
    assert proc.image_mean == (0.4, 0.45, 0.5) and proc.image_std == (0.2, 0.25, 0.3)
    assert run.spec.tokenizer.encode("<|image_pad|>") == [model_shape("tiny-vl").vision.image_token_id]
    # 4096 pixels: 64 tokens per image at most, in the plan's longest prompt
    assert run.spec.max_prompt_tokens == len(run.spec.tokenizer.encode(
        run.spec.task.render(next(run.spec.task.train_prompts(0)), run.spec.tokenizer))) + 63
    # a directory without the file: Qwen3-VL's pixel bounds, the tower's patch sizes
    bare = image_processor(ModelSection(path=str(_checkpoint(tmp_path / "b", None))), model_shape("tiny-vl"))
    assert (bare.min_pixels, bare.patch_size) == (65536, 4)
    # a named shape: its own bounds; a text model: none
    assert image_processor(ModelSection(shape="tiny-vl"), model_shape("tiny-vl")).max_pixels == 1024
    assert image_processor(ModelSection(shape="tiny"), model_shape("tiny")) is None


@pytest.mark.parametrize("bad,message", [
    ({"rescale_factor": 0.5}, "rescale_factor=0.5; monorl runs 1/255 only"),
    ({"do_normalize": False}, "do_normalize=false"),
    ({"patch_size": 16}, "patch_size=16 is not the model's 4"),
    ({"min_pixels": 4096, "max_pixels": 256}, "need 0 < min_pixels <= max_pixels"),
    ({"image_mean": [0.5]}, "image_mean has 1 values"),
])
def test_preprocessor_settings_monorl_does_not_run(tmp_path: Path, bad: dict, message: str):
    path = _checkpoint(tmp_path, bad)
    with pytest.raises(ValueError, match="preprocessor_config.json: " + message.replace("(", r"\(")) as e:
        image_processor(ModelSection(path=str(path)), model_shape("tiny-vl"))
    assert "\n" not in str(e.value)


def test_plan_counts_the_images_an_episodes_tools_may_return():
    """An agent episode's tool images (rollout.max_tool_images at the processor's max_pixels, within max_new_tokens)
    add the tower's activations to the trainer's pack and the generator's turn prefill."""
    from monorl.model.image_processing import SHAPE_PREPROCESSORS, ImageProcessor
    from monorl.plan_images import tool_image_tokens_bound

    cfg = run_config("tiny_vision", {"rollout.max_tool_images": "2", "rollout.max_new_tokens": "100"})
    m = model_shape("tiny-vl")
    proc = ImageProcessor.for_model(m.vision, preprocessor=SHAPE_PREPROCESSORS["tiny-vl"])  # 16 tokens an image
    assert tool_image_tokens_bound(2, 100, True, proc) == 32
    assert tool_image_tokens_bound(8, 100, True, proc) == 100  # within the completion budget
    assert tool_image_tokens_bound(2, 100, False, proc) == tool_image_tokens_bound(2, 100, True, None) == 0
    bare = plan_memory(cfg, m, 40, None, on_gpu=False)
    tools = plan_memory(cfg, m, 40, None, on_gpu=False, tool_image_tokens=32)
    for row in ("trainer activations", "generator prefill"):
        assert tools.row(row).bytes > bare.row(row).bytes, row
    # the trainer's pack at the completions' image share (32 of 100 tokens), above the prompts' (5 of 40)
    prompts = plan_memory(cfg, m, 40, None, on_gpu=False, image_tokens=5)
    both = plan_memory(cfg, m, 40, None, on_gpu=False, image_tokens=5, tool_image_tokens=32)
    assert both.row("trainer activations").bytes == tools.row("trainer activations").bytes \
        > prompts.row("trainer activations").bytes
