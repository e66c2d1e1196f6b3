"""ModelConfig.from_hf resolves every key a config.json leaves out the way transformers' config class of the family
does (Qwen3Config, LlamaConfig, Qwen2Config).

transformers is the oracle here (a test dependency only): each full config below is read with one key
dropped at a time, and monorl's resolved values must equal the config class's. The old from_hf derived a missing
head_dim as hidden_size // num_attention_heads (HF: 128), so loading such a checkpoint ended in a tensor-shape
error far from the cause.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from typing import Any

import pytest

from monorl.model.config import HF_QWEN3_DEFAULTS, ModelConfig, model_shape
from monorl.model.families import FAMILIES
from monorl.model.hf_checkpoint import load_checkpoint
from tests.conftest import HF_FAMILY_CLASSES

transformers = pytest.importorskip("transformers")

# Qwen3-0.6B's released config.json (legacy style: top-level rope_theta, rope_scaling null; 16 heads, 8 KV heads).
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
# What monorl writes (transformers 5 style: rope_parameters as well as rope_theta), for a shape with 32 heads and
# non-default values everywhere (so that dropping any key changes something).
MONORL_8B = model_shape("qwen3-8b").replace(rope_theta=500_000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                                            eos_token_id=[151645, 151643]).to_hf()
# SmolLM2-135M-Instruct's shape (Llama: no head_dim, 9 / 3 heads, tied, theta 1e5), a Llama 3.2-style config with
# llama3 RoPE scaling, and a Qwen2.5-0.5B-style one (q/k/v biases implied by the family)
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536, "max_position_embeddings": 8192, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 100000, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 49152,
}
LLAMA_3_2_STYLE = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256,
}
QWEN2_5_STYLE = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 32768,
    "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936,
}
# Qwen3-30B-A3B's released config.json (the MoE family: 128 experts, top-8, norm_topk_prob)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
# Gemma-3-270M's released config.json (transformers 4 style: rope_theta / rope_local_base_freq at the top level)
GEMMA3_270M = {
    "_sliding_window_pattern": 6, "architectures": ["Gemma3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": 1,
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 640,
    "initializer_range": 0.02, "intermediate_size": 2048,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5 + ["full_attention"]
    + ["sliding_attention"] * 5 + ["full_attention"],
    "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
    "num_hidden_layers": 18, "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0, "rope_scaling": None, "rope_theta": 1000000.0,
    "sliding_window": 512, "torch_dtype": "bfloat16", "use_bidirectional_attention": False, "use_cache": True,
    "vocab_size": 262144,
}
# Gemma-3-1B's released config.json (google/gemma-3-1b-pt, transformers 4.50 style: no layer_types, its
# sliding_window_pattern)
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 262144,
}
FULL_CONFIGS = {"qwen3-0.6b-released": QWEN3_0_6B, "monorl-to_hf-8b": MONORL_8B, "smollm2-135m": SMOLLM2_135M,
                "llama-3.2-style": LLAMA_3_2_STYLE, "qwen2.5-style": QWEN2_5_STYLE,
                "monorl-to_hf-llama3": ModelConfig.from_hf(LLAMA_3_2_STYLE).to_hf(),
                "monorl-to_hf-qwen2": ModelConfig.from_hf(QWEN2_5_STYLE).to_hf(),
                "qwen3-30b-a3b-released": QWEN3_30B_A3B,
                "monorl-to_hf-qwen3-moe": model_shape("qwen3-30b-a3b").replace(
                    mlp_only_layers=(0, 5), decoder_sparse_step=2, norm_topk_prob=False, num_experts=64).to_hf(),
                "gemma3-270m-released": GEMMA3_270M,
                "gemma3-1b-released": GEMMA3_1B,
                "monorl-to_hf-gemma3": ModelConfig.from_hf(GEMMA3_270M).replace(
                    sliding_window=64, rope_local_theta=500.0, query_pre_attn_scalar=128.0).to_hf()}


def hf_config(d: dict[str, Any]) -> Any:
    """transformers' config class of the family of `d` (its model_type; Qwen3 without one), built from `d`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, HF_FAMILY_CLASSES[d.get("model_type", "qwen3")][0])(**d)


