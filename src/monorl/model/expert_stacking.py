"""Expert tensors at the checkpoint boundary: the model holds each sparse layer's experts stacked
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]: transformers 5's in-memory names),
while Hub checkpoints, transformers' `save_pretrained` and vLLM store one tensor per expert and projection
(`mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj` [H, I]). monorl reads either form and
writes the per-expert one, so what it saves loads in transformers and vLLM."""

from __future__ import annotations

import re

import torch
from torch import Tensor

GATE_UP, DOWN = "gate_up_proj", "down_proj"
PER_EXPERT = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def is_stacked(name: str) -> bool:
    return name.endswith((f".mlp.experts.{GATE_UP}", f".mlp.experts.{DOWN}"))


def per_expert_shapes(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """A stacked tensor's per-expert names -> their shapes."""
    prefix, _, proj = name.rpartition(".")
    E, rows, cols = shape
    if proj == GATE_UP:
        return {f"{prefix}.{e}.{p}.weight": (rows // 2, cols) for e in range(E) for p in ("gate_proj", "up_proj")}
    return {f"{prefix}.{e}.down_proj.weight": (rows, cols) for e in range(E)}


def per_expert_expected(expected: dict[str, Tensor]) -> dict[str, Tensor]:
    """`expected` (a model's state dict) with each stacked expert tensor replaced by its per-expert names (meta
    tensors of their shapes), for `monorl.model.hf_checkpoint.load_state_dict`."""
    out: dict[str, Tensor] = {}
    for name, t in expected.items():
        if is_stacked(name):
            out.update({n: torch.empty(s, device="meta") for n, s in per_expert_shapes(name, tuple(t.shape)).items()})
        else:
            out[name] = t
    return out


def stack_experts(state: dict[str, Tensor], expected: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-expert tensors -> the stacked ones of `expected`, a layer at a time (each layer's pieces are dropped as
    it is stacked, so the extra memory is one layer's)."""
    out = {n: t for n, t in state.items() if not PER_EXPERT.match(n)}
    for name, t in expected.items():
        if not is_stacked(name):
            continue
        prefix, _, proj = name.rpartition(".")
        E = t.shape[0]
        if proj == GATE_UP:
            pieces = [torch.cat([state.pop(f"{prefix}.{e}.{p}.weight") for p in ("gate_proj", "up_proj")])
                      for e in range(E)]
        else:
            pieces = [state.pop(f"{prefix}.{e}.down_proj.weight") for e in range(E)]
        out[name] = torch.stack(pieces)
        del pieces
    return out


def unstack_experts(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A state dict with stacked experts -> the per-expert names Hub checkpoints use (contiguous copies), in order."""
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        if not is_stacked(name):
            out[name] = t
            continue
        prefix, _, proj = name.rpartition(".")
        for e in range(t.shape[0]):
            if proj == GATE_UP:
                gate, up = t[e].chunk(2)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
    return out
