"""Weight sync: one copy of the model's parameters -> another (the trainer's -> the generator's), in place.

The trainer holds fp32 masters under HF names (`q_proj`, `k_proj`, ..., `gate_proj`, `up_proj`); the
generator's copy is built in its own dtype with fused projections (`qkv_proj`, `gate_up_proj`), whose row
blocks are the HF projections in the order `PACKED_MODULES` gives (weights and, where a family has them, the
q/k/v biases alike). It lives with the model it maps; the RL loop, the generator and the trainer call it.
`sync_weights_` copies (and casts) every source parameter into its place: a whole destination parameter, or a
row block of a fused one. Nothing is reallocated, so CUDA graphs captured over the destination stay valid. Names
may carry the `_orig_mod.` prefix of a `torch.compile`d module. A name without a place, a destination left
partly unwritten, or a shape that does not fit is a `ValueError` of one line. The mapping is two functions that
a copy in another process (`monorl.rl.ranks.weight_broadcast`) uses too: `sources` (what the source sends,
under which names) and `destination_views` (where each name goes, from names and shapes alone).

LoRA (`monorl.model.lora`): a source projection with adapters whose destination has none (the generator's
fused copy) sends its merged weight W + scale * B @ A there, computed in fp32 at sync time one projection at a
time and cast once; its `lora_A` / `lora_B` have no place of their own. Where the destination has the same
adapters (an unmerged copy), the adapters are copied as ordinary same-name parameters, and the frozen base can be
shared instead of copied (`share_frozen_`): the generator then reads the trainer's own base tensors.

An FSDP2-sharded source (`monorl.distributed.fsdp`, several ranks) is all-gathered in buckets of ~256 MiB
(`GatherPlan`), each full tensor copied to its place as its bucket arrives: the extra memory is one bucket's (or
the largest parameter's). A source with LoRA projections to merge is gathered one FSDP unit at a time instead (a
merge reads its block's gathered base and adapters). Every rank runs the same gathers, so every rank's copy gets
the full weights. A tensor-parallel copy whose group is the FSDP ranks is filled from each rank's own shards instead
(`syncs_from_shards`): nothing is gathered whole but the parameters every rank holds whole.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from monorl.distributed.fsdp import GatherPlan, fsdp_units, unsharded
from monorl.model.lora import LoRALinear, lora_modules

# The generator's copy is built fused: q/k/v as one `qkv_proj`, gate/up as one `gate_up_proj` and a Gated
# DeltaNet layer's four input projections as one `in_proj` (one GEMM each). The trainer's copy and checkpoints keep
# HF's separate projections. This table says which HF projection is which row block of a fused one, in row order.
PACKED_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "in_proj_qkv": ("in_proj", 0), "in_proj_z": ("in_proj", 1), "in_proj_b": ("in_proj", 2),
    "in_proj_a": ("in_proj", 3),
}

Source = Tensor | LoRALinear  # a source parameter, or a LoRA projection whose merged weight is the source
Take = Callable[[Tensor], Tensor]  # a full source tensor -> the destination's piece of it
# (source name, destination name) -> the Take of a destination that holds a piece of its source (a tensor-parallel
# copy: `monorl.generate.tensor_parallel.TensorParallelPlacement`), None for the whole source
Place = Callable[[str, str], Take | None]


def strip_compile_prefix(name: str) -> str:
    return name.replace("_orig_mod.", "")


def source_shape(s: Source) -> torch.Size:
    return s.weight.shape if isinstance(s, LoRALinear) else s.shape


def destination_lora(dst: nn.Module) -> tuple[set[str], dict[str, float]]:
    """What `sources` needs to know of a destination: its parameter names and its LoRA projections' scales."""
    return ({strip_compile_prefix(n) for n, _ in dst.named_parameters()},
            {n: m.scale for n, m in lora_modules(dst).items()})


