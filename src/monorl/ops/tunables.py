"""Every launch choice of monorl's kernels in one table: block sizes, warps, pipeline stages, split counts, row
limits and thresholds, keyed by chip family, each with where and how it was measured (chip, shapes, benchmark,
date / commit). The kernels in `ops/` read their values here (`tuned`); nothing else holds them.

Chip families: `HOPPER` (sm_90: H100 and H200, where every value was measured) and `DEFAULT` (any other GPU: the
stated default path -- Hopper's values, never measured there, with the Hopper-only tilings switched off, as the
kernels always did). A value measured at some shapes (`Tunable.shapes`, the dims the kernel sees, e.g. a product's
(N, K)) applies at every shape; `lookup` says whether a (chip, shape) was measured or takes the default path.

`Tunable.bitwise` says why a value is part of what a kernel computes: changing it changes results, and for the
batch-invariant kernels it may break the trainer / generator equality. Timing-only values leave every result alone.
Tuning scripts set values for a sweep with `overridden` (never the library itself).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

HOPPER = "hopper"
DEFAULT = "default"


@dataclass(frozen=True)
class Tunable:
    value: Any
    measured: str  # chip, shapes, benchmark, date / commit; or why the value was never swept
    # the dims it was measured at, as its kernel sees them (a product's (N, K), a vocabulary (V,), a norm's row
    # (D,)); (): not tied to shapes
    shapes: tuple[tuple[int, ...], ...] = ()
    bitwise: str = ""  # why changing it changes results ("": timing only)


# Qwen3 products (N, K) in the generator's fused layout, where the GEMM values were measured
_O_DOWN = ((1024, 2048), (1024, 3072), (2048, 2048), (2048, 6144))  # 0.6B o, down; 1.7B o, down
_VOCAB = ((151936,),)  # Qwen3's vocabulary (V)
_INVARIANT_TILE = ("every tiling keeps 64 rows per 4 warps (a 64-row wgmma over K in order), so an element's value "
                   "does not depend on it (tests/test_batch_invariant_gpu.py checks every pair bitwise)")
_SPLIT_SUM = "the number of fp32 K parts summed: ((p0 + p1) + p2) ... (not the batch-invariant path)"
_RULE_SWEEP = ("16 value heads of 128, Dk 128 (Qwen3.5-0.8B/2B): at 40 rows 32.8 us against 42.2 with fla's (8, 1 "
               "warp), floor 25.0; at 128 rows 96.1 against 132.6, floor 80.1 (benchmarks/tune_rule_step.py, H100, "
               "2026-12-08)")
_RULE_SHAPES = ((16, 128, 128),)  # (value heads, Dk, Dv)
_NOT_SWEPT = "set when the kernel was written ({}), not swept"

_HOPPER: dict[str, Tunable] = {
    # ---- matmul_invariant: the batch-invariant GEMM ----
    "matmul.tiling_follows_m": Tunable(True, "the all-tilings-bitwise property checked on H100/H200 only (3ad2b32, "
                                       "2026-11-23, tests/test_batch_invariant_gpu.py)",
                                       bitwise="False gives every row count one tiling (the other chips' path)"),
    "matmul.tiles": Tunable("auto", "auto: the tiling follows M; 'large' (128x128 everywhere) is "
                            "benchmarks/bench_batch_invariant.py --mm-tiles's comparison (cda29a5, 2026-11-22)"),
    "matmul.decode_rows": Tunable(128, "up to 128 rows the GEMV-like decode tiling (3ad2b32, 2026-11-23, with the "
                                  "tiling-follows-M change; not swept alone)", bitwise=_INVARIANT_TILE),
    "matmul.gemv_rows": Tunable(64, "the default generator's products up to 64 rows on this GEMM, faster than "
                                "cuBLAS there: Qwen3-0.6B's four layer GEMMs at 40 rows 24.4 us against cuBLAS 28.4 "
                                "(benchmarks/tune_bi_matmul.py --cold, H100, 3b981c5, 2026-11-25)"),
    "matmul.pack_tiling": Tunable((128, 128, 64, 8, 3), "(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) above decode "
                                  "rows: 6-17% a product faster than 64x128 on 4 warps at 8192 rows of Qwen3-0.6B's "
                                  "shapes, trainer step 0.128/0.131 -> 0.127/0.125 s (benchmarks/tune_bi_matmul.py "
                                  "--warps 4,8, H100, 1f34c39, 2026-11-25)",
                                  bitwise=_INVARIANT_TILE),
    "matmul.fixed_tiling": Tunable((64, 128, 64, 4, 3), "one tiling for every row count where it may not follow M "
                                   "(other chips; 5c140e0, 2026-11-23, H100 CUDA-graph sweep)",
                                   bitwise="the only tiling off Hopper: a new one changes every product there"),
    "matmul.lm_head_min_n": Tunable(32768, "from this many columns (an LM head) at decode rows the LM-head tiling "
                                    "(cd8a1e7, 2026-11-25, H100, Qwen3-0.6B's head)", shapes=_VOCAB,
                                    bitwise=_INVARIANT_TILE),
    "matmul.lm_head_tiling": Tunable((64, 128, 128, 4, 4), "Qwen3-0.6B's LM head at 40 rows 115.6 -> 111.5 us against "
                                     "64x128x64 on 3 stages (tune_bi_matmul.py --cold, H100, cd8a1e7, 2026-11-25)",
                                     shapes=((151936, 1024),), bitwise=_INVARIANT_TILE),
    "matmul.decode_block_n": Tunable(((2048, 16), (4096, 32), (None, 64)), "(most columns, BLOCK_N) at decode rows: "
                                     "Qwen3-0.6B's gate/up at 40 rows 6.4 -> 5.9 us (H200, weights cold, "
                                     "tune_bi_matmul.py --cold, 3b981c5, 2026-11-25)",
                                     shapes=((6144, 1024), (4096, 1024), *_O_DOWN), bitwise=_INVARIANT_TILE),
    "matmul.decode_tile": Tunable((64, 128, 4), "(BLOCK_M, BLOCK_K, warps) of the decode tiling (3b981c5, "
                                  "2026-11-25, H100/H200, tune_bi_matmul.py --cold)", bitwise=_INVARIANT_TILE),
    "matmul.decode_stages": Tunable(((1, 6), (2, 4), (None, 3)), "(most waves of output tiles, stages): a 6-deep "
                                    "pipeline when the tiles fit one wave; Qwen3-0.6B's four layer GEMMs at 40 rows "
                                    "31.6 -> 24.4 us, at 128 rows 35.1 -> 27.4 (tune_bi_matmul.py --cold, H100, "
                                    "3b981c5, 2026-11-25)", bitwise=_INVARIANT_TILE),
    # ---- matmul_invariant_split: the batch-invariant GEMM's K parts, one split for every row count ----
    "matmul_split.parts": Tunable((), "((K, parts), ...): none yet, every product one K loop as before (issue #62, "
                                  "2026-12-07); benchmarks/tune_invariant_split.py times P in 1, 2, 4, 8 at 40 rows "
                                  "per Qwen3-0.6B shape to decide K = 1024 (q/k/v, gate/up, LM head), 2048 (o), "
                                  "3072 (down)", bitwise="where each fp32 part's sum starts: trainer and generator "
                                  "must run the same (keyed by K alone, so fused and unfused weights agree)"),
    "matmul_split.part_align": Tunable(128, "parts are whole runs of this many columns: every tiling's BLOCK_K (64 or "
                                       "128) divides it (issue #62, 2026-12-07; not swept)",
                                       bitwise="the parts' boundaries"),
    "matmul_split.partials_rows": Tunable(64, "up to this many rows a product with parts may write them out, a "
                                          "program per (tile, part) (issue #62, 2026-12-07; not swept: "
                                          "tune_invariant_split.py times both kernels)"),
    "matmul_split.max_block_n": Tunable(64, "the partials kernel's widest column tile, as decode_gemm.max_block_n "
                                        "(issue #62, 2026-12-07; not swept)"),
    "decode_gemm.sum_block": Tunable(1024, _NOT_SWEPT.format("issue #62's one-launch sum of parts, 2026-12-07")),
    "decode_gemm.sum_warps": Tunable(4, _NOT_SWEPT.format("issue #62's one-launch sum of parts, 2026-12-07")),
    # ---- decode_gemm: the default mode's split-K decode products ----
    "decode_gemm.enabled": Tunable(True, "measured on H100/H200 only (ed88930, 2026-11-26)"),
    "decode_gemm.parts": Tunable(2, "K parts up to max_rows rows: 0.6B o 5.38 -> 4.21 us, down 7.14 -> 5.27; 1.7B o "
                                 "5.64 -> 4.71, down 12.64 -> 9.49 at 40 rows (benchmarks/tune_decode_gemm.py, H200, "
                                 "weights cold, ed88930 / b373588, 2026-11-26)", shapes=_O_DOWN, bitwise=_SPLIT_SUM),
    "decode_gemm.block_k": Tunable(128, "(ed88930, 2026-11-26, H200, tune_decode_gemm.py; kept by "
                                   "tune_mid_rows_gemm.py's sweep, 1b911e1)", shapes=_O_DOWN,
                                   bitwise="the K parts are whole blocks: where each part's sum starts"),
    "decode_gemm.min_k_blocks": Tunable(4, "K below this many blocks stays on the other paths (ed88930, 2026-11-26)"),
    "decode_gemm.max_block_n": Tunable(64, "the widest column tile of the up-to-max_rows path; 1.7B's 2048 columns "
                                       "in 32-column tiles (b373588, 2026-11-26, H200, tune_decode_gemm.py)",
                                       shapes=_O_DOWN),
    "decode_gemm.max_rows": Tunable(64, "one 64-row tile: the 2-part path (ed88930, 2026-11-26, H200)",
                                    shapes=_O_DOWN),
    "decode_gemm.block_m": Tunable(64, "rows a tile (the 64-row wgmma; ed88930, 2026-11-26)"),
    "decode_gemm.warps": Tunable(4, "(ed88930, 2026-11-26; tune_mid_rows_gemm.py's best, 1b911e1, H200)"),
    "decode_gemm.stages_one_tile": Tunable(6, "one row tile: a deep pipeline, one program an SM (ed88930, "
                                           "2026-11-26, H200, tune_decode_gemm.py)", shapes=_O_DOWN),
    "decode_gemm.mid_rows_max": Tunable(192, "65..192 rows in 64-row tiles of split-K parts instead of cuBLAS: graphed "
                                        "decode step (profile_decode_step.py --variants, Qwen3-0.6B, ms, cuBLAS / 4 "
                                        "parts / 2 parts) 96 rows 2.98 / 2.85 / 2.91, 128 rows 3.47 / 3.35, 192 rows "
                                        "4.25-4.30 / 4.41-4.43 / 4.23, 256 rows no gain (H200, 12d5c0c, 2026-11-26; "
                                        "RESULTS.md 2026-11-26 session 2)", shapes=_O_DOWN),
    "decode_gemm.mid_block_n": Tunable(64, "(tune_mid_rows_gemm.py, H200, weights cold, 12d5c0c; rechecked on "
                                       "decode_gemm's own kernel: (64, 64, 128, 4, 4, 4) best, 4.67 / 5.41 us for "
                                       "0.6B o / down at 128 rows, 1b911e1, 2026-11-26)", shapes=_O_DOWN),
    "decode_gemm.max_mid_parts": Tunable(4, "as many parts as fill the SMs once, at most 4: o 6.12 -> 4.54 us at 128 "
                                         "rows, down 8.46 -> 5.36 (tune_mid_rows_gemm.py, H200, 12d5c0c, 2026-11-26)",
                                         shapes=_O_DOWN, bitwise=_SPLIT_SUM),
    "decode_gemm.stages_mid": Tunable(4, "(tune_mid_rows_gemm.py's best (64, 64, 128, 4, 4, 4), H200, 1b911e1, "
                                      "2026-11-26)", shapes=_O_DOWN),
    # ---- attention_triton: varlen-causal and paged decode ----
    "attention.block_n": Tunable(64, "keys a block; 128-key blocks slower with the block table read ahead (75.3 "
                                 "against 69.7 us, 34 rows of ~1460 keys; tune_decode_attention.py --spread, H200, "
                                 "2026-11-26)", bitwise="the online-softmax update's steps: both layouts must agree"),
    "attention.rows": Tunable(16, "query rows a program: the smallest tensor-core tile (d75fc9f, 2026-11-23)",
                              bitwise="the dot products' tile shape, the same in both layouts"),
    "attention.warps": Tunable(4, "2 warps were faster in paged decode (9.2-11.5 against 10.4-12.8 us, 40 rows, H200, "
                               "tune_decode_attention.py) but broke generator == trainer log-probs (2f39bc0, "
                               "2026-11-24)", bitwise="the varlen and paged launches must run the same warps"),
    "attention.split_below_programs_per_sm": Tunable(2, "40 rows gained nothing from splits in the decode step "
                                                     "(6fea232, 2026-11-25, H100)"),
    "attention.split_target_programs_per_sm": Tunable(8, "8 rows of ~1000 keys 53 -> 20 us (16 splits), 32 of ~1500 "
                                                      "95 -> 73 (8) (tune_decode_attention.py --splits, H100, cold, "
                                                      "273aafd, 2026-11-25)",
                                                      bitwise="the default mode's merge order (never the invariant)"),
    "attention.max_splits": Tunable(16, "(273aafd, 2026-11-25, H100, tune_decode_attention.py --splits)",
                                    bitwise="the default mode's merge order (never the invariant)"),
    "attention.window_split_keys": Tunable(256, "a sliding-window layer's keys a split at least: window 512, 64 rows "
                                           "(Gemma 3's heads), us a launch by splits 1 / 2 / 4 / 8 / 16: 22.6 / 15.8 / "
                                           "20.0 / 22.2 / 30.9 (tune_window_splits.py, H200, 2026-12-07)",
                                           bitwise="the default mode's merge order (never the invariant)"),
    "attention.combine_warps": Tunable(1, _NOT_SWEPT.format("273aafd, 2026-11-25")),
    "attention.cached_rows": Tunable(64, "query rows a program of a turn boundary's paged prefill (32 new tokens of "
                                     "Qwen3's 2 query heads a kv head), us a layer for 64 sequences x 65 new tokens "
                                     "over ~2,300 keys (Qwen3-0.6B heads): 64 rows / 4 warps 487, 128 / 8 581, 32 / 4 "
                                     "765, 16 / 4 820 (profile_turn_boundary.py, H100, 2026-11-27): compute-bound, a "
                                     "tile's rows past a sequence's tokens are work too"),
    "attention.cached_warps": Tunable(4, "64 rows: 4 warps 487 us, 8 725; 128 rows: 8 warps 581, 4 1609 (the same "
                                      "run, profile_turn_boundary.py, H100, 2026-11-27)"),
    # ---- block_kernels: the generator's fused block ops ----
    "block.split_qk_tokens": Tunable(512, "q and k heads in separate programs up to 512 tokens: 40 tokens 2.42 -> "
                                     "1.95 us a launch; packs keep one program a token (trainer step 0.077 against "
                                     "0.076 s) (H200, 7081bdc, 2026-11-26)"),
    "block.qk_warps": Tunable(4, _NOT_SWEPT.format("26f99f1, 2026-11-23"),
                              bitwise="the q/k norms' row sum tree (both sides of the batch-invariant mode run it)"),
    "block.norm_warps": Tunable(((2048, 4), (None, 8)), "(widest row D, warps) of the add + norm: "
                                + _NOT_SWEPT.format("26f99f1, 2026-11-23"),
                                bitwise="the norm's row sum tree (both sides of the batch-invariant mode run it)"),
    "block.silu_block": Tunable(1024, _NOT_SWEPT.format("26f99f1, 2026-11-23; the backward's 9fcc63e")),
    "block.silu_warps": Tunable(4, _NOT_SWEPT.format("26f99f1, 2026-11-23")),
    # ---- logprob_invariant: batch-invariant token log-probs ----
    "logprob.segments": Tunable(8, "a program per (row, segment): ~40 -> 10.5 + 9.7 us a 40-row decode step (H200, "
                                "fb6bf09, 2026-11-25)", shapes=_VOCAB,
                                bitwise="the row sums' order: trainer and generator must run the same"),
    "logprob.block": Tunable(1024, "(fb6bf09, 2026-11-25, H200)", shapes=_VOCAB,
                             bitwise="segment lengths are whole blocks: the row sums' order"),
    "logprob.warps": Tunable(4, _NOT_SWEPT.format("fb6bf09, 2026-11-25"), bitwise="the in-block sum's tree"),
    "logprob.combine_warps": Tunable(1, _NOT_SWEPT.format("fb6bf09, 2026-11-25")),
    "logprob.backward_block": Tunable(2048, _NOT_SWEPT.format("9fcc63e, 2026-11-24")),
    "logprob.backward_warps": Tunable(4, _NOT_SWEPT.format("9fcc63e, 2026-11-24")),
    # ---- rmsnorm_invariant: the norm and its backward ----
    "rmsnorm.warps": Tunable(4, _NOT_SWEPT.format("cda29a5, 2026-11-22"), bitwise="the row sum's tree"),
    "rmsnorm.backward_tile_elements": Tunable(2048, "kept launch (2048, 8, 2) of tune_rms_backward.py at a 9,216-token "
                                              "pack (H100, CUDA graphs, 24dd59e, 2026-11-25; the best per shape "
                                              "would save ~0.3 ms a step: not changed)",
                                              shapes=((1024,), (128,)), bitwise="the weight gradient's partials"),
    "rmsnorm.backward_warps": Tunable(8, "(tune_rms_backward.py, H100, 24dd59e, 2026-11-25)", shapes=((1024,), (128,))),
    "rmsnorm.backward_programs_per_sm": Tunable(2, "(tune_rms_backward.py, H100, 24dd59e, 2026-11-25)",
                                                shapes=((1024,), (128,)), bitwise="the weight gradient's partials"),
    "rmsnorm.sum_rows_block": Tunable((64, 64, 4), "(rows, widest columns, warps) of the partials' fixed-order sum: "
                                      + _NOT_SWEPT.format("24dd59e, 2026-11-25"),
                                      bitwise="the weight gradient's sum order"),
    # ---- sample_kernels: the fused sampler ----
    "sampler.chunk": Tunable(8192, "top-p sampler at 40 rows 175.6 -> ~142 us with (8192, 2048, 1024, 4) against "
                             "(16384, 2048, 2048, 8) (benchmarks/tune_sampler.py, H100, CUDA graph, cd8a1e7, "
                             "2026-11-25); 2048 / 4096 no gain (H200, 2026-11-26)", shapes=_VOCAB,
                             bitwise="the sampled token's log-prob: its sum order"),
    "sampler.block": Tunable(2048, "(tune_sampler.py, H100, cd8a1e7, 2026-11-25)", shapes=_VOCAB,
                             bitwise="the sampled token's log-prob: its sum order"),
    "sampler.nucleus_block": Tunable(1024, "(tune_sampler.py, H100, cd8a1e7, 2026-11-25)", shapes=_VOCAB),
    "sampler.warps": Tunable(4, "(tune_sampler.py, H100, cd8a1e7, 2026-11-25)", shapes=_VOCAB,
                             bitwise="the sampled token's log-prob: its in-block sum's tree"),
    "sampler.bits": Tunable(4, "bits a nucleus-search level (16 // bits levels): 0005ad7 (2026-11-26, H200) set 4 "
                            "over 2, timing both (40 flat rows 47.6 / 43.9 us, peaked 103.6 / 146.5, decode step "
                            "1.213-1.219 ms either way); exact integer sums, so the same threshold either way"),
    "sampler.search_block": Tunable(256, "logits a search-level iteration (0005ad7, 2026-11-26, H200)"),
    "sampler.search_chunk": Tunable(2048, "the search and masked pass over planned rows' 2,048-logit chunks: levels "
                                    "8.2 -> 4.3 us, masked pass 20 -> 4.9 us in a 40-row decode step (H200, a2eb376, "
                                    "2026-11-26)", shapes=_VOCAB),
    "sampler.search_programs_per_sm": Tunable(2, "(a2eb376, 2026-11-26, H200)"),
    "sampler.plan_rows": Tunable(128, "rows a plan-kernel iteration: " + _NOT_SWEPT.format("a2eb376, 2026-11-26")),
    "sampler.plan_warps": Tunable(4, _NOT_SWEPT.format("a2eb376, 2026-11-26")),
    "sampler.sort_path_warps": Tunable(8, "the non-bf16 sorted nucleus pass: "
                                       + _NOT_SWEPT.format("20811b6, 2026-11-23")),
    "sampler.combine_warps": Tunable(1, _NOT_SWEPT.format("20811b6, 2026-11-23")),
    # ---- the decode step's bookkeeping, the entropy metric, shared-prompt gradients ----
    "decode_state.step_warps": Tunable(1, _NOT_SWEPT.format("decode_state.py, 2026-11-26")),
    "decode_state.commit_warps": Tunable(4, _NOT_SWEPT.format("decode_state.py, 2026-11-26")),
    "entropy.block": Tunable(2048, _NOT_SWEPT.format("6fea232, 2026-11-25"), bitwise="the metric's sum order"),
    "entropy.warps": Tunable(8, _NOT_SWEPT.format("6fea232, 2026-11-25"), bitwise="the metric's sum order"),
    "row_copies.warps": Tunable(4, _NOT_SWEPT.format("row_copies.py, 2026-11-25")),
    # ---- Qwen3.5's decode step (gated_delta_decode.py) ----
    "gated_delta_decode.rule_bv": Tunable(64, _RULE_SWEEP, shapes=_RULE_SHAPES),
    "gated_delta_decode.rule_warps": Tunable(4, _RULE_SWEEP, shapes=_RULE_SHAPES),
    "gated_delta_decode.rule_stages": Tunable(1, "one load and one store a program: nothing to pipeline (both "
                                              "values timed the same, " + _RULE_SWEEP + ")"),
}

# Other chips: Hopper's values, unmeasured, with the Hopper-only tilings off (what the kernels always did there).
_OFF_HOPPER = {"matmul.tiling_follows_m": False, "decode_gemm.enabled": False}
_DEFAULT: dict[str, Tunable] = {
    name: replace(t, value=_OFF_HOPPER.get(name, t.value), shapes=(),
                  measured=("Hopper-only: off here" if name in _OFF_HOPPER else "not measured on this chip: "
                            "Hopper's value (" + t.measured + ")"))
    for name, t in _HOPPER.items()}

TABLE: dict[str, dict[str, Tunable]] = {HOPPER: _HOPPER, DEFAULT: _DEFAULT}
_OVERRIDES: dict[str, Any] = {}  # set by `overridden` (tuning scripts) only


@functools.cache
def chip_of(device_index: int) -> str:
    """The table's chip family of CUDA device `device_index`: HOPPER for sm_90, DEFAULT otherwise."""
    return HOPPER if torch.cuda.get_device_capability(device_index)[0] == 9 else DEFAULT


