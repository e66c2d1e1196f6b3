"""LoRA: low-rank adapters on the model's projections, trained while the base weights stay frozen.

`apply_lora_(model, cfg)` converts each targeted projection in place (`module.__class__ = LoRALinear`, as
`monorl.model.batch_invariant` does, so it works on an already-built or loaded model) and adds two
submodules, so parameter names are PEFT's: `...q_proj.weight` (the frozen base), `...q_proj.lora_A.weight`
[r, in] and `...q_proj.lora_B.weight` [out, r]. The forward is PEFT's:

    y = x @ W^T + scale * (x @ A^T) @ B^T,    scale = alpha / r

A is initialised as PEFT does (kaiming-uniform, a=sqrt(5)), B as zeros, so a fresh adapter changes nothing.
Adapters are fp32 masters; every other parameter is frozen and may be cast to a lower `base_dtype` (a frozen
weight needs no fp32 master). The adapter weights are cast to the input's dtype in the forward (outside the
matmul, so the fp32 master gets the gradient), which under bf16 autocast is what autocast would do anyway.

No dropout: RL post-training uses none (the rollouts' log-probs must be those of the deterministic policy),
and no rslora, DoRA, bias or per-layer rank: `save_adapter` writes a PEFT adapter (`adapter_config.json` +
`adapter_model.safetensors`) that `peft.PeftModel.from_pretrained` loads, and `load_adapter_` reads one back
(also one PEFT saved, of the same kind). `save_merged_checkpoint` writes a plain HF checkpoint of
W + scale * B @ A. The generator's copy gets the merged weights through `monorl.distributed.weight_sync`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from monorl.fsutil import read_json, write_dir_atomic
from monorl.model.blocks import Attention
from monorl.model.decoder import DecoderForCausalLM, materialize_
from monorl.model.layers import Linear
from monorl.model.mlp import MLP

# short name -> HF module name, in the model's order
TARGET_MODULES: dict[str, str] = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
                                  "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT's key prefix of the wrapped model's names


@dataclass
class LoRAConfig:
    rank: int = 0  # 0: LoRA off (full fine-tuning)
    alpha: float = 32.0  # scale = alpha / rank (PEFT's default scaling; no rslora)
    # projections to adapt: q k v o gate up down (or their HF names, q_proj ...)
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")

    def __post_init__(self) -> None:
        if isinstance(self.targets, str):
            self.targets = tuple(t for t in self.targets.split(",") if t)
        self.targets = tuple(self.targets)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"lora.rank must be an integer >= 0 (0: LoRA off), got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) \
                or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"lora.alpha must be a finite number > 0, got {self.alpha!r}")
        known = set(TARGET_MODULES) | set(TARGET_MODULES.values())
        if unknown := [t for t in self.targets if t not in known]:
            raise ValueError(f"lora.targets: unknown {unknown}; known: {', '.join(TARGET_MODULES)} "
                             f"(or {', '.join(TARGET_MODULES.values())})")
        if not self.targets:
            raise ValueError("lora.targets is empty: name at least one projection (q k v o gate up down)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0

    @property
    def modules(self) -> tuple[str, ...]:
        """The targeted HF module names, deduplicated, in the model's order."""
        wanted = {TARGET_MODULES.get(t, t) for t in self.targets}
        return tuple(m for m in TARGET_MODULES.values() if m in wanted)


class LoRALinear(Linear):
    """A frozen projection plus a low-rank update: `F.linear(x, W) + scale * lora_B(lora_A(x))`. Made by
    `apply_lora_` (class swap + two `Linear` submodules in fp32 + `scale`), never constructed directly."""

    lora_A: Linear
    lora_B: Linear
    scale: float

    def forward(self, x: Tensor) -> Tensor:
        a = F.linear(x, self.lora_A.weight.to(x.dtype))
        return F.linear(x, self.weight, self.bias) + F.linear(a, self.lora_B.weight.to(x.dtype)) * self.scale

    @property
    def rank(self) -> int:
        return self.lora_A.weight.shape[0]

    def merged_weight(self) -> Tensor:
        """W + scale * B @ A, computed and returned in fp32 (callers cast once, to where it goes)."""
        return torch.addmm(self.weight.float(), self.lora_B.weight.float(), self.lora_A.weight.float(),
                           alpha=self.scale)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scale={self.scale:g}"


