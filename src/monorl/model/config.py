"""Decoder hyper-parameters (one `ModelConfig` for every family in `monorl.model.families`), named shapes, and the
HF config.json mapping."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from monorl.model import gemma3_released
from monorl.model.families import FAMILIES, QWEN3, Family, family, family_of_hf
from monorl.model.qwen3_5_hf import check_linear_attention, text_config
from monorl.model.qwen3_vl_hf import QWEN3_VL_2B, join_config, split_config
from monorl.model.vision_config import VisionConfig

if TYPE_CHECKING:
    from monorl.model.yarn import YarnRopeScaling

SUPPORTED_ARCHITECTURES = tuple(f.architecture for f in FAMILIES.values())

# transformers' Qwen3Config defaults: what HF uses for a key that a Qwen3 config.json leaves out (each family's
# are in `monorl.model.families`). Hard-coded, as monorl never imports transformers at runtime;
# tests/test_model_config_defaults.py checks every one against the installed transformers. They are HF's generic
# defaults, not those of a released model (see MODEL_SHAPES).
HF_QWEN3_DEFAULTS: dict[str, Any] = dict(QWEN3.defaults)
ROPE_TYPES = ("default", "llama3")
# the layer kinds monorl runs (HF's `layer_types` values); a family adding one adds its cache kind and attention
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_token_ids(v: Any) -> bool:
    return v is None or _is_int(v) or (isinstance(v, list) and all(map(_is_int, v)))


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency scaling (HF rope_type "llama3"): wavelengths beyond
    original_max_position_embeddings / low_freq_factor divided by factor, those below
    original_max_position_embeddings / high_freq_factor kept, a smooth blend between."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def to_hf(self) -> dict[str, Any]:
        return {"rope_type": "llama3", **dataclasses.asdict(self)}


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
    # the family (`monorl.model.families`) and what it decides; `with_family` sets all four together
    model_type: str = "qwen3"
    qk_norm: bool = True  # per-head RMSNorm of q and k (Qwen3)
    qkv_bias: bool = False  # biases on q_proj / k_proj / v_proj
    o_bias: bool = False  # a bias on o_proj
    rope_scaling: Llama3RopeScaling | YarnRopeScaling | None = None  # YaRN: GPT-OSS's (`monorl.model.yarn`)
    # mixture of experts (a `moe` family: Qwen3-MoE, `monorl.model.moe`); 0 experts: every MLP dense
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k: experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's MLP width (intermediate_size: the dense layers')
    norm_topk_prob: bool = False  # renormalise each token's top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % decoder_sparse_step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not one of these (HF's rule)
    router_aux_loss_coef: float = 0.0  # the load-balancing loss's weight (when `trainer.router_aux_loss` is on)
    shared_expert_intermediate_size: int = 0  # a sigmoid-gated expert every token takes too (Qwen3.5-MoE); 0: none
    # each layer's kind (HF's `layer_types`; empty: every layer full attention); a kind decides the layer's cache
    # (`monorl.generate.cache.cache_kinds`) and how its attention reads it
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0  # keys a "sliding_attention" layer attends (its own and the W - 1 before it)
    # Qwen3.5 (`monorl.model.qwen3_5`): its full-attention layers rotate the first partial_rotary_factor of each
    # head; its "linear_attention" layers are Gated DeltaNet of this shape (0: the model has none)
    partial_rotary_factor: float = 1.0
    linear_conv_kernel_dim: int = 0  # the causal depthwise convolution's width over q/k/v
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0  # a multiple of linear_num_key_heads (each key head serves a group)
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # a vision-language model's tower, image tokens and M-RoPE (Qwen3-VL: `monorl.model.qwen3_vl`); None: text only
    vision: VisionConfig | None = None
    # Gemma 3 (`monorl.model.gemma3`): the RoPE base of its sliding-window layers (0: rope_theta on every layer), and
    # query_pre_attn_scalar: attention scores scaled by its ** -0.5 instead of head_dim's (0: head_dim)
    rope_local_theta: float = 0.0
    query_pre_attn_scalar: float = 0.0
    # GPT-OSS (`monorl.model.gpt_oss`): its experts' clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0  # gate clamped above, up on both sides

    def __post_init__(self) -> None:
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if bad := sorted(set(self.layer_types) - set(LAYER_TYPES)):
            raise ValueError(f"unsupported layer_types {bad}; monorl runs {list(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and self.sliding_window < 1:
            raise ValueError(f"sliding_attention layers need sliding_window >= 1, got {self.sliding_window}")
        if "linear_attention" in self.layer_types:
            check_linear_attention(self)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        fam = family(self.model_type)
        if self.qk_norm != fam.qk_norm:
            raise ValueError(f"qk_norm={self.qk_norm} is not {fam.model_type}'s (use ModelConfig.with_family)")
        if fam.qkv_bias and (not self.qkv_bias or self.o_bias) or not fam.qkv_bias and self.qkv_bias != self.o_bias:
            raise ValueError(f"qkv_bias={self.qkv_bias}, o_bias={self.o_bias} is no {fam.model_type} "
                             "attention (use ModelConfig.with_family)")
        if not fam.moe and self.num_experts:
            raise ValueError(f"num_experts={self.num_experts}: {fam.model_type} has no experts (use qwen3_moe)")
        if fam.moe:
            if self.num_experts < 1 or not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"{fam.model_type} needs num_experts >= 1 and 1 <= num_experts_per_tok <= "
                                 f"num_experts, got {self.num_experts} and {self.num_experts_per_tok}")
            if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
                raise ValueError(f"moe_intermediate_size and decoder_sparse_step must be >= 1, got "
                                 f"{self.moe_intermediate_size} and {self.decoder_sparse_step}")
            if bad := [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]:
                raise ValueError(f"mlp_only_layers {bad} are not layers of a {self.num_layers}-layer model")

    def layer_type(self, i: int) -> str:
        """Layer i's kind, one of `LAYER_TYPES`."""
        return self.layer_types[i] if self.layer_types else "full_attention"

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE rotates (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def rope_kind(self, i: int) -> str:
        """Which RoPE table layer i rotates by (`monorl.model.rope.model_rope`): one for every layer unless a
        family's layer kinds differ in RoPE base or rotary width."""
        if self.vision is not None:
            return "mrope"
        if self.rope_local_theta and self.layer_type(i) == "sliding_attention":
            return "local"  # Gemma 3: its own base on window layers
        return "default"

    def sparse_layer(self, i: int) -> bool:
        """Whether layer i's MLP is a sparse MoE block (transformers' Qwen3MoeDecoderLayer rule)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def family(self) -> Family:
        return family(self.model_type)

    def with_family(self, model_type: str, attention_bias: bool = False, **moe: Any) -> ModelConfig:
        """This shape as another family: its q/k norm and biases (attention_bias: HF's flag, q/k/v and o biases
        for Llama and Qwen3; Qwen2 always has q/k/v biases); moe: the expert fields (num_experts, ...) of a
        `moe` family, set together with it."""
        fam = family(model_type)
        bias = fam.qkv_bias if fam.qkv_bias is not None else attention_bias
        if not fam.moe:
            moe = dict(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, norm_topk_prob=False,
                       decoder_sparse_step=1, mlp_only_layers=(), router_aux_loss_coef=0.0,
                       shared_expert_intermediate_size=0, **moe)
        return self.replace(model_type=model_type, qk_norm=fam.qk_norm, qkv_bias=bias,
                            o_bias=bias and fam.qkv_bias is None, **moe)

    # ---- HF config.json ------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF `config.json`; raises ValueError (one line, naming the key) for other
        architectures and for values HF would reject or monorl does not implement.

        The family comes from `model_type` (`monorl.model.families`); a key absent from `config.json` takes that
        family's transformers config default, exactly as HF resolves it, so monorl and transformers read every
        config.json the same way.
        """
        if hf.get("model_type") == "qwen3_vl":  # the Qwen3 decoder of a vision-language model, and its tower
            text, vision = split_config(hf)
            return cls.from_hf(text).replace(vision=vision)
        hf = text_config(hf)  # (a vision-language checkpoint's language model: its text_config)
        fam = family_of_hf(hf)
        defaults = fam.defaults
        extra: dict[str, Any] = {}
        if (hooks := fam.hf_hooks()) is not None:  # a family's own keys, and its config.json as read below
            hf, extra = hooks.from_hf(hf)

        def get(key: str, check: Any, expected: str) -> Any:
            value = hf.get(key, defaults[key])
            if not check(value):
                raise ValueError(f"config.json: {key} must be {expected}, got {value!r}")
            return value

        def positive_int(key: str) -> int:
            return get(key, lambda v: _is_int(v) and v > 0, "a positive integer")

        def positive_number(key: str) -> float:
            return float(get(key, lambda v: _is_number(v) and v > 0, "a positive number"))

        def flag(key: str) -> bool:
            return get(key, lambda v: isinstance(v, bool), "true or false")

        theta, scaling = _rope_from_hf(hf, defaults["rope_theta"], fam.partial_rotary)
        attention_bias = flag("attention_bias")
        if attention_bias and fam.qkv_bias:
            raise ValueError(f"unsupported: attention_bias=true ({fam.model_type} has q/k/v biases only)")
        for key in fam.unsupported_flags:
            if flag(key):
                raise ValueError(f"unsupported: {key}=true")
        act_key, act_expected = fam.activation
        if (act := hf.get(act_key, defaults[act_key])) != act_expected:
            raise ValueError(f"unsupported {act_key} {act!r} ({fam.model_type}: {act_expected!r})")

        num_heads = positive_int("num_attention_heads")
        if hf.get("num_key_value_heads", defaults["num_key_value_heads"]) is None:
            num_kv_heads = num_heads  # HF: null (Llama's default too) means one KV head per attention head
        else:
            num_kv_heads = positive_int("num_key_value_heads")
        if num_heads % num_kv_heads:
            origin = ("" if "num_key_value_heads" in hf else
                      f", HF's {fam.architecture[:-len('ForCausalLM')]}Config default: config.json does not set it")
            raise ValueError(f"config.json: num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads}{origin})")
        hidden_size = positive_int("hidden_size")
        if fam.hidden_multiple_of_heads and hidden_size % num_heads:
            raise ValueError(f"config.json: hidden_size ({hidden_size}) must be a multiple of num_attention_heads "
                             f"({num_heads})")
        if defaults["head_dim"] is None and hf.get("head_dim") is None:
            head_dim = hidden_size // num_heads  # HF: getattr(config, "head_dim", None) or hidden // heads
        else:
            head_dim = positive_int("head_dim")
        if head_dim % 2:
            raise ValueError(f"config.json: head_dim must be even for RoPE, got {head_dim}")
        base = cls(
            vocab_size=positive_int("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=positive_int("intermediate_size"),
            num_layers=positive_int("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rope_theta=float(theta),
            rms_norm_eps=positive_number("rms_norm_eps"),
            max_position_embeddings=positive_int("max_position_embeddings"),
            tie_word_embeddings=flag("tie_word_embeddings"),
            bos_token_id=get("bos_token_id", lambda v: v is None or _is_int(v), "an integer or null"),
            eos_token_id=get("eos_token_id", _is_token_ids, "an integer, a list of integers, or null"),
            rope_scaling=scaling,
        )
        base = base.with_family(fam.model_type, attention_bias, **(_moe_from_hf(hf, defaults) if fam.moe else {}))
        return base.replace(**extra) if extra else base

    def to_hf(self, dtype: str = "bfloat16") -> dict[str, Any]:
        """The HF `config.json` dict that transformers loads as this family's class."""
        if self.vision is not None:
            return join_config(self.replace(vision=None).to_hf(dtype), self.vision, dtype)
        fam = self.family
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**self.rope_scaling.to_hf(), "rope_theta": self.rope_theta}
        out = {
            "architectures": [fam.architecture],
            "model_type": fam.model_type,
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
            "rope_parameters": rope,
            # transformers 4 reads the scaling from here (5 reads it from here too when set)
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf(),
            "attention_dropout": 0.0,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": dtype,
            "dtype": dtype,
            **fam.extra_hf,
        }
        if fam.qkv_bias is None:
            out["attention_bias"] = self.o_bias
        if fam.moe:
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                       router_aux_loss_coef=self.router_aux_loss_coef, output_router_logits=False)
        if (hooks := fam.hf_hooks()) is not None:
            out = hooks.to_hf(self, out)
        return out

    def replace(self, **kw: Any) -> ModelConfig:
        return dataclasses.replace(self, **kw)


def _moe_from_hf(hf: dict[str, Any], defaults: Any) -> dict[str, Any]:
    """The expert fields of a `moe` family's config.json (transformers writes num_experts as num_local_experts)."""
    def get(key: str, check: Any, expected: str, *aliases: str) -> Any:
        value = next((hf[k] for k in (key, *aliases) if k in hf), defaults[key])
        if not check(value):
            raise ValueError(f"config.json: {key} must be {expected}, got {value!r}")
        return value

    def positive_int(key: str, *aliases: str) -> int:
        return get(key, lambda v: _is_int(v) and v > 0, "a positive integer", *aliases)

    only = get("mlp_only_layers", lambda v: v is None or isinstance(v, list) and all(map(_is_int, v)),
               "a list of layer indices")
    return dict(
        num_experts=positive_int("num_experts", "num_local_experts"),
        num_experts_per_tok=positive_int("num_experts_per_tok"),
        moe_intermediate_size=positive_int("moe_intermediate_size"),
        norm_topk_prob=get("norm_topk_prob", lambda v: isinstance(v, bool), "true or false"),
        decoder_sparse_step=positive_int("decoder_sparse_step"),
        mlp_only_layers=tuple(only or ()),
        router_aux_loss_coef=float(get("router_aux_loss_coef", lambda v: _is_number(v) and v >= 0, "a number >= 0")),
    )


def _rope_from_hf(hf: dict[str, Any], default_theta: float,
                  partial_ok: bool = False) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, scaling) as HF resolves them: rope_scaling (legacy name), when set, wins over rope_parameters;
    rope_theta comes from that dict, else the top-level rope_theta, else the default. partial_ok: the family reads
    partial_rotary_factor itself (`monorl.model.qwen3_5_hf`)."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"config.json: rope_parameters must be an object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (*ROPE_TYPES, None):
        raise ValueError(f"unsupported rope_type {rope_type!r} (monorl implements {', '.join(ROPE_TYPES)})")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (1, 1.0, None) and not partial_ok:
        raise ValueError(f"unsupported partial_rotary_factor {partial!r} (monorl rotates whole heads)")
    theta = rope.get("rope_theta", hf.get("rope_theta", default_theta))
    if not (_is_number(theta) and theta > 0):
        raise ValueError(f"config.json: rope_theta must be a positive number, got {theta!r}")
    if rope_type != "llama3":
        return theta, None
    values = []
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        v = rope.get(key)
        if not (_is_number(v) and v > 0):
            raise ValueError(f"config.json: rope_scaling.{key} must be a positive number for llama3 RoPE, got {v!r}")
        values.append(v)
    factor, low, high, original = values
    if high <= low:
        raise ValueError(f"config.json: rope_scaling.high_freq_factor ({high}) must exceed low_freq_factor ({low})")
    return theta, Llama3RopeScaling(float(factor), float(low), float(high), int(original))