def chip_for(t: torch.Tensor) -> str:
    """`chip_of` the CUDA tensor t's device."""
    return chip_of(t.device.index or 0)


def _entry(name: str, chip: str) -> Tunable:
    try:
        return TABLE[chip][name]
    except KeyError:
        raise KeyError(f"no tunable {name!r} for chip {chip!r}; chips: {', '.join(TABLE)}; "
                       f"names: {', '.join(sorted(_HOPPER))}") from None


def tuned(name: str, chip: str) -> Any:
    """The value of tunable `name` on `chip` (a tuning script's override first)."""
    if name in _OVERRIDES:
        return _OVERRIDES[name]
    return _entry(name, chip).value


def threshold_pick(pairs: tuple[tuple[int | None, Any], ...], x: int) -> Any:
    """The value of the first (limit, value) pair with x <= limit (a None limit: any x)."""
    return next(v for limit, v in pairs if limit is None or x <= limit)


@dataclass(frozen=True)
class Resolved:
    value: Any
    measured: bool  # this chip and shape were measured (False: the default path)
    source: str


def lookup(name: str, chip: str, shape: tuple[int, ...] | None = None) -> Resolved:
    """`tuned`'s value with where it comes from: the measurement, or the stated default path for a chip or a
    shape (the dims as the kernel sees them, e.g. a product's (N, K)) that was never measured."""
    t = _entry(name, chip)
    if chip != HOPPER:
        return Resolved(t.value, False, f"default path: {t.measured}")
    if shape is not None and t.shapes and tuple(shape) not in t.shapes:
        return Resolved(t.value, False, f"default path: shape {tuple(shape)} not measured; the value measured at "
                                        f"{', '.join(map(str, t.shapes))} applies ({t.measured})")
    return Resolved(t.value, True, t.measured)


@contextlib.contextmanager
def overridden(values: Mapping[str, Any]) -> Iterator[None]:
    """Tuning scripts: run the block with these tunables set (every chip), then restore them."""
    if unknown := sorted(set(values) - set(_HOPPER)):
        raise KeyError(f"unknown tunables: {', '.join(unknown)}")
    before = dict(_OVERRIDES)
    _OVERRIDES.update(values)
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(before)
