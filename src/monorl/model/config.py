"""Qwen3 dense architecture hyper-parameters, named shapes, and the HF config.json mapping."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)

# transformers' Qwen3Config defaults (models/qwen3/configuration_qwen3.py; the rope_theta default is
# RotaryEmbeddingConfigMixin.default_theta): what HF uses for a key that config.json leaves out. Hard-coded, as
# monorl never imports transformers at runtime; tests/test_model_config_defaults.py checks every one against the
# installed transformers. They are HF's generic defaults, not those of a released Qwen3 model (see MODEL_SHAPES).
HF_QWEN3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,  # when absent; an explicit null means num_attention_heads
    "head_dim": 128,  # not hidden_size // num_attention_heads
    "rope_theta": 10000.0,  # when neither rope_parameters / rope_scaling nor a top-level rope_theta gives one
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": None,
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_token_ids(v: Any) -> bool:
    return v is None or _is_int(v) or (isinstance(v, list) and all(map(_is_int, v)))


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

    # ---- HF config.json ------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF `config.json`; raises ValueError (one line, naming the key) for other
        architectures and for values HF's Qwen3Config would reject or monorl does not implement.

        A key absent from `config.json` takes transformers' Qwen3Config default (`HF_QWEN3_DEFAULTS`), exactly
        as HF resolves it, so monorl and transformers read every config.json the same way.
        """
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        if model_type != "qwen3" or (archs and not set(archs) & set(SUPPORTED_ARCHITECTURES)):
            raise ValueError(
                f"unsupported architecture: model_type={model_type!r}, architectures={archs}; "
                f"monorl supports {list(SUPPORTED_ARCHITECTURES)} (model_type 'qwen3')"
            )

        def get(key: str, check: Any, expected: str) -> Any:
            value = hf.get(key, HF_QWEN3_DEFAULTS[key])
            if not check(value):
                raise ValueError(f"config.json: {key} must be {expected}, got {value!r}")
            return value

        def positive_int(key: str) -> int:
            return get(key, lambda v: _is_int(v) and v > 0, "a positive integer")

        def positive_number(key: str) -> float:
            return float(get(key, lambda v: _is_number(v) and v > 0, "a positive number"))

        # HF: rope_scaling (legacy name), when set, wins over rope_parameters; rope_theta comes from that dict,
        # else the top-level rope_theta, else the default.
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"config.json: rope_parameters must be an object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"unsupported rope_type {rope_type!r} (only 'default' RoPE is implemented)")
        theta = rope.get("rope_theta", hf.get("rope_theta", HF_QWEN3_DEFAULTS["rope_theta"]))
        if not (_is_number(theta) and theta > 0):
            raise ValueError(f"config.json: rope_theta must be a positive number, got {theta!r}")
        if get("attention_bias", lambda v: isinstance(v, bool), "true or false"):
            raise ValueError("unsupported: attention_bias=true (Qwen3 has no attention bias)")
        if get("use_sliding_window", lambda v: isinstance(v, bool), "true or false"):
            raise ValueError("unsupported: use_sliding_window=true")
        if (act := hf.get("hidden_act", HF_QWEN3_DEFAULTS["hidden_act"])) != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}")

        num_heads = positive_int("num_attention_heads")
        if "num_key_value_heads" in hf and hf["num_key_value_heads"] is None:
            num_kv_heads = num_heads  # HF: an explicit null means one KV head per attention head
        else:
            num_kv_heads = positive_int("num_key_value_heads")
        if num_heads % num_kv_heads:
            origin = "" if "num_key_value_heads" in hf else ", HF's Qwen3Config default: config.json does not set it"
            raise ValueError(f"config.json: num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads}{origin})")
        head_dim = positive_int("head_dim")
        if head_dim % 2:
            raise ValueError(f"config.json: head_dim must be even for RoPE, got {head_dim}")
        return cls(
            vocab_size=positive_int("vocab_size"),
            hidden_size=positive_int("hidden_size"),
            intermediate_size=positive_int("intermediate_size"),
            num_layers=positive_int("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rope_theta=float(theta),
            rms_norm_eps=positive_number("rms_norm_eps"),
            max_position_embeddings=positive_int("max_position_embeddings"),
            tie_word_embeddings=get("tie_word_embeddings", lambda v: isinstance(v, bool), "true or false"),
            bos_token_id=get("bos_token_id", lambda v: v is None or _is_int(v), "an integer or null"),
            eos_token_id=get("eos_token_id", _is_token_ids, "an integer, a list of integers, or null"),
        )

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
