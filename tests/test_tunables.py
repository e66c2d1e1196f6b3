"""The kernels' launch table (`monorl.ops.tunables`): every value pinned to what the kernels used before the table
(an edit that changes one is visible here, and some of them decide the batch-invariant mode's bitwise equality),
the choices the launch functions make from them on Hopper and on the default path, and where each value comes from."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from monorl.ops import decode_gemm, matmul_invariant, rmsnorm_invariant, tunables
from monorl.ops.attention import kernel as attention_triton
from monorl.ops.tunables import DEFAULT, HOPPER, TABLE, lookup, overridden, tuned

# The values the kernels held as constants and literals before the table (commit f38d3cf), Hopper (H100 / H200).
PINNED = {
    "matmul.tiling_follows_m": True, "matmul.tiles": "auto", "matmul.decode_rows": 128, "matmul.gemv_rows": 64,
    "matmul.pack_tiling": (128, 128, 64, 8, 3), "matmul.fixed_tiling": (64, 128, 64, 4, 3),
    "matmul.lm_head_min_n": 32768, "matmul.lm_head_tiling": (64, 128, 128, 4, 4),
    "matmul.decode_block_n": ((2048, 16), (4096, 32), (None, 64)), "matmul.decode_tile": (64, 128, 4),
    "matmul.decode_stages": ((1, 6), (2, 4), (None, 3)),
    "decode_gemm.enabled": True, "decode_gemm.parts": 2, "decode_gemm.block_k": 128, "decode_gemm.min_k_blocks": 4,
    "decode_gemm.max_block_n": 64, "decode_gemm.max_rows": 64, "decode_gemm.block_m": 64, "decode_gemm.warps": 4,
    "decode_gemm.stages_one_tile": 6, "decode_gemm.mid_rows_max": 192, "decode_gemm.mid_block_n": 64,
    "decode_gemm.max_mid_parts": 4, "decode_gemm.stages_mid": 4, "decode_gemm.sum_block": 1024,
    "decode_gemm.sum_warps": 4,
    # the invariant GEMM's K parts (issue #62): none until measured, so every product keeps its one K loop
    "matmul_split.parts": (), "matmul_split.part_align": 128, "matmul_split.partials_rows": 64,
    "matmul_split.max_block_n": 64,
    "attention.block_n": 64, "attention.rows": 16, "attention.warps": 4, "attention.split_below_programs_per_sm": 2,
    "attention.split_target_programs_per_sm": 8, "attention.max_splits": 16, "attention.combine_warps": 1,
    "attention.cached_rows": 64, "attention.cached_warps": 4,  # the turn boundary's paged prefill (2026-11-27)
    "attention.window_split_keys": 256,  # a sliding-window layer's decode splits (2026-12-07)
    "block.split_qk_tokens": 512, "block.qk_warps": 4, "block.norm_warps": ((2048, 4), (None, 8)),
    "block.silu_block": 1024, "block.silu_warps": 4,
    "logprob.segments": 8, "logprob.block": 1024, "logprob.warps": 4, "logprob.combine_warps": 1,
    "logprob.backward_block": 2048, "logprob.backward_warps": 4,
    "rmsnorm.warps": 4, "rmsnorm.backward_tile_elements": 2048, "rmsnorm.backward_warps": 8,
    "rmsnorm.backward_programs_per_sm": 2, "rmsnorm.sum_rows_block": (64, 64, 4),
    "sampler.chunk": 8192, "sampler.block": 2048, "sampler.nucleus_block": 1024, "sampler.warps": 4,
    "sampler.bits": 4, "sampler.search_block": 256, "sampler.search_chunk": 2048,
    "sampler.search_programs_per_sm": 2, "sampler.plan_rows": 128, "sampler.plan_warps": 4,
    "sampler.sort_path_warps": 8, "sampler.combine_warps": 1,
    "decode_state.step_warps": 1, "decode_state.commit_warps": 4, "entropy.block": 2048, "entropy.warps": 8,
    "row_copies.warps": 4, "gated_delta_decode.rule_bv": 64, "gated_delta_decode.rule_warps": 4,
    "gated_delta_decode.rule_stages": 1,
}
HOPPER_ONLY = {"matmul.tiling_follows_m", "decode_gemm.enabled"}  # off on the default path, as they always were


def test_hopper_values_are_the_kernels_constants():
    assert set(TABLE[HOPPER]) == set(PINNED) == set(TABLE[DEFAULT])
    assert {name: tuned(name, HOPPER) for name in PINNED} == PINNED


def test_default_path_keeps_the_values_and_turns_the_hopper_tilings_off():
    """Other chips: Hopper's values, unmeasured (said so), with the Hopper-only tilings off."""
    for name, value in PINNED.items():
        got = lookup(name, DEFAULT)
        assert got.value == (False if name in HOPPER_ONLY else value), name
        assert not got.measured and got.source.startswith("default path: "), name


