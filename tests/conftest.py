"""Shared fixtures and helpers. The oracle for "is the model right" is HF transformers' Qwen3ForCausalLM, built
tiny and random here and saved with `save_pretrained`, so every test reads a real HF checkpoint.

Helpers other test files use are plain names here: `from tests.conftest import DigitsTask, digits_cfg`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from monorl.config import RunConfig
from monorl.presets import preset
from monorl.tasks.base import Prompt, Task


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


# monorl's families (`monorl.model.families`) -> transformers' (config class, model class): the oracles
HF_FAMILY_CLASSES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
                     "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                     "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
                     "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
                     "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
                     "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
                     "gpt_oss": ("GptOssConfig", "GptOssForCausalLM")}


@pytest.fixture
def make_hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: a tiny random HF model of a family (`family`: qwen3, llama, qwen2 or qwen3_moe; transformers' own
    class)
    saved with `save_pretrained`; returns its directory.

    Keywords: any field of the family's config class (tie_word_embeddings, num_attention_heads,
    num_key_value_heads, head_dim, vocab_size, rope_parameters, attention_bias, ...), plus dtype (stored dtype,
    default fp32), max_shard_size (passed to save_pretrained: int bytes or "20KB"), seed, path (where to save;
    default a fresh tmp dir).
    """
    import transformers

    def make(*, family: str = "qwen3", dtype: torch.dtype = torch.float32,
             max_shard_size: int | str | None = None, seed: int = 0, path: Path | None = None,
             **config_kw: Any) -> Path:
        kw: dict[str, Any] = dict(
            vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            bos_token_id=None, eos_token_id=1,
        )
        if family in ("qwen3", "qwen3_moe"):
            kw["head_dim"] = 16
        kw.update(config_kw)
        torch.manual_seed(seed)
        config_cls, model_cls = HF_FAMILY_CLASSES[family]
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kw))
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
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()

    return load


# ---- a short RL run --------------------------------------------------------------------------------

class DigitsTask(Task):
    """Rewards the share of digits in the completion: a random model already gets varied rewards, so the
    loop has a learning signal from step 0 without a warm start. Loaded by the loop as a user task."""

    name = "digits"
    reward_components = ("digits",)

    def train_prompts(self, seed: int = 0, start: int = 0):
        i = start
        while True:
            yield Prompt(text=f"Say numbers {i % 7}", answer=None, meta={"index": i})
            i += 1

    def val_prompts(self, n: int) -> list[Prompt]:
        return [Prompt(text=f"Say numbers {i}", answer=None, meta={"index": i}) for i in range(n)]

    def reward(self, prompt: Prompt, completion: str) -> dict[str, float]:
        if "!" in completion:
            raise RuntimeError("a reward function that raises: logged, scored 0, the run goes on")
        return {"digits": sum(c.isdigit() for c in completion) / max(1, len(completion))}


def digits_cfg(tmp_path: Path, steps: int = 3) -> RunConfig:
    """The tiny preset cut down to seconds on CPU, on `DigitsTask`, in `tmp_path / "run"`."""
    cfg = preset("tiny")
    cfg.run_dir = str(tmp_path / "run")
    cfg.steps = steps
    cfg.task.name, cfg.task.args = "tests.conftest:DigitsTask", {}
    cfg.warm_start.steps = 0
    cfg.validation.num_prompts = 4
    cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 4, 6, 12
    cfg.trainer.lr = 1e-3
    return cfg


# ---- GPU oracles -----------------------------------------------------------------------------------

def full_forward_logprobs(model, prompt: list[int], completion: list[int], temperature: float,
                          device: str = "cuda") -> torch.Tensor:
    """Log-probs of `completion` after `prompt` from one eager full forward on `device` (no cache, no graphs)."""
    from monorl.model.attention import VarlenContext
    from monorl.model.logprobs import token_logprobs

    ids = torch.tensor(prompt + completion, device=device)
    ctx = VarlenContext.from_lengths([len(ids)], device)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        logits = model.compute_logits(model(ids, ctx.positions, ctx))[len(prompt) - 1:-1]
    return token_logprobs(logits, torch.tensor(completion, device=device), temperature).cpu()