def sources(src: nn.Module, dst_names: Collection[str], dst_lora_scales: Mapping[str, float]
            ) -> list[tuple[str, Source]]:
    """What `src` sends to a destination with these parameter names and LoRA scales (`destination_lora`), under
    its names (compile prefix dropped), in `src`'s order: every parameter, except that a LoRA projection whose
    destination has no adapters stands for its merged weight (under its `.weight` name; its `lora_A` / `lora_B`
    are not sent)."""
    merge: dict[str, LoRALinear] = {}  # source LoRA projections whose destination has no adapters
    for mname, m in lora_modules(src).items():
        if f"{mname}.lora_A.weight" not in dst_names:
            merge[mname] = m
            continue
        scale = dst_lora_scales.get(mname)
        if scale is None or scale != m.scale:
            raise ValueError(f"weight sync: {mname} has LoRA scale {m.scale:g}, the destination's "
                             + ("is no LoRA projection" if scale is None else f"{scale:g}"))
    out: list[tuple[str, Source]] = []
    for raw, p in src.named_parameters():
        name = strip_compile_prefix(raw)
        module, _, leaf = name.rpartition(".")  # "model.layers.0.self_attn.q_proj", "weight"
        parent, _, proj = module.rpartition(".")
        if merge and proj in ("lora_A", "lora_B") and parent in merge:
            continue  # merged into its projection's weight
        out.append((name, merge[module] if merge and leaf == "weight" and module in merge else p))
    return out


def _taken(shape: tuple[int, ...], take: Take | None) -> tuple[int, ...]:
    return shape if take is None else tuple(take(torch.empty(shape, device="meta")).shape)


def destination_views(dst: nn.Module, shapes: Mapping[str, tuple[int, ...]],
                      packed: Mapping[str, tuple[str, int]] = PACKED_MODULES,
                      place: Place | None = None) -> list[tuple[str, Tensor, Take | None]]:
    """The one mapping from source names to the destination: (source name, destination view) for every entry of
    `shapes` (source name -> shape, HF names), in the destination's parameter order. The view is the whole
    destination parameter of the same name or, for a packed projection (`packed[proj] = (fused, shard)`), its row
    block of the destination's `fused` parameter. Every destination row is covered exactly once, or a one-line
    `ValueError` says what is missing or does not fit. Names and shapes alone: the colocated copy
    (`sync_weights_`) and the receiver of a broadcast (`monorl.rl.ranks.weight_broadcast`) both use it.
    place: the destination holds pieces of its sources (`Place`, a tensor-parallel copy); each entry then carries
    the Take that cuts its piece (None: the whole source)."""
    dst_params = {strip_compile_prefix(n): p for n, p in dst.named_parameters()}
    parts: dict[str, dict[int | None, str]] = {}  # destination name -> shard -> source name
    for name in shapes:
        target, shard = name, None
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if name not in dst_params and proj in packed:
            fused, shard = packed[proj]
            target = f"{parent}.{fused}.{leaf}" if parent else f"{fused}.{leaf}"
        if target not in dst_params:
            raise ValueError(f"weight sync: the destination has no parameter for {name}"
                             + (f" (looked for {target})" if target != name else ""))
        parts.setdefault(target, {})[shard] = name
    if "lm_head.weight" in dst_params and "lm_head.weight" not in parts and "model.embed_tokens.weight" in parts:
        parts["lm_head.weight"] = parts["model.embed_tokens.weight"]  # a tied source's head, held apart (TP)
    shards_of: dict[str, list[tuple[int, str]]] = {}  # fused name -> [(shard, projection)] in row order
    for proj, (fused, shard) in packed.items():
        shards_of.setdefault(fused, []).append((shard, proj))
    out = []
    for target, d in dst_params.items():
        got = parts.get(target)
        if got is None:
            raise ValueError(f"weight sync: no source parameter for the destination's {target}")
        if None in got:  # same name on both sides
            name = got[None]
            take = place(name, target) if place else None
            if (shape := _taken(tuple(shapes[name]), take)) != tuple(d.shape):
                raise ValueError(f"weight sync: {name} has shape {shape}, the destination's {tuple(d.shape)}")
            out.append((name, d, take))
            continue
        row = 0
        module, _, leaf = target.rpartition(".")
        for shard, proj in sorted(shards_of[module.rpartition(".")[2]]):
            if shard not in got:
                raise ValueError(f"weight sync: no source parameter for {proj} (row block {shard} of {target})")
            name = got[shard]
            take = place(name, target) if place else None
            rows = _taken(tuple(shapes[name]), take)
            view = d[row:row + rows[0]]
            if tuple(view.shape) != rows:
                raise ValueError(f"weight sync: {name} has shape {rows}, but rows {row}: of {target} "
                                 f"{tuple(d.shape)} leave {tuple(view.shape)}")
            out.append((name, view, take))
            row += rows[0]
        if row != d.shape[0]:
            srcs = ", ".join(f"{got[i]} {tuple(shapes[got[i]])}" for i in sorted(got))
            raise ValueError(f"weight sync: {srcs} fill {row} of the {d.shape[0]} rows of {target} {tuple(d.shape)}")
    return out


