"""HF-format checkpoints in and out: `config.json` + safetensors (one file or sharded with an index); GGUF files in
(a path to a .gguf file, or a directory holding one: `monorl.model.gguf`).

Loading builds the model on the meta device and reads each tensor straight to its target device and
dtype, so the weights exist once (a Qwen3-MoE checkpoint's per-expert tensors are stacked a layer at a time:
`monorl.model.expert_stacking`). Saving writes a directory that `transformers` loads as
the family's `*ForCausalLM`, atomically (`monorl.fsutil.write_dir_atomic`: a temp dir beside the target, then one
rename).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from monorl.fsutil import read_json, write_dir_atomic
from monorl.model.config import ModelConfig
from monorl.model.decoder import DecoderForCausalLM
from monorl.model.expert_stacking import is_stacked, per_expert_expected, stack_experts, unstack_experts
from monorl.model.image_processing import ImageProcessor
from monorl.model.qwen3_5_hf import is_nested
from monorl.model.tokenizer import HFTokenizer, Tokenizer, TokenizerError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"

NESTED_IGNORED = ("model.visual.", "mtp.")  # a vision-language checkpoint's vision tower and multi-token head
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float64: "float64"}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file / tensor at fault."""


# ---- reading ---------------------------------------------------------------------------------------

def _check_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint directory {p} does not exist")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint path {p} is not a directory")
    return p


def _gguf(path: str | os.PathLike) -> Path | None:
    """The GGUF file `path` names (`monorl.model.gguf.gguf_file`), or None for an HF directory."""
    from monorl.model.gguf import GGUFError, gguf_file  # imports the tokenizers library: only where needed

    try:
        return gguf_file(path)
    except GGUFError as e:
        raise CheckpointError(str(e)) from None