def _strip(name: str) -> str:
    return name.replace("_orig_mod.", "")


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Module name (without a `torch.compile` prefix) -> LoRALinear, in model order."""
    return {_strip(n): m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def is_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter parameters (A, B of each adapted projection, in model order): what the optimizer trains."""
    return [p for m in lora_modules(model).values() for p in (m.lora_A.weight, m.lora_B.weight)]


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Adapter tensors under the model's names (`model.layers.0.self_attn.q_proj.lora_A.weight`, ...)."""
    return {f"{n}.{ab}.weight": getattr(m, ab).weight
            for n, m in lora_modules(model).items() for ab in ("lora_A", "lora_B")}


def _adapted(model: nn.Module) -> tuple[LoRAConfig, dict[str, LoRALinear]]:
    mods = lora_modules(model)
    if not mods:
        raise ValueError("the model has no LoRA adapters (apply_lora_ first)")
    cfg = getattr(model, "lora_config", None)
    if not isinstance(cfg, LoRAConfig):  # e.g. a converted copy: read it back from the modules
        first = next(iter(mods.values()))
        names = {n.rpartition(".")[2] for n in mods}
        cfg = LoRAConfig(rank=first.rank, alpha=first.scale * first.rank, targets=tuple(names))
    return cfg, mods


@torch.no_grad()
def apply_lora_(model: DecoderForCausalLM, cfg: LoRAConfig, seed: int = 0,
                base_dtype: torch.dtype | None = None) -> DecoderForCausalLM:
    """Add LoRA adapters to `model` in place (see the module docstring) and return it. Every non-adapter
    parameter is frozen and, given `base_dtype`, cast to it; adapters are fp32, A drawn from `seed` on the
    parameters' device (deterministic for a seed and device type), B zero. A model that already has
    adapters, a fused (generator) copy, or a batch-invariant one (convert after adding LoRA) is refused."""
    if not isinstance(model, DecoderForCausalLM):
        raise TypeError(f"apply_lora_ adapts a DecoderForCausalLM, got {type(model).__name__}")
    if not cfg.enabled:
        raise ValueError("apply_lora_: lora.rank is 0 (LoRA off)")
    if is_lora(model):
        raise ValueError("apply_lora_: the model already has LoRA adapters")
    if any(isinstance(m, Attention | MLP) and m.fused for m in model.modules()):
        raise ValueError("apply_lora_: the model has fused projections (a generator copy); adapt the unfused model")
    if model.config.is_moe and (mlp := [t for t in cfg.modules if t in ("gate_proj", "up_proj", "down_proj")]):
        # PEFT reads these names on a MoE model as its experts too (transformers 5's fused expert parameters),
        # which monorl does not adapt: an adapter of the dense layers alone would mean something else there
        raise ValueError(f"apply_lora_: lora.targets {list(mlp)} on a mixture-of-experts model (its experts take no "
                         "adapters here; PEFT would adapt them): use --lora.targets q,k,v,o")
    targets = [(n, m) for n, m in model.named_modules() if n.rpartition(".")[2] in cfg.modules]
    if bad := [f"{n} ({type(m).__name__})" for n, m in targets if type(m) is not Linear]:
        raise ValueError(f"apply_lora_: not plain Linear projections: {bad[:3]} (add LoRA before "
                         "make_batch_invariant_)")
    if not targets:
        raise ValueError(f"apply_lora_: the model has none of the target modules {list(cfg.modules)}")
    if base_dtype is not None:
        model.to(base_dtype)
    model.requires_grad_(False)
    gens: dict[torch.device, torch.Generator] = {}
    for _, m in targets:
        dev = m.weight.device
        if dev not in gens:
            gens[dev] = torch.Generator(device=dev).manual_seed(seed)
        with torch.device("meta"):  # no init draw from the global RNG: A is drawn below, B zeroed
            a = Linear(m.in_features, cfg.rank, bias=False, dtype=torch.float32)
            b = Linear(cfg.rank, m.out_features, bias=False, dtype=torch.float32)
        a, b = materialize_(a, dev), materialize_(b, dev)
        nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5), generator=gens[dev])  # PEFT's init of A
        b.weight.zero_()
        m.__class__ = LoRALinear
        m.add_module("lora_A", a)
        m.add_module("lora_B", b)
        m.scale = cfg.scale
    model.lora_config = cfg
    return model