def _plan(dst: nn.Module, src: nn.Module, packed: Mapping[str, tuple[str, int]] = PACKED_MODULES,
          place: Place | None = None) -> list[tuple[str, Tensor, Source, Take | None]]:
    """`weight_pairs`, with a LoRA projection to merge standing for its merged weight (computed at copy time), and
    each pair's Take (`place`'s; None: the whole source)."""
    sent = dict(sources(src, *destination_lora(dst)))
    views = destination_views(dst, {n: tuple(source_shape(s)) for n, s in sent.items()}, packed, place)
    return [(name, view, sent[name], take) for name, view, take in views]


def weight_pairs(dst: nn.Module, src: nn.Module, packed: Mapping[str, tuple[str, int]] = PACKED_MODULES,
                 place: Place | None = None) -> list[tuple[str, Tensor, Tensor]]:
    """(source name, destination view, source tensor) for every parameter of `src`: the view is the whole
    destination parameter of the same name, or, for a packed projection (`packed[proj] = (fused, shard)`),
    its row block of the destination's `fused` parameter. Every destination row is covered exactly once.
    The source tensor is the source parameter, or for a LoRA projection merged into a destination without
    adapters its merged weight (fp32, computed here: all of them at once, so for checks; `sync_weights_`
    merges one at a time). place: the destination holds pieces of its sources (`Place`); the source tensor is then
    the piece."""
    with torch.no_grad():
        place = place or getattr(dst, "weight_place", None)
        return [(n, v, _piece(s, take)) for n, v, s, take in _plan(dst, src, packed, place)]


def _piece(s: Source, take: Take | None, full: Tensor | None = None) -> Tensor:
    """The tensor a destination gets: the source parameter (or `full`, its gathered copy) or a LoRA projection's
    merged weight, cut by `take`."""
    t = s.merged_weight() if isinstance(s, LoRALinear) else (s if full is None else full)
    return t if take is None else take(t)


@torch.no_grad()
def sync_weights_(dst: nn.Module, src: nn.Module, packed: Mapping[str, tuple[str, int]] = PACKED_MODULES,
                  place: Place | None = None) -> None:
    """Copy `src`'s parameters into `dst`'s in place, cast to their dtype (see the module docstring); a parameter
    `share_frozen_` made the source's own is skipped. place: `dst` holds pieces of its sources (a tensor-parallel
    copy, `Place`; default: the one a tensor-parallel copy carries as `weight_place`): each is cut from the full
    source, after an FSDP unit's gather. The plan is made once per pair and kept (`_planned`)."""
    _planned(dst, src, packed, place or getattr(dst, "weight_place", None))()


@dataclass
class _Planned:
    key: tuple  # (src, packed, place, bucket bytes, both models' parameter ids) when planned
    run: Callable[[], None]