def hf_resolved(d: dict[str, Any]) -> dict[str, Any]:
    """The values transformers' config class resolves for `d`, under ModelConfig's field names."""
    c = hf_config(d)
    family = FAMILIES[c.model_type]
    rope = c.rope_parameters
    gemma = {}
    if c.model_type == "gemma3_text":  # its RoPE per layer kind, its own fields
        gemma = dict(layer_types=tuple(c.layer_types), sliding_window=c.sliding_window,
                     rope_local_theta=rope["sliding_attention"]["rope_theta"],
                     query_pre_attn_scalar=c.query_pre_attn_scalar)
        rope = rope["full_attention"]
    scaling = None
    if rope.get("rope_type") == "llama3":
        scaling = {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                        "original_max_position_embeddings")}
    bias = getattr(c, "attention_bias", False)
    return dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        rope_theta=rope["rope_theta"], rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, model_type=c.model_type, qk_norm=family.qk_norm,
        qkv_bias=bool(family.qkv_bias or bias), o_bias=bool(bias and family.qkv_bias is None), rope_scaling=scaling,
        **(dict(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                decoder_sparse_step=c.decoder_sparse_step, mlp_only_layers=tuple(c.mlp_only_layers),
                router_aux_loss_coef=c.router_aux_loss_coef) if family.moe else
           dict(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, norm_topk_prob=False,
                decoder_sparse_step=1, mlp_only_layers=(), router_aux_loss_coef=0.0)),
        shared_expert_intermediate_size=0,  # Qwen3.5-MoE's (tests/test_qwen3_5.py)
        # these families' layers are all full attention (a family with other layer kinds reads HF's layer_types)
        **(gemma or dict(layer_types=(), sliding_window=0, rope_local_theta=0.0, query_pre_attn_scalar=0.0)),
        partial_rotary_factor=1.0, linear_conv_kernel_dim=0, linear_num_key_heads=0, linear_num_value_heads=0,
        linear_key_head_dim=0, linear_value_head_dim=0,
        vision=None,  # text-only families (Qwen3-VL: tests/test_qwen3_vl.py)
        swiglu_alpha=1.702, swiglu_limit=7.0,  # GPT-OSS's (tests/test_gpt_oss.py)
    )


def assert_same_as_hf(d: dict[str, Any]) -> None:
    try:
        expected = hf_resolved(d)
    except Exception as e:  # noqa: BLE001 (HF's strict dataclass error type is private to huggingface_hub)
        if "layer_types" in str(e):  # Gemma 3: as many layer_types as layers
            with pytest.raises(ValueError, match="layer_types"):
                ModelConfig.from_hf(d)
            return
        assert "hidden size" in str(e)  # LlamaConfig: hidden_size must be a multiple of num_attention_heads
        with pytest.raises(ValueError, match="hidden_size .* must be a multiple of num_attention_heads"):
            ModelConfig.from_hf(d)
        return
    if expected["num_heads"] % expected["num_kv_heads"]:
        # HF builds such a config but no model from it (num_key_value_groups would be 0); monorl says why.
        with pytest.raises(ValueError, match="num_key_value_heads") as e:
            ModelConfig.from_hf(d)
        assert "\n" not in str(e.value)
        return
    got = dataclasses.asdict(ModelConfig.from_hf(d))
    assert got == expected  # (an int rope_theta in config.json is the same number as monorl's float)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_hard_coded_defaults_are_transformers_defaults(model_type):
    family = FAMILIES[model_type]
    cls = getattr(transformers, HF_FAMILY_CLASSES[model_type][0])
    fields = cls.__dataclass_fields__  # the class's own defaults (None where __post_init__ derives the value)
    for key, value in family.defaults.items():
        if key in ("rope_theta", "rope_local_base_freq"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rope = cls().rope_parameters
            if "full_attention" in rope:  # Gemma 3: one RoPE per layer kind
                rope = rope["sliding_attention" if key == "rope_local_base_freq" else "full_attention"]
            hf_value = rope["rope_theta"]
        elif key in fields:
            hf_value = fields[key].default
        else:  # a key the class does not declare (Qwen2's head_dim, attention_bias): HF ignores it or reads it with
            assert value in (None, False), key  # getattr(config, key, None); monorl's default must be "none" too
            continue
        assert (hf_value, type(hf_value)) == (value, type(value)), key
    assert HF_QWEN3_DEFAULTS == dict(FAMILIES["qwen3"].defaults)


@pytest.mark.parametrize("name", sorted(FULL_CONFIGS))
def test_full_config_matches_hf(name):
    assert_same_as_hf(FULL_CONFIGS[name])


@pytest.mark.parametrize("name,key", [(n, k) for n in sorted(FULL_CONFIGS) for k in FULL_CONFIGS[n]
                                      if k != "model_type"])  # model_type is how monorl recognises the family
def test_each_key_dropped_matches_hf(name, key):
    d = {k: v for k, v in FULL_CONFIGS[name].items() if k != key}
    assert_same_as_hf(d)


@pytest.mark.parametrize("shape,released", [("gemma3-270m", GEMMA3_270M), ("gemma3-1b", GEMMA3_1B)])
def test_gemma3_shapes_are_the_released_configs(shape, released):
    """The named shapes (`gemma3_released.RELEASED`: the keys that differ from HF's defaults) are the released files,
    as transformers reads them (test_full_config_matches_hf)."""
    assert model_shape(shape) == ModelConfig.from_hf(released)


def test_missing_head_dim_is_128_not_hidden_over_heads():
    d = {k: v for k, v in QWEN3_0_6B.items() if k != "head_dim"}
    assert ModelConfig.from_hf(d).head_dim == 128 != d["hidden_size"] // d["num_attention_heads"]


def test_empty_config_matches_hf():
    assert_same_as_hf({"model_type": "qwen3"})
    assert dataclasses.asdict(ModelConfig.from_hf({"model_type": "qwen3"})) == dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_layers=32, num_heads=32, num_kv_heads=32,
        head_dim=128, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, model_type="qwen3", qk_norm=True,
        qkv_bias=False, o_bias=False, rope_scaling=None, num_experts=0, num_experts_per_tok=0,
        moe_intermediate_size=0, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=(),
        router_aux_loss_coef=0.0, shared_expert_intermediate_size=0, layer_types=(), sliding_window=0,
        partial_rotary_factor=1.0,
        linear_conv_kernel_dim=0, linear_num_key_heads=0, linear_num_value_heads=0, linear_key_head_dim=0,
        linear_value_head_dim=0, vision=None, rope_local_theta=0.0, query_pre_attn_scalar=0.0,
        swiglu_alpha=1.702, swiglu_limit=7.0)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3_moe", "gemma3_text"])
