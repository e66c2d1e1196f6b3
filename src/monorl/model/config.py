"""Qwen3 dense architecture hyper-parameters, named shapes, and the HF config.json mapping."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_params(self) -> int:
        d, f, h, kv, hd = self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim
        attn = d * h * hd * 2 + d * kv * hd * 2 + 2 * hd
        block = attn + 3 * d * f + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * block + emb + d

    # ---- HF config.json ------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF `config.json`; raises ValueError for other architectures."""
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        if model_type != "qwen3" or (archs and not set(archs) & set(SUPPORTED_ARCHITECTURES)):
            raise ValueError(
                f"unsupported architecture: model_type={model_type!r}, architectures={archs}; "
                f"monorl supports {list(SUPPORTED_ARCHITECTURES)} (model_type 'qwen3')"
            )
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"unsupported rope_type {rope_type!r} (only 'default' RoPE is implemented)")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        if hf.get("attention_bias"):
            raise ValueError("unsupported: attention_bias=true (Qwen3 has no attention bias)")
        if hf.get("use_sliding_window"):
            raise ValueError("unsupported: use_sliding_window=true")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf.get('hidden_act')!r}")
        try:
            return cls(
                vocab_size=hf["vocab_size"],
                hidden_size=hf["hidden_size"],
                intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=hf["num_attention_heads"],
                num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
                rope_theta=float(theta),
                rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                max_position_embeddings=hf.get("max_position_embeddings", 40960),
                tie_word_embeddings=hf.get("tie_word_embeddings", False),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_id=hf.get("eos_token_id"),
            )
        except KeyError as e:
            raise ValueError(f"config.json is missing required key {e.args[0]!r}") from None

    def to_hf(self, dtype: str = "bfloat16") -> dict[str, Any]:
        """The HF `config.json` dict that transformers' Qwen3ForCausalLM loads."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": dtype,
            "dtype": dtype,
        }

    def replace(self, **kw: Any) -> ModelConfig:
        return dataclasses.replace(self, **kw)


_QWEN3_VOCAB = 151936
_QWEN3_COMMON = dict(vocab_size=_QWEN3_VOCAB, head_dim=128, num_kv_heads=8, rope_theta=1_000_000.0,
                     bos_token_id=151643, eos_token_id=151645)

# Named shapes. Qwen3 values from the released config.json files.
MODEL_SHAPES: dict[str, ModelConfig] = {
    "qwen3-0.6b": ModelConfig(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                              tie_word_embeddings=True, **_QWEN3_COMMON),
    "qwen3-1.7b": ModelConfig(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
                              tie_word_embeddings=True, **_QWEN3_COMMON),
    "qwen3-4b": ModelConfig(hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32,
                            tie_word_embeddings=True, **_QWEN3_COMMON),
    "qwen3-8b": ModelConfig(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                            tie_word_embeddings=False, **_QWEN3_COMMON),
    # Test / embedded shapes: same architecture, a few hundred thousand parameters.
    "tiny": ModelConfig(vocab_size=128, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                        num_kv_heads=2, head_dim=32, rope_theta=10000.0, max_position_embeddings=1024,
                        tie_word_embeddings=True),
    "tiny-untied": ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_layers=2,
                               num_heads=4, num_kv_heads=1, head_dim=16, rope_theta=10000.0,
                               max_position_embeddings=512, tie_word_embeddings=False),
}


def model_shape(name: str) -> ModelConfig:
    try:
        return MODEL_SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; known: {sorted(MODEL_SHAPES)}") from None
