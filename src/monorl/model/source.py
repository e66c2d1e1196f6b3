"""Where a run's policy comes from (`--model.path` / `--model.shape`): its architecture and tokenizer without
reading any weights (the memory plan runs on this), then the weights."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from monorl.model.config import MODEL_SHAPES, ModelConfig, model_shape
from monorl.model.decoder import DecoderForCausalLM, build_model
from monorl.model.gguf import gguf_file
from monorl.model.hf_checkpoint import load_checkpoint, load_config, load_tokenizer
from monorl.model.hub import resolve_model_path
from monorl.model.image_processing import SHAPE_PREPROCESSORS, ImageProcessor
from monorl.model.tokenizer import TOKENIZER_FILE, CharTokenizer

if TYPE_CHECKING:
    from monorl.model.section import ModelSection


def resolve_model(m: ModelSection) -> tuple[ModelConfig, Any, str]:
    """The policy's architecture, its tokenizer, and a line saying where its weights will come from -- without
    reading any weights: a checkpoint's weights (`path`), random weights of its config.json (`path` +
    `random_init`), or random weights of a named shape (`shape`, no path). A path always means "load these weights"
    unless random_init is set: a preset's shape never overrides it."""
    if m.path:
        path, origin = resolve_model_path(m.path)  # a local directory, or a Hub name through its cache
        mcfg = load_config(path)  # names a missing directory or config.json first
        # the char tokenizer would silently mis-tokenize a real vocab (a GGUF file carries its tokenizer)
        if gguf_file(path) is None and not (path / TOKENIZER_FILE).is_file():
            raise FileNotFoundError(f"model.path {path} has no {TOKENIZER_FILE}: copy the model's tokenizer files "
                                    "there (tokenizer.json, tokenizer_config.json)")
        tok = load_tokenizer(path)
        if m.random_init:
            source = f"random init (seed {m.init_seed}) of {path / 'config.json'} (model.random_init=true)"
        else:
            source = f"weights of {path}{origin}"
    else:
        if m.shape is None:
            raise ValueError("model.path is not set: give --model.path <HF checkpoint dir>, or --model.shape NAME for "
                             f"random weights of a named shape ({', '.join(MODEL_SHAPES)})")
        mcfg = model_shape(m.shape)
        tok = CharTokenizer(vision=mcfg.vision is not None)
        source = f"random init (seed {m.init_seed}) of shape {m.shape!r}"
    if tok.vocab_size > mcfg.vocab_size:
        raise ValueError(f"tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {mcfg.vocab_size}")
    return mcfg, tok, source


def load_policy(m: ModelSection, device: torch.device, dtype: torch.dtype = torch.float32,
                resolved: tuple[ModelConfig, Any, str] | None = None) -> tuple[DecoderForCausalLM, Any, str]:
    """The policy (in `dtype`: the trainer's fp32 masters, or a LoRA run's frozen base), its tokenizer, and the
    line `resolve_model` gives (pass its result as `resolved` when already at hand: a real tokenizer takes ~1 s
    to read)."""
    mcfg, tok, source = resolved or resolve_model(m)
    if m.path and not m.random_init:
        model = load_checkpoint(resolve_model_path(m.path)[0], device=device, dtype=dtype)
    else:
        model = build_model(mcfg, device, dtype, seed=m.init_seed)
    return model, tok, source


def image_processor(m: ModelSection, mcfg: ModelConfig) -> ImageProcessor | None:
    """A vision-language policy's image processor (None for a text model): the checkpoint directory's
    preprocessor_config.json (`--model.path`), a named shape's (`SHAPE_PREPROCESSORS`), else Qwen3-VL's bounds with
    the tower's patch sizes. The generator's (`Generator.image_processor`) and so the rollouts' and warm start's."""
    if mcfg.vision is None:
        return None
    path = resolve_model_path(m.path)[0] if m.path else None
    if path is not None and not path.is_dir():  # a GGUF file: its directory holds no preprocessor
        path = None
    return ImageProcessor.for_model(mcfg.vision, path, None if m.path else SHAPE_PREPROCESSORS.get(m.shape or ""))
