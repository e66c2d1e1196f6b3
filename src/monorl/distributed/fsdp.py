"""FSDP2 on the trainer's policy: each transformer block is one unit and the root (embeddings, final norm,
LM head) another, so a forward or backward holds at most one block's full parameters beyond the root's.

fp32 masters, gradients and AdamW state stay sharded across ranks. On CUDA the blocks compute in bf16 and
gradients are reduced in fp32 (`MixedPrecisionPolicy`); on CPU (gloo, the tests) everything is fp32.
Gradients are *summed* over ranks, not averaged: each rank's loss is already its share of the global step
loss (the trainer divides by step-wide counts), so the sum is the one-rank gradient.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

# torch.distributed.fsdp is imported when a model is sharded: with DTensor and sympy it costs ~1.5 s, which a
# one-process run (the trainer and weight sync import this module) never needs. Until it is imported, no module
# can be an FSDPModule.


def gathered_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype a sharded unit's parameters are gathered in (FSDP2's mixed-precision param_dtype; None: their
    own, fp32): what a forward computes with, and what a gathered weight sync copies from."""
    return torch.bfloat16 if device.type == "cuda" else None


def shard_model_(model: nn.Module, device: torch.device, group: Any = None) -> None:
    """Apply FSDP2 in place: every block of `model.model.layers`, then the root. Call before building the
    optimizer (it must see the sharded parameters). group: the ranks to shard over (default: every rank; a
    disaggregated run's trainer group, `monorl.distributed.placement`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {}
    if (gathered := gathered_dtype(device)) is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=gathered, reduce_dtype=torch.float32)
    if group is not None:
        from torch.distributed.device_mesh import DeviceMesh

        kw["mesh"] = DeviceMesh.from_group(group, device.type)
    for block in model.model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    for unit in fsdp_units(model):  # a plain sum (see the module docstring); gloo has no pre-scaled sum
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


def _fsdp_module_type() -> type | None:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None)


def is_sharded(model: nn.Module) -> bool:
    cls = _fsdp_module_type()
    return cls is not None and isinstance(model, cls)


def fsdp_units(model: nn.Module) -> list[FSDPModule]:
    """The FSDP units of `model`, blocks first (in layer order), the root last; [] for a plain model."""
    cls = _fsdp_module_type()
    if cls is None:
        return []
    return [m for m in model.modules() if isinstance(m, cls) and m is not model] + (
        [model] if isinstance(model, cls) else [])


@contextlib.contextmanager
def unsharded(unit: FSDPModule) -> Iterator[None]:
    """The unit's own parameters gathered in full for the block (its children stay sharded)."""
    unit.unshard()
    try:
        yield
    finally:
        unit.reshard()