# ---- PEFT format -----------------------------------------------------------------------------------

def _adapter_config_json(cfg: LoRAConfig, base_model_name_or_path: str | None) -> dict[str, Any]:
    """The fields PEFT's LoraConfig reads (those left out take PEFT's defaults)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.rank, "lora_alpha": cfg.alpha, "target_modules": list(cfg.modules), "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
        "revision": None,
    }


def save_adapter(model: nn.Module, path: str | os.PathLike, cfg: LoRAConfig | None = None,
                 base_model_name_or_path: str | None = None) -> Path:
    """Write the adapters of `model` as a PEFT LoRA adapter directory (`adapter_config.json`,
    `adapter_model.safetensors`), atomically. cfg: checked against the model (default: the model's own)."""
    own, mods = _adapted(model)
    cfg = cfg or own
    if cfg.rank != own.rank or not math.isclose(cfg.scale, own.scale, rel_tol=1e-6) \
            or set(cfg.modules) != {n.rpartition(".")[2] for n in mods}:
        raise ValueError(f"save_adapter: config (rank {cfg.rank}, alpha {cfg.alpha}, targets {list(cfg.modules)}) "
                         f"is not the model's (rank {own.rank}, alpha {own.alpha}, targets {list(own.modules)})")
    state = {PEFT_PREFIX + n: t.detach().to("cpu").contiguous() for n, t in lora_state_dict(model).items()}
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"cannot save adapter to {path}: it exists and is not a directory")

    def fill(d: Path) -> None:
        (d / ADAPTER_CONFIG_FILE).write_text(
            json.dumps(_adapter_config_json(cfg, base_model_name_or_path), indent=2) + "\n", encoding="utf-8")
        save_file(state, d / ADAPTER_WEIGHTS_FILE, metadata={"format": "pt"})

    return write_dir_atomic(path, fill)


# adapter_config.json keys whose other values monorl does not run -> the values it does
_PLAIN_LORA: dict[str, tuple[Any, ...]] = {
    "use_rslora": (False, None), "use_dora": (False, None), "bias": ("none", None), "fan_in_fan_out": (False, None),
    "lora_bias": (False, None), "modules_to_save": (None, []), "layers_to_transform": (None, []),
    "rank_pattern": ({}, None), "alpha_pattern": ({}, None), "target_parameters": (None, []),
    "layer_replication": (None, []), "trainable_token_indices": (None, []),
}


def load_adapter_config(path: str | os.PathLike) -> LoRAConfig:
    """The `LoRAConfig` of a PEFT LoRA adapter directory; what monorl cannot run is a one-line ValueError."""
    file = Path(path) / ADAPTER_CONFIG_FILE
    if not Path(path).is_dir():
        raise ValueError(f"adapter directory {path} does not exist (or is not a directory)")
    raw = read_json(file)
    where = f"{file}:"
    if raw.get("peft_type") != "LORA":
        raise ValueError(f"{where} peft_type is {raw.get('peft_type')!r}, not 'LORA'")
    for key, ok in _PLAIN_LORA.items():  # absent, or the value of plain LoRA
        if key in raw and raw[key] not in ok:
            raise ValueError(f"{where} {key}={raw[key]!r} is not supported (monorl runs plain LoRA: {key}={ok[0]!r})")
    targets = raw.get("target_modules")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"{where} target_modules should be a list of module names, got {targets!r}")
    r, alpha = raw.get("r"), raw.get("lora_alpha")
    try:
        return LoRAConfig(rank=r, alpha=alpha, targets=tuple(targets))  # type: ignore[arg-type]
    except ValueError as e:
        raise ValueError(f"{where} {e}") from None