_QWEN3_COMMON = dict(vocab_size=151936, head_dim=128, num_kv_heads=8, rope_theta=1_000_000.0, bos_token_id=151643,
                     eos_token_id=151645)

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
    "qwen3-30b-a3b": ModelConfig(hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
                                 tie_word_embeddings=False, **{**_QWEN3_COMMON, "num_kv_heads": 4}).with_family(
        "qwen3_moe", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        router_aux_loss_coef=0.001),
    # SmolLM2-135M(-Instruct), HuggingFaceTB's released config.json: the small real model of the arith preset, for
    # random-weight benchmarks of its shapes (#62)
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                                num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                                max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
                                eos_token_id=2).with_family("llama"),
    # Gemma-3-270M and Gemma-3-1B, google's released config.json files (`gemma3_released.RELEASED`): sliding windows
    # of 512 on 5 layers of every 6 (#57)
    **{name: ModelConfig.from_hf(hf) for name, hf in gemma3_released.RELEASED.items()},
    # openai/gpt-oss-20b's released config.json (its experts stored as MXFP4 there: a bf16 copy loads)
    "gpt-oss-20b": ModelConfig.from_hf({"model_type": "gpt_oss", "num_hidden_layers": 24, "num_local_experts": 32,
                                        "eos_token_id": 200002, "router_aux_loss_coef": 0.9}),
    # Test / embedded shapes: same architecture, a few hundred thousand parameters.
    "tiny": ModelConfig(vocab_size=128, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                        num_kv_heads=2, head_dim=32, rope_theta=10000.0, max_position_embeddings=1024,
                        tie_word_embeddings=True),
    "tiny-untied": ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_layers=2,
                               num_heads=4, num_kv_heads=1, head_dim=16, rope_theta=10000.0,
                               max_position_embeddings=512, tie_word_embeddings=False),
    # Qwen3-MoE in small: 8 experts, top-2, the tiny shape's attention
    "tiny-moe": ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=1024,
                            tie_word_embeddings=True).with_family(
        "qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        router_aux_loss_coef=0.001),
}
# Qwen3-VL in small (#59, the tiny_vision preset): the tiny decoder, a 2-block tower of 4-pixel patches (an 8 x 8
# pixel block is one image token), the image tokens after the char tokenizer's (`CharTokenizer(vision=True)`)
MODEL_SHAPES["tiny-vl"] = MODEL_SHAPES["tiny"].replace(vision=VisionConfig(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128, patch_size=4,
    num_position_embeddings=16, deepstack_visual_indexes=(1,), vision_start_token_id=99, image_token_id=100,
    vision_end_token_id=101, video_token_id=102, mrope_section=(6, 5, 5)))
