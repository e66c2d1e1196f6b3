"""GPT-OSS from GGUF (`monorl.model.gpt_oss_gguf`): tiny files written with the `gguf` package's GGUFWriter the way
llama.cpp's `convert_hf_to_gguf.py` GptOssModel writes them -- the metadata (YaRN, experts, window), the sinks as
`attn_sinks.weight`, the router as `ffn_gate_inp`, each expert's gate and up de-interleaved into two tensors
(`ffn_gate_exps` / `ffn_up_exps`, or one fused `ffn_gate_up_exps`), `down_proj` transposed -- in fp32 and with the
experts in MXFP4 (the released files' format). The oracle is the model the file was written from: its weights come
back exactly (MXFP4: as gguf-py dequantizes the blocks written) and its logits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from monorl.model.gguf import gguf_config
from monorl.model.hf_checkpoint import load_checkpoint
from tests.test_gguf import byte_level_vocab
from tests.test_gpt_oss_generate import GPT_OSS_TINY

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp"}


def llama_cpp_tensors(state: dict[str, torch.Tensor], fused: bool) -> dict[str, torch.Tensor]:
    """HF names -> llama.cpp's, with the converter's transforms (its non-MXFP4 path, which MXFP4 files also take
    for everything but the experts' weights, whose values then share these layouts)."""
    out = {}
    for name, t in state.items():
        stem, _, leaf = name.rpartition(".")
        if stem in TOP:
            out[f"{TOP[stem]}.{leaf}"] = t
            continue
        _, _, i, rest = name.split(".", 3)
        blk = f"blk.{i}"
        if rest == "self_attn.sinks":
            out[f"{blk}.attn_sinks.weight"] = t
        elif rest == "mlp.experts.gate_up_proj":  # [E, H, 2I] -> [E, 2I, H], gate rows ::2, up rows 1::2
            w = t.transpose(-1, -2)
            gate, up = w[:, ::2, :], w[:, 1::2, :]
            parts = {"ffn_gate_up_exps": torch.cat([gate, up], dim=1)} if fused else \
                {"ffn_gate_exps": gate, "ffn_up_exps": up}
            out.update({f"{blk}.{k}.weight": v.contiguous() for k, v in parts.items()})
        elif rest == "mlp.experts.gate_up_proj_bias":
            gate, up = t[..., ::2], t[..., 1::2]
            parts = {"ffn_gate_up_exps": torch.cat([gate, up], dim=-1)} if fused else \
                {"ffn_gate_exps": gate, "ffn_up_exps": up}
            out.update({f"{blk}.{k}.bias": v.contiguous() for k, v in parts.items()})
        elif rest == "mlp.experts.down_proj":
            out[f"{blk}.ffn_down_exps.weight"] = t.transpose(-1, -2).contiguous()
        elif rest == "mlp.experts.down_proj_bias":
            out[f"{blk}.ffn_down_exps.bias"] = t
        else:
            module, _, leaf = rest.rpartition(".")
            out[f"{blk}.{BLOCK[module]}.{leaf}"] = t
    return out


def write_gpt_oss_gguf(path: Path, model: torch.nn.Module, fused: bool, mxfp4: bool) -> dict[str, np.ndarray]:
    """The file; returns the experts' weights as a loader must read them back (MXFP4: dequantized), by GGUF name."""
    cfg, (tokens, merges) = model.config, byte_level_vocab()
    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.moe_intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_sliding_window(cfg.sliding_window)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(cfg.rope_scaling.factor)
    w.add_rope_scaling_orig_ctx_len(cfg.rope_scaling.original_max_position_embeddings)
    w.add_rope_scaling_attn_factors(cfg.rope_scaling.attention_factor)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    read_back = {}
    for name, t in llama_cpp_tensors(model.state_dict(), fused).items():
        x = t.detach().numpy().astype(np.float32)
        if mxfp4 and name.endswith("_exps.weight"):  # blocks of 32 along each row, as the converter repacks them
            q = gguf.quants.quantize(x, Q.MXFP4)
            w.add_tensor(name, q, raw_dtype=Q.MXFP4)
            read_back[name] = gguf.quants.dequantize(q, Q.MXFP4)
        else:
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return read_back


@pytest.mark.parametrize("fused, mxfp4", [(False, False), (True, False), (False, True)])
def test_a_gpt_oss_gguf_loads_as_the_model_it_was_written_from(tmp_path, fused, mxfp4):
    tokens, _ = byte_level_vocab()
    # experts 64 wide: MXFP4's blocks of 32 along the down projection's rows too; an attention factor exact in fp32
    # (GGUF stores fp32); the SwiGLU limit the files leave out (llama.cpp hard-codes 7, as GptOssConfig's default)
    cfg = GPT_OSS_TINY.replace(vocab_size=len(tokens), moe_intermediate_size=64, intermediate_size=64,
                               rope_scaling=dataclasses.replace(GPT_OSS_TINY.rope_scaling, attention_factor=1.25),
                               swiglu_limit=7.0)
    model = gpt_oss_model_like(cfg)
    file = tmp_path / "tiny.gguf"
    read_back = write_gpt_oss_gguf(file, model, fused, mxfp4)
    got_cfg = gguf_config(file)
    for key in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size", "sliding_window", "layer_types", "rope_theta", "rope_scaling",
                "tie_word_embeddings", "qkv_bias", "o_bias", "swiglu_limit", "swiglu_alpha"):
        assert getattr(got_cfg, key) == getattr(cfg, key), key
    ours = load_checkpoint(file)
    want = model.state_dict()
    if mxfp4:  # the experts' weights as the file's blocks hold them, in HF's layout
        want = dict(want)
        for i in range(cfg.num_layers):
            gate = torch.from_numpy(read_back[f"blk.{i}.ffn_gate_exps.weight"])
            up = torch.from_numpy(read_back[f"blk.{i}.ffn_up_exps.weight"])
            want[f"model.layers.{i}.mlp.experts.gate_up_proj"] = \
                torch.stack([gate, up], dim=-1).permute(0, 2, 1, 3).reshape(cfg.num_experts, cfg.hidden_size, -1)
            want[f"model.layers.{i}.mlp.experts.down_proj"] = \
                torch.from_numpy(read_back[f"blk.{i}.ffn_down_exps.weight"]).transpose(1, 2)
        assert not torch.equal(want["model.layers.0.mlp.experts.down_proj"],
                               model.state_dict()["model.layers.0.mlp.experts.down_proj"])
        model.load_state_dict(want)
    got = ours.state_dict()
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    ids = torch.randint(0, cfg.vocab_size, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    a, b = ours.logits_for([ids])[0], model.logits_for([ids])[0]
    assert b.std() > 0.3 and torch.equal(a, b)


def gpt_oss_model_like(cfg):
    """`tests.test_gpt_oss_generate.gpt_oss_model`'s scaled random weights at `cfg`'s sizes."""
    from tests.test_families import scaled_model

    model = scaled_model(cfg, 4)
    for layer in model.model.layers:
        layer.self_attn.sinks.data.mul_(20.0)
    return model


def test_a_gguf_of_an_unread_moe_architecture_is_refused_in_one_line():
    from monorl.model.families import family_of_gguf

    with pytest.raises(ValueError, match="unsupported GGUF architecture 'qwen3moe'; monorl reads .*'gpt-oss'") as e:
        family_of_gguf("qwen3moe")
    assert "\n" not in str(e.value)


def test_a_gpt_4o_vocabulary_splits_as_o200k(tmp_path):
    """GPT-OSS's files name their pre-tokenizer "gpt-4o" (o200k_base): cased words split at each capital run,
    numbers in threes, a contraction kept on its word -- not GPT-2's split, which keeps "HelloWorld" whole."""
    from monorl.model.gguf import gguf_tokenizer

    tokens, _ = byte_level_vocab()
    file = tmp_path / "tiny.gguf"
    write_gpt_oss_gguf(file, gpt_oss_model_like(GPT_OSS_TINY.replace(vocab_size=len(tokens))), False, False)
    pieces = [p for p, _ in gguf_tokenizer(file)._tok.pre_tokenizer.pre_tokenize_str("HelloWorld 12345 don't")]
    assert pieces == ["Hello", "World", "\u0120", "123", "45", "\u0120don't"]
