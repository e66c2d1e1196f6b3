"""The model families monorl runs, keyed by a checkpoint's `model_type`: what each states that differs from the
shared decoder (`monorl.model.decoder.DecoderForCausalLM`, parameterised by `ModelConfig`).

Qwen3, Llama, Qwen2 and Qwen3-MoE are Llama-shaped decoders: RMSNorm, rotate-half RoPE, GQA attention, a SiLU-gated
MLP (Qwen3-MoE: a sparse mixture of such MLPs in its sparse layers, `monorl.model.moe`). They differ in a per-head q/k
RMSNorm (Qwen3, Qwen3-MoE), biases on q/k/v (Qwen2 always; Llama and Qwen3 on q/k/v/o with `attention_bias`), what
a config.json key left out means (transformers' config class defaults, including head_dim: Qwen3Config's 128, the
others hidden_size // num_attention_heads), and the GGUF architecture name. Gemma 3, Qwen3.5 (dense and MoE) and
GPT-OSS have layers of their own (`monorl.model.decoder.FAMILY_BLOCKS`; layer kinds by `layer_types`) and their
config.json keys in a module of their own (`Family.hf_module`). Everything else (checkpoints, LoRA, batch invariance,
the memory plan) reads the resulting `ModelConfig` fields.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, ModuleType
from typing import Any


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type
    architecture: str  # config.json's architectures[0] (the transformers class)
    gguf_arch: str  # a GGUF file's general.architecture
    qk_norm: bool  # a per-head RMSNorm on q and k before RoPE
    qkv_bias: bool | None  # True: q/k/v always have biases (o_proj none); None: config.json's attention_bias
    # transformers' config class defaults: what a key config.json leaves out means (None for head_dim:
    # hidden_size // num_attention_heads; for num_key_value_heads: num_attention_heads)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # boolean keys monorl does not implement when true (a one-line refusal names the key)
    unsupported_flags: tuple[str, ...] = ()
    # hidden_size must be a multiple of num_attention_heads (LlamaConfig's own check)
    hidden_multiple_of_heads: bool = False
    # keys `ModelConfig.to_hf` writes for this family beyond the shared ones
    extra_hf: Mapping[str, Any] = field(default_factory=dict)
    # sparse mixture-of-experts MLPs (`monorl.model.moe`): config.json's num_experts, num_experts_per_tok, ...
    moe: bool = False
    # config.json's partial_rotary_factor (RoPE on the first part of each head) is read, not refused
    partial_rotary: bool = False
    # linear-attention layers beside full attention (Qwen3.5's Gated DeltaNet, `monorl.model.qwen3_5`)
    hybrid: bool = False
    # config.json's activation key and the one value monorl runs for this family
    activation: tuple[str, str] = ("hidden_act", "silu")
    # a module with the family's own config.json mapping: from_hf(hf) -> (hf as the shared reader reads it, extra
    # ModelConfig fields), to_hf(cfg, out) -> out (`ModelConfig.from_hf` / `to_hf` call them)
    hf_module: str | None = None
    # checkpoints hold each layer's experts stacked, as the model does (GPT-OSS), not one tensor per expert
    stacked_experts: bool = False

    def hf_hooks(self) -> ModuleType | None:
        return None if self.hf_module is None else importlib.import_module(self.hf_module)


_COMMON_DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                    "rope_theta": 10000.0, "attention_bias": False}

# transformers' Qwen3Config (models/qwen3/configuration_qwen3.py; rope_theta: RotaryEmbeddingConfigMixin's
# default_theta). tests/test_model_config_defaults.py checks each family's against the installed transformers.
QWEN3 = Family(
    model_type="qwen3", architecture="Qwen3ForCausalLM", gguf_arch="qwen3", qk_norm=True, qkv_bias=None,
    defaults=MappingProxyType({
        **_COMMON_DEFAULTS, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
        "max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None, "use_sliding_window": False}),
    unsupported_flags=("use_sliding_window",),
    extra_hf=MappingProxyType({"use_sliding_window": False, "sliding_window": None}),
)
# transformers' LlamaConfig (Llama 2 / 3.x, SmolLM2, ...)
LLAMA = Family(
    model_type="llama", architecture="LlamaForCausalLM", gguf_arch="llama", qk_norm=False, qkv_bias=None,
    defaults=MappingProxyType({
        **_COMMON_DEFAULTS, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None,
        "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2, "mlp_bias": False}),
    unsupported_flags=("mlp_bias",), hidden_multiple_of_heads=True,
    extra_hf=MappingProxyType({"mlp_bias": False, "pretraining_tp": 1}),
)
# transformers' Qwen2Config (Qwen2, Qwen2.5): q/k/v biases, no q/k norm
QWEN2 = Family(
    model_type="qwen2", architecture="Qwen2ForCausalLM", gguf_arch="qwen2", qk_norm=False, qkv_bias=True,
    defaults=MappingProxyType({
        **_COMMON_DEFAULTS, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": None,
        "max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None, "use_sliding_window": False}),
    unsupported_flags=("use_sliding_window",),
    extra_hf=MappingProxyType({"use_sliding_window": False, "sliding_window": None}),
)

# transformers' Qwen3MoeConfig (models/qwen3_moe/configuration_qwen3_moe.py): Qwen3's attention, sparse MoE MLPs.
# head_dim is no field of it (the attention reads getattr(config, "head_dim", hidden // heads)).
QWEN3_MOE = Family(
    model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", gguf_arch="qwen3moe", qk_norm=True, qkv_bias=None,
    defaults=MappingProxyType({
        **_COMMON_DEFAULTS, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": None,
        "max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None, "use_sliding_window": False,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False,
        "decoder_sparse_step": 1, "mlp_only_layers": None, "router_aux_loss_coef": 0.001}),
    unsupported_flags=("use_sliding_window",),
    extra_hf=MappingProxyType({"use_sliding_window": False, "sliding_window": None}),
    moe=True,
)

# transformers' Qwen3_5TextConfig (models/qwen3_5/configuration_qwen3_5.py): every 4th layer gated full attention
# ((1 + w) norms, an output gate, RoPE on a quarter of each head), the others Gated DeltaNet; no GGUF reader
QWEN3_5 = Family(
    model_type="qwen3_5_text", architecture="Qwen3_5ForCausalLM", gguf_arch="", qk_norm=True, qkv_bias=None,
    defaults=MappingProxyType({
        **_COMMON_DEFAULTS, "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
        "max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "layer_types": None}),
    partial_rotary=True, hybrid=True, hf_module="monorl.model.qwen3_5_hf",
)

# transformers' Qwen3_5MoeTextConfig (models/qwen3_5_moe; Qwen3_5MoeForCausalLM, the MoE of Qwen3.5-35B-A3B): Qwen3.5's
# layers with every MLP a sparse block (`monorl.model.moe`) plus a sigmoid-gated shared expert; its own keys in
# `monorl.model.qwen3_5_moe_hf`. The class has no intermediate_size, norm_topk_prob, decoder_sparse_step or
# mlp_only_layers (None here, as for a key HF does not declare): every layer sparse, top-k always renormalised.
QWEN3_5_MOE = Family(
    model_type="qwen3_5_moe_text", architecture="Qwen3_5MoeForCausalLM", gguf_arch="", qk_norm=True, qkv_bias=None,
    defaults=MappingProxyType({
        **QWEN3_5.defaults, "hidden_size": 2048, "intermediate_size": None, "num_hidden_layers": 40,
        "num_key_value_heads": 2, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "router_aux_loss_coef": 0.001, "norm_topk_prob": None,
        "decoder_sparse_step": None, "mlp_only_layers": None}),
    moe=True, partial_rotary=True, hybrid=True, hf_module="monorl.model.qwen3_5_moe_hf",
)

# transformers' Gemma3TextConfig (models/gemma3/configuration_gemma3.py; Gemma3ForCausalLM, text only): pre- and
# post-norms, (1 + w) RMSNorms, GeGLU, a scaled embedding, sliding-window layers with their own RoPE base
# (`monorl.model.gemma3`; its config.json keys: `monorl.model.gemma3_config`). rope_theta / rope_local_base_freq:
# the class's default_theta (global, local), which HF 5 writes into rope_parameters per layer kind.
GEMMA3 = Family(
    model_type="gemma3_text", architecture="Gemma3ForCausalLM", gguf_arch="gemma3", qk_norm=True, qkv_bias=None,
    defaults=MappingProxyType({
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "attention_bias": False,
        "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
        "bos_token_id": 2, "eos_token_id": 1, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "layer_types": None, "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "use_bidirectional_attention": False}),
    unsupported_flags=("use_bidirectional_attention",), hidden_multiple_of_heads=True,
    extra_hf=MappingProxyType({"use_bidirectional_attention": False, "final_logit_softcapping": None,
                               "attn_logit_softcapping": None}),
    activation=("hidden_activation", "gelu_pytorch_tanh"), hf_module="monorl.model.gemma3_config",
)

# transformers' GptOssConfig (models/gpt_oss/configuration_gpt_oss.py; GptOssForCausalLM): attention sinks, q/k/v/o
# biases, alternating sliding / full attention, YaRN RoPE, its own MoE (`monorl.model.gpt_oss`; config.json keys:
# `monorl.model.gpt_oss_config`). num_experts / moe_intermediate_size / decoder_sparse_step: no keys of its own (the
# hook fills them from num_local_experts / intermediate_size), None here as for a key HF does not declare.
GPT_OSS = Family(
    model_type="gpt_oss", architecture="GptOssForCausalLM", gguf_arch="gpt-oss", qk_norm=False, qkv_bias=None,
    defaults=MappingProxyType({
        **_COMMON_DEFAULTS, "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "attention_bias": True,
        "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
        "bos_token_id": None, "eos_token_id": None, "sliding_window": 128, "layer_types": None,
        "num_local_experts": 128, "num_experts_per_tok": 4, "router_aux_loss_coef": 0.001, "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0, "num_experts": None, "moe_intermediate_size": None, "norm_topk_prob": False,
        "decoder_sparse_step": None, "mlp_only_layers": None}),
    moe=True, hf_module="monorl.model.gpt_oss_config", stacked_experts=True,
)

FAMILIES: dict[str, Family] = {f.model_type: f for f in (QWEN3, LLAMA, QWEN2, QWEN3_MOE, QWEN3_5, QWEN3_5_MOE, GEMMA3,
                                                         GPT_OSS)}


def family(model_type: str) -> Family:
    """The family of a `model_type`; ValueError (one line) naming the supported ones."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(f"unsupported model_type {model_type!r}; monorl supports {sorted(FAMILIES)}") from None


def family_of_hf(hf: Mapping[str, Any]) -> Family:
    """The family of a parsed config.json: its `model_type`, whose architecture `architectures` (when given) must
    name."""
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    fam = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if fam is None or (archs and fam.architecture not in archs):
        supported = ", ".join(f"{f.model_type} ({f.architecture})" for f in FAMILIES.values())
        raise ValueError(f"unsupported architecture: model_type={model_type!r}, architectures={archs}; "
                         f"monorl supports {supported}")
    return fam


def family_of_gguf(arch: str) -> Family:
    """The family of a GGUF file's `general.architecture`."""
    for fam in FAMILIES.values():
        if _gguf_read(fam) and fam.gguf_arch == arch:
            return fam
    raise ValueError(f"unsupported GGUF architecture {arch!r}; monorl reads "
                     f"{sorted(f.gguf_arch for f in FAMILIES.values() if _gguf_read(f))}")


def _gguf_read(fam: Family) -> bool:
    """Whether monorl's GGUF reader takes the family's files: dense tensors, and GPT-OSS's experts
    (`monorl.model.gpt_oss_gguf`); a Qwen3-MoE file's stacked experts it does not map."""
    return bool(fam.gguf_arch) and (not fam.moe or fam is GPT_OSS)
