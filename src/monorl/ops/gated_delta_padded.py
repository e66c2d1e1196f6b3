"""The trainer pack's Gated DeltaNet (conv and rule) as one padded sequence of a static length, with no host read,
so that a trainer CUDA graph holds a hybrid's step (#58).

Why: fla's varlen kernels size their grids from the sequences' bounds on the host (`gated_delta.fla_bounds`), so a
pack of other lengths is another launch: a hybrid's trainer step could not be captured, and ran eagerly, its host
~2.5x behind its GPU (an H100, 2026-12-07: train 0.876 s around 356 ms of GPU work).

The layout (`padded_layout`, from cu_seqlens on the device and the pack's static sizes only):
- each sequence starts at a multiple of CHUNK (the rule's chunks then count from its start, as the varlen form's do)
  and is followed by at least K - 1 zero rows, so the causal conv sees zeros before the next one (a fresh state);
- its span's last row is a padding row whose log decay is RESET_G: exp underflows to exactly 0 in fp32, so the
  state after the span is exactly zero and the next sequence starts from zeros. Padding rows carry beta = 0 (no
  update: the rule's WY rows of a beta-0 token are zero) and g = 0 otherwise; the reset row is a chunk's last, so no
  real row's within-chunk cumulative decay includes it;
- the length, `padded_rows`, bounds every layout of a pack with that many rows and sequences (a zero-length entry
  takes no rows), so it is a function of the pack's `PackShape`.
Then the conv and the rule run once over [1, padded rows] (static grids), and each token's output is read back.

What it costs: up to K - 1 + CHUNK - 1 more rows a sequence, computed (~40% more rows at W0's packs); and fla's
state pass walks the padded sequence on Hv x Dv / BV programs, where the varlen one ran a program per sequence too.

`padded_conv_rule(..., fla=False)` runs monorl's references over the same layout (CPU tests check the layout
against the varlen references there); the trainer uses it where fla serves (`serves`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from monorl.ops import sequence_of_rows
from monorl.ops.gated_delta import (
    CHUNK,
    causal_conv,
    choose_fla,
    chunk_gated_delta_rule,
    fla_conv,
    fla_serves,
    fla_tilelang_usable,
    rule_path,
)
from monorl.ops.row_copies import take_rows

RESET_G = -1.0e4  # a reset row's log decay: exp(-1e4) is exactly 0 in fp32, and no difference of it overflows


@dataclass
class PaddedLayout:
    rows: Tensor  # [T] long: each token's row in the padded sequence
    resets: Tensor  # [N] long: each sequence's reset row (the last of its span; an empty entry: the last row)
    size: int  # the padded sequence's rows (`padded_rows`)


def padded_rows(tokens: int, seqs: int, width: int, chunk: int = CHUNK) -> int:
    """The padded sequence's length for a pack of `tokens` rows in `seqs` entries and a conv of `width` taps: each
    sequence's span is its length and K - 1 zero rows, rounded up to whole chunks."""
    return max(chunk, -(-(tokens + seqs * (width - 1 + chunk - 1)) // chunk) * chunk)


def padded_layout(cu_seqlens: Tensor, tokens: int, width: int, chunk: int = CHUNK) -> PaddedLayout:
    """The layout of the sequences at cu_seqlens ([N + 1] from 0, its last entry `tokens`: the pack's fillers cover
    every row) for a conv of `width` taps. Device ops of static shapes only."""
    cu = cu_seqlens.long()
    n = cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    span = torch.where(lens > 0, (lens + width - 1 + chunk - 1) // chunk * chunk, 0)
    start = torch.cumsum(span, 0) - span
    size = padded_rows(tokens, n, width, chunk)
    t = torch.arange(tokens, device=cu.device)
    seq = sequence_of_rows(cu, t).clamp(max=max(n - 1, 0))
    rows = start[seq] + t - cu[seq]
    resets = torch.where(lens > 0, start + span - 1, size - 1)
    return PaddedLayout(rows, resets, size)


def _spread(x: Tensor, layout: PaddedLayout) -> Tensor:
    """x [T, ...] into the padded sequence's rows (zeros elsewhere); its backward reads the rows back."""
    return x.new_zeros(layout.size, *x.shape[1:]).index_copy(0, layout.rows, x)


def serves(*tensors: Tensor) -> bool:
    """Whether fla runs this pack (its conv, and its rule with the gradient the tensors need): the padded form then."""
    return fla_serves(tensors[0]) and fla_conv() is not None and choose_fla(tensors[0], tensors, False) is not None


def capturable(device: torch.device) -> bool:
    """Whether a trainer step's Gated DeltaNet layers can be captured on `device`: fla serves their conv and their
    rule with its backward (`gated_delta.rule_path`); elsewhere the references read the bounds on the host."""
    if device.type != "cuda" or not fla_serves(torch.empty(0, device=device)) or fla_conv() is None:
        return False
    import triton  # on CUDA, torch brings it

    path, _ = rule_path(torch.cuda.get_device_capability(device), True, True, True, triton.__version__,
                        fla_tilelang_usable())
    return path == "fla"


def padded_conv_rule(mixed: Tensor, weight: Tensor, g: Tensor, beta: Tensor, layout: PaddedLayout,
                     split: tuple[int, int, int], heads: tuple[int, int, int, int], fla: bool = True) -> Tensor:
    """SiLU(causal conv) of each sequence's projections `mixed` [T, C] by weight [C, K], split into q, k, v
    (`split` channels; `heads`: Hk, Dk, Hv, Dv), then the gated delta rule with log decay g and beta [T, Hv], each
    sequence from zero states -> o [T, Hv, Dv]. fla: fla's non-varlen kernels (else the references, one sequence)."""
    hk, dk, hv, dv = heads
    x = _spread(mixed, layout)
    w = weight.to(x.dtype)
    n = layout.size
    if fla:
        x, _ = fla_conv()(x[None], w, activation="silu")
        x = x[0]
    else:
        x = causal_conv(x, w, torch.tensor([0, n], device=x.device), None)[0]
    q, k, v = x.split(split, dim=-1)
    q, k, v = q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv)
    gp = _spread(g.float(), layout).index_fill(0, layout.resets, RESET_G)
    bp = _spread(beta, layout)
    if fla:
        chunk = choose_fla(q, (q, k, v, gp, bp), False)[0]
        o, _ = chunk(q[None], k[None], v[None], g=gp[None], beta=bp[None], output_final_state=False,
                     use_qk_l2norm_in_kernel=True)
        o = o[0]
    else:
        o, _ = chunk_gated_delta_rule(q, k, v, gp, bp, torch.tensor([0, n], device=x.device))
    return take_rows(o, layout.rows)