def load_config(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of an HF checkpoint directory (its `config.json`) or of a GGUF file."""
    if (file := _gguf(path)) is not None:
        from monorl.model.gguf import GGUFError, gguf_config

        try:
            return gguf_config(file)
        except GGUFError as e:
            raise CheckpointError(str(e)) from None
    p = _check_dir(path)
    hf = read_json(p / CONFIG_FILE, CheckpointError)
    try:
        return ModelConfig.from_hf(hf)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{p / CONFIG_FILE}: {e}") from None


def weight_files(path: str | os.PathLike) -> dict[Path, list[str] | None]:
    """Safetensors files of a checkpoint -> the tensor names the index assigns to each (None: unindexed)."""
    p = _check_dir(path)
    index = p / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index, CheckpointError).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no 'weight_map'")
        files: dict[Path, list[str] | None] = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str):
                raise CheckpointError(f"{index}: weight_map[{name!r}] should be a file name, got {shard!r}")
            files.setdefault(p / shard, []).append(name)  # type: ignore[union-attr]
        for shard in files:
            if not shard.is_file():
                raise CheckpointError(f"{index} names shard {shard.name!r}, which does not exist in {p}")
        return files
    if (p / SINGLE_FILE).is_file():
        return {p / SINGLE_FILE: None}
    found = sorted(p.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"no weights in {p}: expected {SINGLE_FILE} or {INDEX_FILE} (+ shards)")
    return dict.fromkeys(found)


def _device_str(device: torch.device | str) -> str:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:  # safetensors wants an explicit ordinal
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def load_state_dict(path: str | os.PathLike, expected: dict[str, Tensor], device: torch.device | str = "cpu",
                    dtype: torch.dtype | None = None, ignore: tuple[str, ...] = (),
                    ignore_prefixes: tuple[str, ...] = ()) -> dict[str, Tensor]:
    """Read every tensor named in `expected` (name -> a tensor of the right shape, e.g. on meta) from
    the checkpoint at `path`, checking names and shapes before reading any data; names in `ignore` or starting
    with one of `ignore_prefixes` are read past."""
    out: dict[str, Tensor] = {}
    unexpected: list[str] = []
    for file, indexed_names in weight_files(path).items():
        try:
            with safe_open(file, framework="pt", device=_device_str(device)) as f:
                names = list(f.keys())
                if indexed_names is not None and (missing := sorted(set(indexed_names) - set(names))):
                    raise CheckpointError(f"{file} lacks tensors its index assigns to it: {missing[:8]}")
                for name in names:
                    if name in ignore or name.startswith(ignore_prefixes):
                        continue
                    if name not in expected:
                        unexpected.append(name)
                        continue
                    if name in out:
                        raise CheckpointError(f"tensor {name!r} is stored twice (again in {file.name})")
                    shape = tuple(f.get_slice(name).get_shape())
                    want = tuple(expected[name].shape)
                    if shape != want:
                        raise CheckpointError(
                            f"tensor {name!r} in {file.name} has shape {list(shape)}, the model expects {list(want)}")
                    t = f.get_tensor(name)
                    out[name] = t if dtype is None or t.dtype == dtype else t.to(dtype)
        except CheckpointError:
            raise
        except Exception as e:  # SafetensorError, OSError: a corrupt or truncated file
            raise CheckpointError(f"cannot read safetensors file {file}: {e}") from None
    if unexpected:
        raise CheckpointError(f"unexpected tensors in {path} (not in the model): {sorted(unexpected)}")
    if missing := sorted(set(expected) - set(out)):
        raise CheckpointError(f"tensors missing from {path}: {missing}")
    return out


def load_checkpoint(path: str | os.PathLike, device: torch.device | str = "cpu",
                    dtype: torch.dtype | None = None) -> DecoderForCausalLM:
    """A model from an HF checkpoint directory or a GGUF file. dtype=None keeps the stored dtype (of the
    embedding, so a checkpoint with mixed dtypes still gives a model of one dtype; a GGUF file's: fp32, in which
    its dequantized values are exact)."""
    cfg = load_config(path)
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg)
    expected = model.state_dict()
    if (file := _gguf(path)) is not None:
        from monorl.model.gguf import GGUFError, gguf_state_dict

        try:
            state = gguf_state_dict(file, cfg, expected, device=device, dtype=dtype or torch.float32)
        except GGUFError as e:
            raise CheckpointError(str(e)) from None
        model.load_state_dict(state, strict=True, assign=True)
        return model.eval()
    # a vision-language checkpoint names the decoder model.language_model.* (`qwen3_vl.hf_name`): Qwen3-VL's whole
    # model, or the language model alone of a Qwen3.5 one (`qwen3_5_hf.is_nested`; its tower's tensors skipped)
    nested = is_nested(read_json(Path(path) / CONFIG_FILE, CheckpointError))
    if cfg.vision is not None or nested:
        from monorl.model.qwen3_vl import hf_name, monorl_name
    else:
        hf_name = monorl_name = _same_name
    if dtype is None:
        dtype = _stored_dtype(path, hf_name("model.embed_tokens.weight"))
    # Tied checkpoints may still carry lm_head.weight (a copy of the embedding): read past it.
    ignore = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    # experts stored one by one (the Hub's form, `monorl.model.expert_stacking`), unless the file has them stacked
    per_expert = (cfg.is_moe and not cfg.family.stacked_experts
                  and not any(map(is_stacked, _stored_names(path))))
    stored = per_expert_expected(expected) if per_expert else expected
    state = load_state_dict(path, {hf_name(n): t for n, t in stored.items()}, device=device, dtype=dtype,
                            ignore=ignore, ignore_prefixes=NESTED_IGNORED if nested else ())
    state = {monorl_name(n): t for n, t in state.items()}
    if per_expert:
        state = stack_experts(state, expected)
    model.load_state_dict(state, strict=True, assign=True)
    # A tensor outside the state dict (e.g. a non-persistent buffer) would still be on meta: say so now.
    if left := [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]:
        raise CheckpointError(f"tensors not initialised by the checkpoint (still on meta): {left}")
    return model.eval()


def _same_name(name: str) -> str:
    return name


def _stored_names(path: str | os.PathLike) -> list[str]:
    """Every tensor name of a checkpoint's safetensors files (their headers only)."""
    names: list[str] = []
    for file in weight_files(path):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                names.extend(f.keys())
        except Exception as e:
            raise CheckpointError(f"cannot read safetensors file {file}: {e}") from None
    return names


def _stored_dtype(path: str | os.PathLike, name: str) -> torch.dtype | None:
    for file in weight_files(path):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                if name in f.keys():
                    return _ST_DTYPES.get(f.get_slice(name).get_dtype())
        except Exception as e:
            raise CheckpointError(f"cannot read safetensors file {file}: {e}") from None
    return None  # load_state_dict reports the missing tensor


def load_pretrained(path: str | os.PathLike, device: torch.device | str = "cpu",
                    dtype: torch.dtype | None = None) -> tuple[DecoderForCausalLM, Tokenizer]:
    """Model and tokenizer from one HF checkpoint directory or GGUF file."""
    model = load_checkpoint(path, device=device, dtype=dtype)
    return model, load_tokenizer(path)


# ---- writing ---------------------------------------------------------------------------------------

def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of an HF checkpoint directory (needs tokenizer.json), or of a GGUF file (from its metadata:
    `monorl.model.gguf`; a directory holding one .gguf file and no config.json is the file)."""
    from monorl.model.gguf import GGUFError, gguf_file, gguf_tokenizer  # imports the tokenizers library

    try:
        if (file := gguf_file(path)) is not None:
            return gguf_tokenizer(file)
    except GGUFError as e:
        raise TokenizerError(str(e)) from None
    return HFTokenizer.from_dir(path)


def _shards(state: dict[str, Tensor], max_shard_bytes: int | None) -> list[dict[str, Tensor]]:
    """Greedy split in insertion order; a tensor larger than the limit gets a shard of its own."""
    if max_shard_bytes is None:
        return [state]
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def save_checkpoint(model: DecoderForCausalLM, path: str | os.PathLike, dtype: torch.dtype | None = None,
                    tokenizer: Tokenizer | None = None, max_shard_bytes: int | None = None,
                    processor: ImageProcessor | None = None) -> Path:
    """Write `model` (and `tokenizer`, if given) as an HF checkpoint directory at `path`, replacing any
    existing one only once the new one is complete. dtype=None keeps the model's dtype. A vision-language model's
    image processor files too (`write_checkpoint_files`)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"cannot save checkpoint to {path}: it exists and is not a directory")
    return write_dir_atomic(path, lambda d: write_checkpoint_files(model, d, dtype, tokenizer, max_shard_bytes,
                                                                   processor=processor))