# dst -> its last sync's plan: a sync that runs every step (the colocated publication) plans once; planning (names,
# shapes, FSDP buckets) every call was about half its host time (Qwen3-0.6B on 4 H100s: 0.018-0.028 -> 0.009-0.014 s).
# An entry holds its source (and the views of dst) while dst lives; a sync from another source replaces it.
_PLANNED: weakref.WeakKeyDictionary[nn.Module, _Planned] = weakref.WeakKeyDictionary()


def _planned(dst: nn.Module, src: nn.Module, packed: Mapping[str, tuple[str, int]], place: Place | None
             ) -> Callable[[], None]:
    """The copies of `dst` from `src`, from the plan kept for dst if it was made for this source, table, place and
    bucket size and neither model's parameters have been replaced since (by identity: `share_frozen_`, sharding
    or a reload with assign=True make new ones); made and kept otherwise."""
    from monorl.distributed import fsdp

    key = (src, packed, place, fsdp.GATHER_BUCKET_BYTES, tuple(map(id, src.parameters())),
           tuple(map(id, dst.parameters())))
    got = _PLANNED.get(dst)
    if got is not None and all(a is b for a, b in zip(got.key[:3], key[:3], strict=True)) and got.key[3:] == key[3:]:
        return got.run
    run = _route(dst, src, packed, place)
    _PLANNED[dst] = _Planned(key, run)
    return run


def _route(dst: nn.Module, src: nn.Module, packed: Mapping[str, tuple[str, int]], place: Place | None
           ) -> Callable[[], None]:
    """`dst`'s copies from `src`, planned: which way they go (see the module docstring) and what each copies."""
    plan = _plan(dst, src, packed, place)
    if units := fsdp_units(src):
        if _from_shards(plan, place):
            return functools.partial(_sync_from_shards_, plan)
        if _all_sharded(plan):
            return _gathered(plan)
        return functools.partial(_sync_sharded_, plan, src, units)
    return functools.partial(_sync_local_, plan)


def _sync_local_(plan: list[tuple[str, Tensor, Source, Take | None]]) -> None:
    for _, view, s, take in plan:
        if isinstance(s, Tensor) and view.data_ptr() == s.data_ptr() and view.shape == s.shape:
            continue
        view.copy_(_piece(s, take))


def syncs_from_shards(dst: nn.Module, src: nn.Module) -> bool:
    """Whether `sync_weights_(dst, src)` fills `dst` from each rank's own FSDP shards of `src` (`_from_shards`)."""
    place = getattr(dst, "weight_place", None)
    return bool(fsdp_units(src)) and _from_shards(_plan(dst, src, place=place), place)


def _from_shards(plan: list[tuple[str, Tensor, Source, Take | None]], place: Place | None) -> bool:
    """Whether every rank can cut its pieces of an FSDP-sharded source from its own shards instead of gathering
    whole units: a tensor-parallel destination (`place.fits_shard`) whose group is the FSDP ranks, every source a
    sharded parameter (no LoRA projection to merge), each one cut by rows or columns laid out as the group's."""
    fits = getattr(place, "fits_shard", None)
    if fits is None:
        return False
    from torch.distributed.tensor import DTensor  # here: a one-process run never needs it (~1.5 s)

    return all(isinstance(s, DTensor) and (not hasattr(take, "from_shard") or fits(s)) for _, _, s, take in plan)


def _sync_from_shards_(plan: list[tuple[str, Tensor, Source, Take | None]]) -> None:
    """`plan`'s copies from each rank's own FSDP shards (`_from_shards`), cast to the destination's dtype before
    anything moves: a sliced source is cut by its Take's `from_shard` (rows: the shard itself; columns: one
    all-to-all), a whole one (embedding, norms, a row-parallel bias) is all-gathered alone. Every rank walks the
    plan in the same order, so their collectives pair up."""
    for _, view, s, take in plan:
        if hasattr(take, "from_shard"):
            view.copy_(take.from_shard(s.to_local().to(view.dtype), s.shape))
        else:
            full = s.to(view.dtype).full_tensor()
            view.copy_(full if take is None else take(full))


