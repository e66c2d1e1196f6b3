"""The run config's `model` section: where the policy's weights come from (`monorl.model.source` reads it)."""

from __future__ import annotations

from dataclasses import dataclass

from monorl.model.attention import AttnBackend


@dataclass
class ModelSection:
    # the weights to start from: an HF checkpoint directory (config.json + safetensors + tokenizer.json), a GGUF
    # file (dequantized at load), a Hub name ORG/NAME (the HF cache, else a download), or a monorl run directory
    # (its checkpoints/final)
    path: str | None = None
    shape: str | None = None  # without a path: random weights of this named shape (monorl.model.config.MODEL_SHAPES)
    random_init: bool = False  # with a path: random weights of its config.json instead of its weights
    init_seed: int = 0  # seed of the random weights (model.shape or model.random_init)
    attn_backend: AttnBackend = "auto"  # auto: flash on CUDA in bf16, else sdpa
    # a vision-language model (Qwen3-VL): train the language model only; the vision tower takes no gradients and
    # stays out of the optimizer, and the trainer runs it forward only (LoRA adapts the language model's projections
    # only, whatever this says). Off by default, as in TRL and verl, which train the tower
    freeze_vision: bool = False
