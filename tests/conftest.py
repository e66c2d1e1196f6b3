"""Shared fixtures. The oracle for "is the model right" is HF transformers' Qwen3ForCausalLM, built
tiny and random here and saved with `save_pretrained`, so every test reads a real HF checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@torch.no_grad()
def randomize_hf_model(model: torch.nn.Module, seed: int = 0, std: float = 0.1) -> None:
    """Overwrite HF's init (tiny matrices, unit norms) with larger values and non-unit norm weights, so
    logits are O(1) and a swapped or mis-mapped tensor (even a q_norm/k_norm mix-up) shows in them."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # tied lm_head is the embedding: visited once
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else std * noise)


@pytest.fixture
def make_hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: a tiny random HF Qwen3ForCausalLM saved with `save_pretrained`; returns its directory.

    Keywords: any Qwen3Config field (tie_word_embeddings, num_attention_heads, num_key_value_heads,
    head_dim, vocab_size, ...), plus dtype (stored dtype, default fp32), max_shard_size (passed to
    save_pretrained: int bytes or "20KB"), seed, path (where to save; default a fresh tmp dir).
    """
    import transformers

    def make(*, dtype: torch.dtype = torch.float32, max_shard_size: int | str | None = None, seed: int = 0,
             path: Path | None = None, **config_kw: Any) -> Path:
        kw: dict[str, Any] = dict(
            vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            bos_token_id=None, eos_token_id=1,
        )
        kw.update(config_kw)
        torch.manual_seed(seed)
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw))
        randomize_hf_model(model, seed)
        model = model.to(dtype)
        out = path or tmp_path_factory.mktemp("hf_ckpt")
        save_kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(out, **save_kw)
        return Path(out)

    return make


@pytest.fixture
def load_hf_model() -> Callable[..., torch.nn.Module]:
    """Load a checkpoint directory with transformers (the oracle), eval mode, default fp32."""
    import transformers

    def load(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        return transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=dtype).eval()

    return load
