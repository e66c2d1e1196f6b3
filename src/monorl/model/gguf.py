"""GGUF checkpoints in (llama.cpp's single-file format): `--model.path FILE.gguf`, or a directory holding exactly one
.gguf file and no config.json.

A GGUF file carries what an HF directory spreads over config.json, the safetensors and the tokenizer files: the
hyper-parameters as metadata under `{general.architecture}.*` keys, the tensors under llama.cpp's names (`blk.0.
attn_q.weight`), possibly quantized, and the tokenizer as its vocabulary, merges and special-token ids (plus the
chat template). This module turns each into monorl's: a `ModelConfig` of the file's family
(`monorl.model.families`, by its `general.architecture`), a state dict under HF names, dequantized at load (the
`gguf` package's numerics) and with llama.cpp's Q/K row permutation of Llama files undone, and an `HFTokenizer`
built from the metadata (byte-level BPE vocabularies). The results equal transformers' GGUF loader on the same
file (tests/test_gguf.py holds them to it). Needs the optional `gguf` package (`pip install monorl[gguf]`).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from monorl.model import gemma3_gguf, gpt_oss_gguf
from monorl.model.config import ModelConfig
from monorl.model.families import GEMMA3, GPT_OSS, LLAMA, family_of_gguf
from monorl.model.gguf_header import GGUFHeader
from monorl.model.tokenizer import HFTokenizer

GGUF_SUFFIX = ".gguf"
# quantization types read (the others are refused by name): plain floats, and the block formats in common use
# (MXFP4: GPT-OSS's released experts)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K", "MXFP4")

# llama.cpp tensor names -> HF names ({i}: the block); `_hf_name` applies them
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


class GGUFError(ValueError):
    """A GGUF file monorl cannot load; the message names the file and the field or tensor at fault."""


# ---- finding and opening the file -----------------------------------------------------------------------------

def gguf_file(path: str | os.PathLike) -> Path | None:
    """The GGUF file `path` names: the path itself when it ends in .gguf, the one .gguf file of a directory without
    a config.json, else None (an HF directory). A directory with several .gguf files is a one-line error."""
    p = Path(path)
    if p.suffix == GGUF_SUFFIX and not p.is_dir():
        if not p.is_file():
            raise GGUFError(f"GGUF file {p} does not exist")
        return p
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    found = sorted(p.glob(f"*{GGUF_SUFFIX}"))
    if len(found) > 1:
        raise GGUFError(f"{p} holds {len(found)} .gguf files ({', '.join(f.name for f in found[:4])}): "
                        "give --model.path the one to load")
    return found[0] if found else None


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise GGUFError("reading a .gguf file needs the gguf package: pip install 'monorl[gguf]'") from None
    return gguf


@lru_cache(maxsize=1)  # the config, the tokenizer and the weights each read the same file: parse its header once
def _reader(file: Path, mtime_ns: int) -> GGUFHeader:
    _import_gguf()
    try:
        return GGUFHeader(file)
    except Exception as e:  # a truncated or foreign file: the reader's own error, on one line
        raise GGUFError(f"cannot read GGUF file {file}: {(str(e).splitlines() or [type(e).__name__])[0]}") from None


def open_gguf(file: str | os.PathLike) -> GGUFHeader:
    p = Path(file).resolve()
    return _reader(p, p.stat().st_mtime_ns)


def _field(reader: GGUFHeader, key: str, default: Any = None) -> Any:
    f = reader.get_field(key)
    return default if f is None else f.contents()


# ---- the config --------------------------------------------------------------------------------------------------

def gguf_config(file: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` a GGUF file describes (its metadata; head_dim and a tied head from its tensors)."""
    reader = open_gguf(file)
    arch = _field(reader, "general.architecture")
    try:
        fam = family_of_gguf(arch)
    except ValueError as e:
        raise GGUFError(f"{file}: {e}") from None

    def meta(key: str, default: Any = None, required: bool = True) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if value is None and required:
            raise GGUFError(f"{file}: metadata {arch}.{key} is missing")
        return value

    if fam is not GPT_OSS and (scaling := meta("rope.scaling.type", "none", required=False)) not in ("none", None):
        raise GGUFError(f"{file}: unsupported {arch}.rope.scaling.type {scaling!r} (monorl reads unscaled RoPE "
                        "from GGUF files)")
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise GGUFError(f"{file}: unsupported tensor rope_freqs.weight (Llama 3.1 RoPE frequency factors); load the "
                        "model's HF checkpoint instead")
    heads = int(meta("attention.head_count"))
    kv_heads = int(meta("attention.head_count_kv", heads, required=False))
    hidden = int(meta("embedding_length"))
    q = tensors.get("blk.0.attn_q.weight")
    if q is None:
        raise GGUFError(f"{file}: tensor blk.0.attn_q.weight is missing")
    head_dim = int(q.shape[1]) // heads  # GGUF shapes list the inner dimension first
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{file}: tensor token_embd.weight is missing")
    vocab = int(meta("vocab_size", int(tensors["token_embd.weight"].shape[1]), required=False))
    if fam is GPT_OSS:  # its config through GptOssConfig's reader (`gpt_oss_gguf`)
        try:
            return ModelConfig.from_hf(gpt_oss_gguf.hf_config(meta, lambda key: _field(reader, key), heads, head_dim,
                                                              vocab, "output.weight" not in tensors))
        except ValueError as e:
            raise GGUFError(f"{file}: {e}") from None
    qkv_bias = "blk.0.attn_q.bias" in tensors
    o_bias = "blk.0.attn_output.bias" in tensors
    if fam.qkv_bias and not qkv_bias:
        raise GGUFError(f"{file}: a {arch} model without tensor blk.0.attn_q.bias")
    if fam.qkv_bias is None and qkv_bias != o_bias:
        raise GGUFError(f"{file}: q/k/v biases {'with' if qkv_bias else 'without'} an o_proj bias (blk.0."
                        "attn_output.bias) is no attention monorl implements")
    if "blk.0.ffn_gate.bias" in tensors or "blk.0.ffn_down.bias" in tensors:
        raise GGUFError(f"{file}: unsupported MLP biases (blk.0.ffn_*.bias)")
    try:
        cfg = ModelConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=int(meta("feed_forward_length")),
            num_layers=int(meta("block_count")), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            rope_theta=float(meta("rope.freq_base", fam.defaults["rope_theta"], required=False)),
            rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(meta("context_length", fam.defaults["max_position_embeddings"],
                                             required=False)),
            tie_word_embeddings="output.weight" not in tensors,
            bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        )
        cfg = cfg.with_family(fam.model_type, attention_bias=qkv_bias)
        return gemma3_gguf.config(cfg, meta) if fam is GEMMA3 else cfg
    except ValueError as e:
        raise GGUFError(f"{file}: {e}") from None