def test_empty_config_of_each_family_matches_hf(model_type):
    assert_same_as_hf({"model_type": model_type})


def test_num_key_value_heads_absent_or_null():
    # absent: Qwen3Config's field default (32), whatever num_attention_heads is; explicit null: num_attention_heads
    for heads in (8, 32, 64):
        base = {"model_type": "qwen3", "num_attention_heads": heads}
        assert_same_as_hf(base)
        assert_same_as_hf({**base, "num_key_value_heads": None})
        assert ModelConfig.from_hf({**base, "num_key_value_heads": None}).num_kv_heads == heads
    assert ModelConfig.from_hf({"model_type": "qwen3", "num_attention_heads": 64}).num_kv_heads == 32
    with pytest.raises(ValueError, match=r"num_attention_heads \(16\) must be a multiple of num_key_value_heads "
                                         r"\(32, HF's Qwen3Config default: config.json does not set it\)"):
        ModelConfig.from_hf({"model_type": "qwen3", "num_attention_heads": 16})


@pytest.mark.parametrize("rope", [
    {"rope_theta": 123.0},  # top-level only
    {"rope_parameters": {"rope_type": "default"}, "rope_theta": 456.0},  # dict without theta: top-level fills it
    {"rope_parameters": {"rope_type": "default", "rope_theta": 4.0}, "rope_theta": 3.0},  # dict wins
    {"rope_parameters": None, "rope_theta": 5.0},
    {"rope_scaling": {"rope_type": "default", "rope_theta": 7e5}, "rope_parameters": {"rope_theta": 5e5}},
    {"rope_scaling": None, "rope_parameters": {"rope_theta": 5e5}},
    {"rope_scaling": {"type": "default"}},
    {"rope_parameters": {"rope_type": "default"}},
])
def test_rope_theta_resolution_matches_hf(rope):
    assert_same_as_hf({"model_type": "qwen3", **rope})


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                                 "tie_word_embeddings", "attention_bias", "use_sliding_window"])
def test_null_values_are_rejected_like_hf(key):
    d = {**QWEN3_0_6B, key: None}
    with pytest.raises(Exception):  # noqa: B017 (HF's strict dataclass error type is private to huggingface_hub)
        transformers.Qwen3Config(**d)
    with pytest.raises(ValueError, match=f"config.json: {key} must be") as e:
        ModelConfig.from_hf(d)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("key,value,match", [
    ("head_dim", "128", "head_dim must be a positive integer, got '128'"),
    ("hidden_size", 1024.5, "hidden_size must be a positive integer"),
    ("num_hidden_layers", True, "num_hidden_layers must be a positive integer"),
    ("vocab_size", 0, "vocab_size must be a positive integer"),
    ("head_dim", 7, "head_dim must be even"),
    ("rope_theta", None, "rope_theta must be a positive number, got None"),
    ("tie_word_embeddings", "true", "tie_word_embeddings must be true or false"),
    ("eos_token_id", "</s>", "eos_token_id must be an integer, a list of integers, or null"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "unsupported rope_type 'yarn'"),
    ("rope_parameters", [1], "rope_parameters must be an object"),
])
def test_bad_values_are_one_line_errors(key, value, match):
    with pytest.raises(ValueError, match=match) as e:
        ModelConfig.from_hf({**QWEN3_0_6B, key: value})
    assert "\n" not in str(e.value)


def test_checkpoint_without_head_dim_loads(make_hf_checkpoint, load_hf_model):
    """End to end: an HF checkpoint whose head_dim is HF's default (128, not hidden_size // heads = 16) loads
    after head_dim is removed from its config.json, as it does in transformers."""
    path = make_hf_checkpoint(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                              intermediate_size=64, num_hidden_layers=1, vocab_size=32)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["head_dim"]
    (path / "config.json").write_text(json.dumps(cfg))
    model = load_checkpoint(path)
    assert model.config.head_dim == 128
    assert load_hf_model(path).config.head_dim == 128
