"""Gemma 3 GGUF files (llama.cpp's `gemma3` architecture), the parts `monorl.model.gguf` reads differently: what
the metadata leaves out (llama.cpp hard-codes it: every 6th layer full attention, 10000 as the sliding layers' RoPE
base, the attention scale), its tensor names (four norms a block), its norm weights (llama.cpp's converter stores
1 + w: `NORM_SHIFT` is taken off again, so the weights equal HF's) and its SentencePiece vocabulary, rebuilt as
transformers' GemmaTokenizer (BPE with byte fallback, merges derived from the vocabulary in file order, as
transformers' GGUF loader derives them)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from monorl.model.config import ModelConfig
from monorl.model.tokenizer import HFTokenizer, kept_copy_path, write_kept_copy

NORM_SHIFT = 1.0
SLIDING_WINDOW_PATTERN = 6  # llama.cpp's LLM_ARCH_GEMMA3: layer i is full attention when (i + 1) % 6 == 0
LOCAL_ROPE_THETA = 10_000.0  # its rope_freq_base_train_swa
# llama.cpp's block tensor names that differ from the Llama-shaped ones
BLOCK_NAMES = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"}


def config(cfg: ModelConfig, meta: Callable[..., Any]) -> ModelConfig:
    """`cfg` (the shared GGUF fields) with Gemma 3's: the layer kinds, the window, the local RoPE base and the
    attention scale (llama.cpp: 1 / sqrt(hidden / heads) for the 62-layer 27B, 1 / sqrt(head_dim) otherwise)."""
    types = tuple("full_attention" if (i + 1) % SLIDING_WINDOW_PATTERN == 0 else "sliding_attention"
                  for i in range(cfg.num_layers))
    scalar = cfg.hidden_size // cfg.num_heads if cfg.num_layers == 62 else cfg.head_dim
    return cfg.replace(layer_types=types, sliding_window=int(meta("attention.sliding_window")),
                       rope_local_theta=LOCAL_ROPE_THETA, query_pre_attn_scalar=float(scalar))


def _merges(tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """transformers' `generate_merges` with the file order as the score (best first): every split of a token into
    two tokens, ordered by the merged token's position, then the pieces' lengths."""
    merges = []
    for index, token in enumerate(tokens):
        local = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend((-index, left, right) for left, right in local)
    merges.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in merges]


END_OF_TURN = "<end_of_turn>"


def tokenizer(field: Callable[..., Any], kept: Path | None = None) -> HFTokenizer:
    """The tokenizer of a Gemma GGUF file (`field(key)`: its metadata). kept: where a copy of the built vocabulary and
    merges is kept (`kept_path`): read from there when it exists, else built and handed to a child process that
    writes it for the next load (`monorl.model.tokenizer.write_kept_copy`). Deriving the merges is most of the
    Gemma 3 270M run's `prepare_s` (1.9 of its 8.4 s start-up on an H100 host); on the 2-core dev box the build took
    4.3 s with the hand-over, and the next load 1.35 s."""
    from tokenizers import Tokenizer, processors

    # a token of spaces only is stored as spaces; GemmaTokenizer spells it with "▁"
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in field("tokenizer.ggml.tokens")]
    vocab = {t: i for i, t in enumerate(tokens)}
    names = {key: tokens[tid] for key, name in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))
             if (tid := field(f"tokenizer.ggml.{name}_token_id")) is not None}
    tok = None
    if kept is not None and kept.is_file():
        with contextlib.suppress(Exception):  # a damaged copy: build again
            tok = Tokenizer.from_file(str(kept))
    if tok is None:
        tok = _built(field, tokens, vocab, names)
        if kept is not None:
            write_kept_copy(kept, text=tok.to_str())
    config: dict[str, Any] = {"tokenizer_class": "GemmaTokenizer", "clean_up_tokenization_spaces": False,
                              **{f"{k}_token": v for k, v in names.items()}}
    add_bos = bool(field("tokenizer.ggml.add_bos_token", False)) and "bos" in names
    config.update(add_bos_token=add_bos, add_eos_token=False)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{names['bos']}:0 $A:0",
                                                           special_tokens=[(names["bos"], vocab[names["bos"]])])
    # a turn ends with <end_of_turn>: Gemma 3's generation_config.json stops on it beside <eos> ([1, 106]), and
    # llama.cpp counts it as an end of generation; the GGUF keeps only eos
    end_of_turn = [vocab[END_OF_TURN]] if END_OF_TURN in vocab else []
    return HFTokenizer(tok, config, chat_template=field("tokenizer.chat_template"), generation_eos=end_of_turn)


def _built(field: Callable[..., Any], tokens: list[str], vocab: dict[str, int], names: dict[str, str]) -> Any:
    """The `tokenizers` object of the vocabulary: BPE with merges derived from it (`_merges`), byte fallback, control
    tokens special, user-defined ones added."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    types: list[int] = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(tokens, vocab), fuse_unk=True,
                               unk_token=names.get("unk", "<unk>"), dropout=None, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True)
                            if k == 3])  # CONTROL
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=True)
                    if k == 4])  # USER_DEFINED
    return tok


def kept_path(file: str | os.PathLike) -> Path | None:
    """Where the built tokenizer of this GGUF file is kept (`monorl.model.tokenizer.kept_copy_path`, its kind this
    module's build)."""
    return kept_copy_path(Path(file), f"gemma3-gguf|{BUILD}")


BUILD = 1  # raise when `_built` changes what it builds: kept copies of the old build are then not read
