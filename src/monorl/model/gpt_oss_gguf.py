"""GPT-OSS GGUF files (llama.cpp's `gpt-oss` architecture, as its `convert_hf_to_gguf.py` GptOssModel writes them),
the parts `monorl.model.gguf` reads differently:

- the config: its metadata turned into GptOssConfig's keys and read by the family's own reader
  (`monorl.model.gpt_oss_config`: YaRN RoPE from `rope.scaling.*`, the experts, the window on even layers; the
  SwiGLU's alpha 1.702 and limit 7, which the files leave out and llama.cpp hard-codes, are GptOssConfig's
  defaults);
- the tensors llama.cpp renames or splits: the sinks (`attn_sinks.weight`), the router (`ffn_gate_inp`), the norm
  after attention (`post_attention_norm`), each expert's gate and up as two tensors (`ffn_gate_exps` /
  `ffn_up_exps`, [E, I, H] each) or one (`ffn_gate_up_exps`, gate rows then up rows), which HF's `gate_up_proj`
  [E, H, 2I] interleaves column by column, and `down_proj` stored transposed ([E, H, I]);
- the released files' MXFP4 experts: gguf-py dequantizes them like the other block formats.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

# llama.cpp's block tensor names that differ from the Llama-shaped ones; "mlp.experts.*_part" are the experts'
# tensors as the file holds them, put together by `assemble`
BLOCK_NAMES = {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
               "ffn_gate_inp": "mlp.router", "ffn_gate_exps": "mlp.experts.gate_part",
               "ffn_up_exps": "mlp.experts.up_part", "ffn_gate_up_exps": "mlp.experts.gate_up_part",
               "ffn_down_exps": "mlp.experts.down_part"}
_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$")


def hf_config(meta: Callable[..., Any], field: Callable[..., Any], heads: int, head_dim: int, vocab: int,
              tied: bool) -> dict[str, Any]:
    """config.json (GptOssConfig's keys) of a file's metadata (`meta(key)`: under `gpt-oss.`; `field`: any key)."""
    if (scaling := meta("rope.scaling.type", "yarn", required=False)) != "yarn":
        raise ValueError(f"gpt-oss.rope.scaling.type is {scaling!r}; GPT-OSS runs YaRN")
    layers = int(meta("block_count"))
    return {
        "model_type": "gpt_oss", "vocab_size": vocab, "hidden_size": int(meta("embedding_length")),
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads, required=False)), "head_dim": head_dim,
        "intermediate_size": int(meta("expert_feed_forward_length")), "num_local_experts": int(meta("expert_count")),
        "num_experts_per_tok": int(meta("expert_used_count")), "sliding_window": int(meta("attention.sliding_window")),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(meta("context_length")), "attention_bias": True,
        "tie_word_embeddings": tied,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": float(meta("rope.freq_base")),
                            "factor": float(meta("rope.scaling.factor")), "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False,
                            "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
                            **({} if (attn := meta("rope.scaling.attn_factor", None, required=False)) is None
                               else {"attention_factor": float(attn)})},
        "bos_token_id": field("tokenizer.ggml.bos_token_id"), "eos_token_id": field("tokenizer.ggml.eos_token_id"),
    }


def file_shapes(expected: dict[str, Tensor], fused: bool) -> dict[str, Tensor]:
    """`expected` (HF names -> tensors of the model's shapes) as the file names them (`BLOCK_NAMES`' parts, on
    meta): what `gguf_state_dict` checks the file's tensors against. fused: the file holds gate and up as one."""
    out: dict[str, Tensor] = {}
    for name, t in expected.items():
        m = _EXPERT.match(name)
        if name.endswith(".self_attn.sinks"):
            out[name + ".weight"] = t
        elif m is None:
            out[name] = t
        elif m.group(2) == "gate_up_proj":  # [E, H, 2I] -> [E, I, H] each, or [E, 2I, H]
            E, H, I2 = t.shape
            for part in (("gate_up_part",) if fused else ("gate_part", "up_part")):
                out[f"{m.group(1)}.{part}.weight"] = _meta(E, I2 if fused else I2 // 2, H)
        elif m.group(2) == "gate_up_proj_bias":
            E, I2 = t.shape
            for part in (("gate_up_part",) if fused else ("gate_part", "up_part")):
                out[f"{m.group(1)}.{part}.bias"] = _meta(E, I2 if fused else I2 // 2)
        elif m.group(2) == "down_proj":  # [E, I, H] stored as [E, H, I]
            E, width, H = t.shape
            out[f"{m.group(1)}.down_part.weight"] = _meta(E, H, width)
        else:
            out[f"{m.group(1)}.down_part.bias"] = t
    return out


def assemble(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The file's tensors (`file_shapes`' names) -> HF's: gate and up interleaved into `gate_up_proj` (and its
    bias), `down_proj` transposed back, the sinks without the `.weight` llama.cpp adds."""
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        stem, _, leaf = name.rpartition(".")
        if name.endswith(".self_attn.sinks.weight"):
            out[stem] = t
        elif stem.endswith("experts.down_part"):
            base = stem.rpartition(".")[0]
            out[f"{base}.down_proj" if leaf == "weight" else f"{base}.down_proj_bias"] = \
                t.transpose(1, 2).contiguous() if leaf == "weight" else t
        elif stem.endswith(("experts.gate_part", "experts.gate_up_part")):
            base = stem.rpartition(".")[0]
            gate, up = _gate_up(tensors, base, leaf)
            pairs = torch.stack([gate, up], dim=-1)  # [.., I, 2]: gate and up alternate (HF's [..., ::2] / [1::2])
            if leaf == "weight":  # [E, I, H] each -> [E, H, 2I]
                out[f"{base}.gate_up_proj"] = pairs.permute(0, 2, 1, 3).reshape(gate.shape[0], gate.shape[2], -1)
            else:
                out[f"{base}.gate_up_proj_bias"] = pairs.reshape(gate.shape[0], -1)
        elif not stem.endswith("experts.up_part"):
            out[name] = t
    return out


def _gate_up(tensors: dict[str, Tensor], base: str, leaf: str) -> tuple[Tensor, Tensor]:
    """(gate, up) of one layer's experts, from two tensors or one (gate rows first)."""
    fused = tensors.get(f"{base}.gate_up_part.{leaf}")
    if fused is not None:
        return fused.chunk(2, dim=1)
    return tensors[f"{base}.gate_part.{leaf}"], tensors[f"{base}.up_part.{leaf}"]


def _meta(*shape: int) -> Tensor:
    return torch.empty(shape, device="meta")