@torch.no_grad()
def load_adapter_(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Read a PEFT LoRA adapter (as `save_adapter` writes it) into `model`'s adapters, in place. The
    adapter's rank, alpha and target modules must be the model's, and its tensors exactly the model's."""
    file_cfg = load_adapter_config(path)
    own, mods = _adapted(model)
    if file_cfg.rank != own.rank or not math.isclose(file_cfg.scale, own.scale, rel_tol=1e-6) \
            or set(file_cfg.modules) != {n.rpartition(".")[2] for n in mods}:
        raise ValueError(f"load_adapter_: {path} has rank {file_cfg.rank}, alpha {file_cfg.alpha}, targets "
                         f"{list(file_cfg.modules)}; the model rank {own.rank}, alpha {own.alpha}, "
                         f"targets {list(own.modules)}")
    expected = {PEFT_PREFIX + n: t for n, t in lora_state_dict(model).items()}
    file = Path(path) / ADAPTER_WEIGHTS_FILE
    if not file.is_file():
        raise ValueError(f"load_adapter_: {ADAPTER_WEIGHTS_FILE} not found in {path}")
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            names = set(f.keys())
            if missing := sorted(set(expected) - names):
                raise ValueError(f"load_adapter_: {file} lacks {len(missing)} adapter tensors, e.g. {missing[:2]}")
            if extra := sorted(names - set(expected)):
                raise ValueError(f"load_adapter_: {file} has tensors the model has no place for, e.g. {extra[:2]}")
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(expected[name].shape):
                    raise ValueError(f"load_adapter_: {name} in {file} has shape {list(shape)}, "
                                     f"the model's {list(expected[name].shape)}")
            for name, t in expected.items():
                t.copy_(f.get_tensor(name))
    except ValueError:
        raise
    except Exception as e:  # SafetensorError, OSError: a corrupt or truncated file
        raise ValueError(f"load_adapter_: cannot read {file}: {e}") from None
    return model


def merged_state_dict(model: DecoderForCausalLM, dtype: torch.dtype | None = None,
                      device: torch.device | str | None = None) -> dict[str, Tensor]:
    """The plain model's state (HF names, no adapters): each adapted projection's weight is its merged weight,
    computed in fp32 and cast to `dtype` (default: the base's dtype) on `device` (default: where it is)
    one projection at a time; the other tensors are the model's own (not copied when no cast is needed)."""
    mods = lora_modules(model)
    dtype = dtype or model.model.embed_tokens.weight.dtype
    out: dict[str, Tensor] = {}
    with torch.no_grad():
        for raw, t in model.state_dict().items():
            name = _strip(raw)
            module, _, leaf = name.rpartition(".")
            if module.endswith((".lora_A", ".lora_B")) and module.rpartition(".")[0] in mods:
                continue
            if leaf == "weight" and module in mods:
                t = mods[module].merged_weight()
            out[name] = t.detach().to(device=device or t.device, dtype=dtype)
    return out


def save_merged_checkpoint(model: DecoderForCausalLM, path: str | os.PathLike, tokenizer: Any = None,
                           dtype: torch.dtype | None = None, max_shard_bytes: int | None = None,
                           processor: Any = None) -> Path:
    """Write base + merged adapters as a plain HF checkpoint (`monorl.model.hf_checkpoint.save_checkpoint`) that
    transformers loads; the live model is not changed. dtype: default the base's dtype. processor: a
    vision-language model's image processor (`save_checkpoint`)."""
    from monorl.model.hf_checkpoint import save_checkpoint

    state = merged_state_dict(model, dtype, device="cpu")
    with torch.device("meta"):
        plain = DecoderForCausalLM(model.config)
    plain.load_state_dict(state, strict=True, assign=True)
    return save_checkpoint(plain, path, dtype=dtype, tokenizer=tokenizer, max_shard_bytes=max_shard_bytes,
                           processor=processor)
