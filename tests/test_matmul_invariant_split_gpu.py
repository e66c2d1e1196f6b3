"""The batch-invariant GEMM's K parts on CUDA, bf16 (issue #62; the interpreter's fp32 checks are
tests/test_matmul_invariant_split.py): at Qwen3-0.6B's shapes (hidden 1024, intermediate 3072, q/k/v 2048/1024/1024,
vocabulary 151936) the program-per-tile kernel, in the tiling each row count gets, equals the program-per-part
partials and their sum, bitwise; fused weights split as their pieces; the SiLU epilogue follows the parts; and with
parts switched on for every layer product the generator's log-probs still equal the trainer's bitwise
(tests/test_batch_invariant_gpu.py's `_mismatch`, the check `test_eager_bitwise` runs with the table's defaults)."""

from __future__ import annotations

import pytest
import torch

from monorl.ops import decode_gemm, matmul_invariant, matmul_invariant_split
from monorl.ops.tunables import overridden

pytestmark = pytest.mark.gpu

HIDDEN, INTER, VOCAB = 1024, 3072, 151936
SHAPES = {"qkv fused": (4096, HIDDEN), "q": (2048, HIDDEN), "k/v": (1024, HIDDEN), "o": (HIDDEN, 2048),
          "gate_up fused": (2 * INTER, HIDDEN), "gate/up": (INTER, HIDDEN), "down": (HIDDEN, INTER),
          "lm head": (VOCAB, HIDDEN)}  # (N, K)
ALL_PARTS = ((1024, 2), (2048, 4), (3072, 4))  # (K, parts): every Qwen3-0.6B product split


def _data(N: int, K: int, M: int = 600, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    return x, (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("parts", [2, 4, 8])
def test_partials_equal_the_tile_walk_bitwise(name: str, parts: int) -> None:
    N, K = SHAPES[name]
    x, w = _data(N, K)
    packed = matmul_invariant._mm_triton(x, w, parts=parts)  # 600 rows: the pack tiling, as the trainer's
    for M in (1, 7, 40, 64):
        walked = matmul_invariant._mm_triton(x[:M], w, parts=parts)  # the decode tiling
        summed = decode_gemm.sum_parts(matmul_invariant_split.partials(x[:M], w, parts=parts), x.dtype)
        assert torch.equal(walked, packed[:M]), (name, parts, M)
        assert torch.equal(summed, packed[:M]), (name, parts, M)
    torch.testing.assert_close(packed.float(), x.float() @ w.float().t(), atol=2e-2, rtol=2e-2)


def test_fused_weights_split_as_their_pieces_and_rows_stay_invariant() -> None:
    """`bi_mm` with the table's parts on (whichever kernel it picks per M): [q | k | v]'s columns are q's, k's, v's;
    a 40-row decode product's rows are a 600-row pack's."""
    x, w = _data(4096, HIDDEN)
    with overridden({"matmul_split.parts": ALL_PARTS}), torch.no_grad():
        for M in (1, 40, 600):
            fused = matmul_invariant.bi_mm(x[:M], w)
            pieces = [matmul_invariant.bi_mm(x[:M], p.contiguous()) for p in w.split([2048, 1024, 1024])]
            assert torch.equal(fused, torch.cat(pieces, dim=1)), M
        assert torch.equal(matmul_invariant.bi_mm(x[:40], w), matmul_invariant.bi_mm(x, w)[:40])


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_silu_epilogue_follows_the_parts(parts: int) -> None:
    from monorl.ops.block_kernels import silu_mul

    x, w = _data(2 * INTER, HIDDEN, M=64)
    with overridden({"matmul_split.parts": ((HIDDEN, parts),)}), torch.no_grad():
        for M in (1, 7, 40, 64):
            gate, up = matmul_invariant.linear(x[:M], w).split([INTER, INTER], dim=-1)
            assert torch.equal(matmul_invariant.mm_silu_mul(x[:M], w), silu_mul(gate, up)), M


def test_generator_equals_trainer_with_parts_on(monkeypatch) -> None:
    """The RL loop's check, every layer product in parts: the generator's decode steps write them out (o/down summed
    by the next add + norm, the others by `sum_parts`), the trainer's packs walk them; log-probs equal bitwise."""
    from tests.test_batch_invariant_gpu import _mismatch

    calls = []
    real = matmul_invariant_split.partials
    monkeypatch.setattr(matmul_invariant_split, "partials", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(matmul_invariant, "partials", matmul_invariant_split.partials)
    with overridden({"matmul_split.parts": ALL_PARTS}):
        bad, total, worst = _mismatch(None, 64, budgets=(2048, 16384))
    assert calls, "no decode product ran as partials: the test checked only the tile walk"
    assert bad == 0, f"{bad}/{total} log-probs differ, max |diff| {worst:.3g}"