def _all_sharded(plan: list[tuple[str, Tensor, Source, Take | None]]) -> bool:
    """Whether `_gathered` serves: every source an FSDP2-sharded parameter (no LoRA projection to merge) whose
    destination takes it whole (no tensor-parallel cut) into a contiguous view."""
    from torch.distributed.tensor import DTensor, Shard

    return all(isinstance(s, DTensor) and s.placements == (Shard(0),) and take is None and view.is_contiguous()
               for _, view, s, take in plan)


def _gathered(plan: list[tuple[str, Tensor, Source, Take | None]]) -> Callable[[], None]:
    """`plan`'s copies all-gathered straight into their destinations in buckets (`GatherPlan`), each source once:
    a source with a second destination (a tied embedding) is copied there from the first."""
    first: dict[str, tuple[Tensor, Source]] = {}
    again: list[tuple[Tensor, Tensor]] = []
    for name, view, s, _ in plan:
        if name in first:
            again.append((view, first[name][0]))
        else:
            first[name] = (view, s)
    gather = GatherPlan([(s, view) for view, s in first.values()])

    def run() -> None:
        gather()
        for view, copied in again:
            view.copy_(copied)

    return run


def _sync_sharded_(plan: list[tuple[str, Tensor, Source, Take | None]], src: nn.Module, units: list) -> None:
    """`plan`'s copies, one FSDP unit gathered at a time (blocks, then the root). A gathered unit's parameters
    are other tensors than the sharded ones `plan` holds, so they are looked up again by name (a LoRA
    projection reads its gathered weights itself)."""
    from torch.distributed.tensor import DTensor  # here, not at the top: a one-process run never needs it (~1.5 s)

    todo: dict[str, list[tuple[Tensor, Source, Take | None]]] = {}  # a tied embedding may feed two destinations
    for name, view, s, take in plan:
        todo.setdefault(name, []).append((view, s, take))
    prefix_of = {id(m): n for n, m in src.named_modules()}
    for unit in units:
        prefix = prefix_of[id(unit)]
        with unsharded(unit):
            full = {strip_compile_prefix(f"{prefix}.{n}" if prefix else n): p
                    for n, p in unit.named_parameters()}
            for name in [n for n in todo if n in full and not isinstance(full[n], DTensor)]:
                for view, s, take in todo.pop(name):
                    view.copy_(_piece(s, take, full[name]))
    if todo:
        raise ValueError(f"weight sync: no FSDP unit gathered {', '.join(sorted(todo)[:3])}")


def share_frozen_(dst: nn.Module, src: nn.Module) -> int:
    """Make every frozen parameter of `src` (a LoRA policy's base) that `dst` holds under the same name, shape,
    dtype and device the very same tensor in `dst`, instead of a copy; returns the bytes no longer duplicated.
    For an unfused, unmerged destination (a batch-invariant LoRA run's generator): a fused or merged copy has
    other tensors. Frozen means never written, so nothing needs syncing and captured graphs stay valid."""
    mods = {strip_compile_prefix(n): m for n, m in src.named_modules()}
    saved = 0
    for name, m in dst.named_modules():
        sm = mods.get(strip_compile_prefix(name))
        if sm is None:
            continue
        for pname, p in list(m._parameters.items()):
            sp = sm._parameters.get(pname)
            if (p is not None and sp is not None and not sp.requires_grad and sp.shape == p.shape
                    and sp.dtype == p.dtype and sp.device == p.device and not _is_dtensor(sp)):
                m._parameters[pname] = sp
                saved += p.numel() * p.element_size()
    return saved


def _is_dtensor(t: Tensor) -> bool:
    """An FSDP2 shard (a `DTensor`: its shape is the whole tensor's), which a plain copy cannot share."""
    dt = sys.modules.get("torch.distributed.tensor")
    return dt is not None and isinstance(t, dt.DTensor)