MODEL_SHAPES["qwen3-vl-2b"] = ModelConfig.from_hf(QWEN3_VL_2B)  # Qwen3-VL-2B-Instruct's config.json (qwen3_vl_hf)


def _qwen3_5_shape(hidden: int, intermediate: int, layers: int) -> ModelConfig:
    """A Qwen3.5 text model of this width and depth, the 0.8B's other numbers: every 4th layer full attention."""
    kinds = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers))
    return ModelConfig(vocab_size=248320, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
                       num_heads=8, num_kv_heads=2, head_dim=256, rope_theta=10_000_000.0,
                       max_position_embeddings=262144, tie_word_embeddings=True, eos_token_id=248044).with_family(
        "qwen3_5_text").replace(layer_types=kinds, partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
                                linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                                linear_value_head_dim=128)


# Qwen3.5 hybrids (#58). qwen3_5-0.8b: Qwen/Qwen3.5-0.8B's config.json text_config as public copies of it quote it
# (transformers ships no sizes). The 2B's full config was not found: "-like" is the 0.8B's heads and state at the
# 2B's hidden size (2048), its depth and MLP width guessed -- a benchmark shape, not the released model.
MODEL_SHAPES |= {"qwen3_5-0.8b": _qwen3_5_shape(1024, 3584, 24),
                 "qwen3_5-hybrid-2b-like": _qwen3_5_shape(2048, 6144, 24)}


def model_shape(name: str) -> ModelConfig:
    try:
        return MODEL_SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; known: {sorted(MODEL_SHAPES)}") from None
