"""Weight sync: the trainer's parameters -> the generator's copy, in place.

The trainer holds fp32 masters under HF names (`q_proj`, `k_proj`, ..., `gate_proj`, `up_proj`); the
generator's copy is built in its own dtype with fused projections (`qkv_proj`, `gate_up_proj`), whose row
blocks are the HF projections in the order `monorl.model.qwen3.PACKED_MODULES` gives. `sync_weights_`
copies (and casts) every source parameter into its place: a whole destination parameter, or a row block of a
fused one. Nothing is reallocated, so CUDA graphs captured over the destination stay valid. Names may carry
the `_orig_mod.` prefix of a `torch.compile`d module. A name without a place, a destination left partly
unwritten, or a shape that does not fit is a `ValueError` of one line.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from monorl.model.qwen3 import PACKED_MODULES


def strip_compile_prefix(name: str) -> str:
    return name.replace("_orig_mod.", "")


def weight_pairs(dst: nn.Module, src: nn.Module,
                 packed: Mapping[str, tuple[str, int]] = PACKED_MODULES) -> list[tuple[str, Tensor, Tensor]]:
    """(source name, destination view, source parameter) for every parameter of `src`: the view is the whole
    destination parameter of the same name, or, for a packed projection (`packed[proj] = (fused, shard)`),
    its row block of the destination's `fused` parameter. Every destination row is covered exactly once."""
    dst_params = {strip_compile_prefix(n): p for n, p in dst.named_parameters()}
    parts: dict[str, dict[int | None, tuple[str, Tensor]]] = {}  # destination name -> shard -> source
    for raw, s in src.named_parameters():
        name = strip_compile_prefix(raw)
        target, shard = name, None
        module, _, leaf = name.rpartition(".")  # "model.layers.0.self_attn.q_proj", "weight"
        parent, _, proj = module.rpartition(".")
        if name not in dst_params and proj in packed:
            fused, shard = packed[proj]
            target = f"{parent}.{fused}.{leaf}" if parent else f"{fused}.{leaf}"
        if target not in dst_params:
            raise ValueError(f"weight sync: the destination has no parameter for {name}"
                             + (f" (looked for {target})" if target != name else ""))
        parts.setdefault(target, {})[shard] = (name, s)
    shards_of: dict[str, list[tuple[int, str]]] = {}  # fused name -> [(shard, projection)] in row order
    for proj, (fused, shard) in packed.items():
        shards_of.setdefault(fused, []).append((shard, proj))
    out = []
    for target, d in dst_params.items():
        got = parts.get(target)
        if got is None:
            raise ValueError(f"weight sync: no source parameter for the destination's {target}")
        if None in got:  # same name on both sides
            name, s = got[None]
            if s.shape != d.shape:
                raise ValueError(f"weight sync: {name} has shape {tuple(s.shape)}, the destination's {tuple(d.shape)}")
            out.append((name, d, s))
            continue
        row = 0
        module, _, leaf = target.rpartition(".")
        for shard, proj in sorted(shards_of[module.rpartition(".")[2]]):
            if shard not in got:
                raise ValueError(f"weight sync: no source parameter for {proj} (row block {shard} of {target})")
            name, s = got[shard]
            view = d[row:row + s.shape[0]]
            if view.shape != s.shape:
                raise ValueError(f"weight sync: {name} has shape {tuple(s.shape)}, but rows {row}: of {target} "
                                 f"{tuple(d.shape)} leave {tuple(view.shape)}")
            out.append((name, view, s))
            row += s.shape[0]
        if row != d.shape[0]:
            srcs = ", ".join(f"{got[i][0]} {tuple(got[i][1].shape)}" for i in sorted(got))
            raise ValueError(f"weight sync: {srcs} fill {row} of the {d.shape[0]} rows of {target} {tuple(d.shape)}")
    return out


@torch.no_grad()
def sync_weights_(dst: nn.Module, src: nn.Module, packed: Mapping[str, tuple[str, int]] = PACKED_MODULES) -> None:
    """Copy `src`'s parameters into `dst`'s in place, cast to their dtype (see the module docstring)."""
    for _, view, s in weight_pairs(dst, src, packed):
        view.copy_(s.detach())