# ---- the weights -------------------------------------------------------------------------------------------------

def _hf_name(name: str, block_names: dict[str, str] = _BLOCK_NAMES) -> str | None:
    """The HF name of a llama.cpp tensor name; None for one monorl has no place for."""
    stem, _, leaf = name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{leaf}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in block_names:
        return f"model.layers.{parts[1]}.{block_names[parts[2]]}.{leaf}"
    return None


def _unpermute_rows(w: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's Q/K row order for Llama (its converter interleaves each head's two RoPE halves, for its
    interleaved RoPE): within each head, rows [pairs, 2] -> [2, pairs]. A weight's rows or a bias alike."""
    rest = w.shape[1:]
    return w.reshape(heads, -1, 2, *rest).transpose(1, 2).reshape(w.shape)


def gguf_state_dict(file: str | os.PathLike, cfg: ModelConfig, expected: dict[str, Tensor],
                    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Every tensor `expected` names (HF names -> tensors of the right shape, e.g. on meta), dequantized from the
    GGUF file to `dtype` on `device`. Names, shapes and quantization types are all checked before any data is
    dequantized; a type outside SUPPORTED_TYPES is a one-line error naming it."""
    gguf = _import_gguf()
    reader = open_gguf(file)
    plan: list[tuple[str, Any]] = []
    unexpected = []
    gemma, gpt_oss = cfg.model_type == GEMMA3.model_type, cfg.model_type == GPT_OSS.model_type
    block_names = {**_BLOCK_NAMES, **gemma3_gguf.BLOCK_NAMES} if gemma else \
        {**_BLOCK_NAMES, **gpt_oss_gguf.BLOCK_NAMES} if gpt_oss else _BLOCK_NAMES
    if gpt_oss:  # its experts as the file holds them (`gpt_oss_gguf.assemble` puts them together after)
        expected = gpt_oss_gguf.file_shapes(expected, any(t.name.startswith("blk.0.ffn_gate_up_exps.")
                                                          for t in reader.tensors))
    for t in reader.tensors:
        name = _hf_name(t.name, block_names)
        if name is None or name not in expected:
            unexpected.append(t.name)
            continue
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_TYPES:
            raise GGUFError(f"{file}: tensor {t.name} has quantization type {qtype}, which monorl does not read "
                            f"(supported: {', '.join(SUPPORTED_TYPES)})")
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        if shape != tuple(expected[name].shape):
            raise GGUFError(f"{file}: tensor {t.name} has shape {list(shape)}, the model expects "
                            f"{list(expected[name].shape)} ({name})")
        plan.append((name, t))
    if unexpected:
        raise GGUFError(f"{file}: tensors monorl has no place for: {unexpected[:8]}")
    if missing := sorted(set(expected) - {n for n, _ in plan}):
        raise GGUFError(f"{file}: tensors missing: {missing[:8]}")
    out: dict[str, Tensor] = {}
    permuted = cfg.model_type == LLAMA.model_type

    def dequantize(t: Any) -> Any:  # fp32 (numpy), [rows, inner]; a plain tensor's may be the read-only file view
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        return values if values.flags.writeable else values.copy()

    # numpy's block arithmetic releases the GIL: tensors dequantize side by side (SmolLM2's 272 on a 16-core H100
    # host: #62's start-up)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        dequantized = pool.map(dequantize, [t for _, t in plan])
    for (name, _), values in zip(plan, dequantized, strict=True):
        w = torch.from_numpy(values).reshape(expected[name].shape)
        if permuted and ".self_attn.q_proj." in name:
            w = _unpermute_rows(w, cfg.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            w = _unpermute_rows(w, cfg.num_kv_heads)
        elif gemma and name.endswith("norm.weight"):  # stored as 1 + w (in fp32, as transformers undoes it)
            w = w - gemma3_gguf.NORM_SHIFT
        out[name] = w.to(device=device, dtype=dtype)
    return gpt_oss_gguf.assemble(out) if gpt_oss else out


# ---- the tokenizer -----------------------------------------------------------------------------------------------

# GPT-2's byte-level alphabet: each byte as one printable character (what byte-level BPE vocabularies spell in)
@cache
def _byte_alphabet() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


# how text is split before BPE, by tokenizer.ggml.pre (llama.cpp's names for the vocabularies' split patterns);
# other values split as GPT-2 does (ByteLevel's own pattern)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k_base's pattern (tiktoken; GPT-OSS's files say "gpt-4o"): cased words split at each capital run
_CASED = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"  # (o200k's letter classes)
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_O200K_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_CASED}*{_LOWER}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                rf"|[^\r\n\p{{L}}\p{{N}}]?{_CASED}+{_LOWER}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {"gpt-4o": _O200K_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
                        "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
                        "deepseek-r1-qwen": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def gguf_tokenizer(file: str | os.PathLike) -> HFTokenizer:
    """The tokenizer a GGUF file's metadata describes (byte-level BPE: tokenizer.ggml.model "gpt2"), with its chat
    template: control tokens are special added tokens, user-defined ones plain added tokens, as transformers
    builds them."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    reader = open_gguf(file)
    kind = _field(reader, "tokenizer.ggml.model")
    if kind == "llama" and _field(reader, "general.architecture") == GEMMA3.gguf_arch:  # SentencePiece BPE
        return gemma3_gguf.tokenizer(lambda key, default=None: _field(reader, key, default),
                                     gemma3_gguf.kept_path(file))
    if kind != "gpt2":
        raise GGUFError(f"{file}: unsupported tokenizer.ggml.model {kind!r} (monorl builds byte-level BPE "
                        "tokenizers, 'gpt2')")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges: list[str] = _field(reader, "tokenizer.ggml.merges") or []
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    # a token spelled outside the byte alphabet (llama.cpp writes some as plain text) is respelled byte by byte
    vocab = {tok if set(tok) <= letters else "".join(alphabet[b] for b in tok.encode("utf-8")): i
             for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                               continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(_field(reader, "tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # control tokens spelled outside the byte alphabet are llama.cpp mislabels: transformers leaves them out too
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True)
                            if k == _CONTROL and set(t) <= letters])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=True)
                    if k == _USER_DEFINED and t in vocab])
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for key in ("bos", "eos", "pad", "unk"):
        tid = _field(reader, f"tokenizer.ggml.{'unknown' if key == 'unk' else 'padding' if key == 'pad' else key}"
                             "_token_id")
        if tid is not None:
            config[f"{key}_token"] = tokens[tid]
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
    config.update(add_bos_token=add_bos, add_eos_token=add_eos)
    single = ([f"{config['bos_token']}:0"] if add_bos and "bos_token" in config else []) + ["$A:0"] + \
        ([f"{config['eos_token']}:0"] if add_eos and "eos_token" in config else [])
    specials = [(config[k], tok.token_to_id(config[k])) for k in ("bos_token", "eos_token")
                if k in config and f"{config[k]}:0" in single]
    tok.post_processor = processors.TemplateProcessing(single=" ".join(single), special_tokens=specials)
    template = _field(reader, "tokenizer.chat_template")
    return HFTokenizer(tok, config, chat_template=template)