def test_every_entry_says_where_it_comes_from():
    dated = re.compile(r"20\d\d-\d\d-\d\d")
    for name, t in TABLE[HOPPER].items():
        assert dated.search(t.measured), f"{name}: no date in {t.measured!r}"
        assert lookup(name, HOPPER).measured and lookup(name, HOPPER).source == t.measured


def test_a_shape_never_measured_takes_the_stated_default_path():
    measured = lookup("decode_gemm.mid_rows_max", HOPPER, (1024, 3072))  # Qwen3-0.6B's down projection
    assert measured.value == 192 and measured.measured and "H200" in measured.source
    other = lookup("decode_gemm.mid_rows_max", HOPPER, (2560, 9728))  # Qwen3-4B's down: never measured
    assert other.value == 192 and not other.measured
    assert other.source.startswith("default path: shape (2560, 9728) not measured") and "(1024, 3072)" in other.source
    anywhere = lookup("block.split_qk_tokens", HOPPER, (4, 4))  # a value not tied to shapes: measured for all
    assert anywhere.measured


# the choices the launch functions make at Qwen3-0.6B's and 1.7B's shapes, as before the table
MM_HOPPER = {(40, 4096, 1024): (64, 32, 128, 4, 6), (128, 4096, 1024): (64, 32, 128, 4, 4),
             (40, 1024, 2048): (64, 16, 128, 4, 6), (128, 1024, 3072): (64, 16, 128, 4, 6),
             (40, 6144, 1024): (64, 64, 128, 4, 6), (40, 151936, 1024): (64, 128, 128, 4, 4),
             (128, 12288, 2048): (64, 64, 128, 4, 3), (128, 2048, 6144): (64, 16, 128, 4, 4),
             (129, 1024, 2048): (128, 128, 64, 8, 3), (8192, 151936, 2048): (128, 128, 64, 8, 3)}


def test_launch_choices_on_hopper_and_elsewhere():
    for (M, N, K), config in MM_HOPPER.items():
        assert matmul_invariant._mm_config(M, N, K, 132, chip=HOPPER) == config, (M, N, K)
        assert matmul_invariant._mm_config(M, N, K, 132, chip=DEFAULT) == (64, 128, 64, 4, 3), (M, N, K)
    parts = {(M, N): decode_gemm.parts_for(M, N, 132, chip=HOPPER) for N in (1024, 2048) for M in (40, 65, 128, 192)}
    assert parts == {(40, 1024): 2, (65, 1024): 4, (128, 1024): 4, (192, 1024): 2,
                     (40, 2048): 2, (65, 2048): 2, (128, 2048): 2, (192, 2048): 1}
    assert [decode_gemm.block_n(N, 132, chip=HOPPER) for N in (1024, 2048, 4096, 8192)] == [16, 32, 64, 0]
    splits = [attention_triton.decode_splits(rows, 8, 132, chip=HOPPER) for rows in (1, 16, 32, 33, 40)]
    assert splits == [16, 16, 8, 1, 1]
    assert rmsnorm_invariant._backward_launch(9216, 512, 132, chip=HOPPER) == (264, 4, 8)
    assert rmsnorm_invariant._backward_launch(0, 64, 132, chip=HOPPER) == (0, 32, 8)


def test_overridden_sets_values_for_a_sweep_and_restores_them():
    with overridden({"decode_gemm.mid_rows_max": 0, "sampler.chunk": 4096}):
        assert tuned("decode_gemm.mid_rows_max", HOPPER) == 0 and tuned("sampler.chunk", DEFAULT) == 4096
        assert decode_gemm.parts_for(128, 1024, 132, chip=HOPPER) == 4  # other values as they are
    assert tuned("decode_gemm.mid_rows_max", HOPPER) == 192 and tuned("sampler.chunk", DEFAULT) == 8192
    with pytest.raises(KeyError, match="unknown tunables: sampler.chunks"):
        with overridden({"sampler.chunks": 1}):
            pass
    with pytest.raises(KeyError, match="no tunable 'decode_gemm.mid_rows' for chip 'hopper'"):
        tuned("decode_gemm.mid_rows", HOPPER)


def test_the_kernels_read_every_value_from_the_table():
    """Each entry is read by the kernel file its name starts with, and no kernel launch in ops/ passes a literal
    warps or stages count (a value outside the table)."""
    ops = Path(tunables.__file__).parent
    files = {"matmul": "matmul_invariant", "matmul_split": "matmul_invariant_split", "attention": "attention/kernel",
             "block": "block_kernels", "logprob": "logprob_invariant", "rmsnorm": "rmsnorm_invariant",
             "sampler": "sample_kernels"}
    for name in PINNED:
        family = name.split(".")[0]
        text = (ops / f"{files.get(family, family)}.py").read_text()
        assert f'"{name}"' in text, f"{name} is not read by ops/{files.get(family, family)}.py"
    for path in ops.rglob("*.py"):
        if path.name != "tunables.py":
            assert not re.search(r"num_(warps|stages)=\d", path.read_text()), path.name