def write_checkpoint_files(model: DecoderForCausalLM, directory: Path, dtype: torch.dtype | None = None,
                           tokenizer: Tokenizer | None = None, max_shard_bytes: int | None = None,
                           weights: bool = True, processor: ImageProcessor | None = None) -> None:
    """The files of `save_checkpoint`, into an existing directory and not atomically: for a writer that adds
    files of its own beside them and publishes the directory once (a training checkpoint). weights=False writes
    config.json and the tokenizer only (a LoRA run's checkpoint, whose weights are its adapter). A vision-language
    model's preprocessor files (`ImageProcessor.write`): `processor` (the run's, read from the checkpoint it started
    from), else the tower's patch sizes with Qwen3-VL's defaults -- so `AutoProcessor` loads the directory."""
    if any(t.is_meta for t in model.state_dict().values()):
        raise CheckpointError("cannot save a model that still has meta (unmaterialised) tensors")
    if not weights:
        _write_json(directory / CONFIG_FILE, model.config.to_hf(_DTYPE_NAMES.get(dtype, "float32")))
        _write_tokenizer(tokenizer, directory)
        _write_processor(model.config, processor, directory)
        return
    state = {name: t.detach().to("cpu", dtype=dtype or t.dtype).contiguous() for name, t in model.state_dict().items()}
    if model.config.is_moe and not model.config.family.stacked_experts:  # experts one by one, as the Hub stores them
        state = unstack_experts(state)
    if model.config.vision is not None:
        from monorl.model.qwen3_vl import hf_name

        state = {hf_name(n): t for n, t in state.items()}
    saved_dtype = dtype or next(iter(state.values())).dtype
    _write_json(directory / CONFIG_FILE, model.config.to_hf(_DTYPE_NAMES.get(saved_dtype, str(saved_dtype))))
    shards = _shards(state, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], directory / SINGLE_FILE, metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, directory / fname, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(t.numel() * t.element_size() for t in state.values())
        _write_json(directory / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_tokenizer(tokenizer, directory)
    _write_processor(model.config, processor, directory)


def _write_processor(config: ModelConfig, processor: ImageProcessor | None, directory: Path) -> None:
    if config.vision is not None:
        (processor or ImageProcessor.for_model(config.vision)).write(directory)


def _write_tokenizer(tokenizer: Tokenizer | None, directory: Path) -> None:
    if tokenizer is not None:
        tokenizer.save(directory)
        gen = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_ids,
               "pad_token_id": tokenizer.pad_token_id}
        _write_json(directory / GENERATION_CONFIG_FILE, {k: v for k, v in gen.items() if v is not None})


def _write_json(file: Path, data: dict[str, Any]) -> None:
    file.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
