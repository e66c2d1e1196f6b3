"""The decode step's bookkeeping (`monorl.ops.decode_state`): the Triton launches equal the ATen ops they replace,
bitwise, and the RoPE rows gathered from the tables equal `rope_cos_sin` of the positions."""

from __future__ import annotations

import pytest
import torch

from monorl.model.rope import rope_cos_sin
from monorl.ops import decode_state


def _state(device: str, B: int, W: int, bs: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tables = torch.randint(0, 1000, (B, W), generator=g, dtype=torch.int32)
    pos = torch.randint(0, W * bs, (B,), generator=g)
    pos[-1] = W * bs + 37  # a padded row run past its table: clamped to the last block
    return pos.to(device), tables.to(device)


def test_step_inputs_cpu_slots_and_lengths() -> None:
    pos, tables = _state("cpu", 6, 4, 16)
    slots, lens, nxt, rope = decode_state.step_inputs(pos.clone(), tables, 16, None)
    for b in range(6):
        p = int(pos[b])
        assert int(slots[b]) == int(tables[b, min(p // 16, 3)]) * 16 + p % 16
    assert torch.equal(lens, (pos + 1).int()) and lens.dtype == torch.int32
    assert torch.equal(nxt, pos + 1) and rope is None


def test_commit_step_cpu_rings_and_overflow() -> None:
    ring_tok, ring_lp = torch.zeros(4, 8, dtype=torch.int64), torch.zeros(4, 8)
    ring_idx, tok, pos = torch.zeros(1, dtype=torch.int64), torch.zeros(8, dtype=torch.int64), torch.arange(8)
    for step in range(5):  # ring of 3 rows + the overflow row: the index stops at 3
        decode_state.commit_step(torch.full((5,), step), torch.full((5,), -float(step)), ring_tok, ring_lp, ring_idx,
                                 tok, pos)
    assert int(ring_idx) == 3
    assert ring_tok[:3, :5].tolist() == [[0] * 5, [1] * 5, [2] * 5] and ring_tok[3, :5].tolist() == [4] * 5
    assert ring_lp[3, 0] == -4.0 and ring_tok[:, 5:].eq(0).all()
    assert tok[:5].tolist() == [4] * 5 and pos.tolist() == [5, 6, 7, 8, 9, 5, 6, 7]


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 40, 129])
def test_decode_state_kernels_equal_aten(B: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA")
    pos, tables = _state("cuda", B, 32, 16, seed=B)
    tables_cols = tables[:, :20]  # a width cut from a wider table (strided rows)
    positions = 32 * 16
    rope_tables = rope_cos_sin(torch.arange(positions, device="cuda"), 128, 1e6, torch.bfloat16)
    got = decode_state.step_inputs(pos, tables_cols, 16, rope_tables)
    want = decode_state.step_inputs(pos.cpu(), tables_cols.cpu(), 16, None)
    for a, b in zip(got[:3], want[:3], strict=True):
        assert torch.equal(a.cpu(), b) and a.dtype == b.dtype
    clamped = pos.clamp(max=positions - 1)
    cos, sin = rope_cos_sin(clamped, 128, 1e6, torch.bfloat16)
    assert torch.equal(got[3][0], cos) and torch.equal(got[3][1], sin)

    S = max(B, 64)
    g = torch.Generator(device="cuda").manual_seed(B)
    toks = torch.randint(0, 151936, (B,), device="cuda", generator=g)
    lps = -torch.rand(B, device="cuda", generator=g)
    states = []
    for cuda in (True, False):
        dev = "cuda" if cuda else "cpu"
        ring_tok, ring_lp = torch.zeros(5, S, dtype=torch.int64, device=dev), torch.zeros(5, S, device=dev)
        ring_idx = torch.full((1,), 3, dtype=torch.int64, device=dev)
        tok, p = torch.zeros(S, dtype=torch.int64, device=dev), torch.arange(S, device=dev)
        for _ in range(3):  # index 3, then the overflow row 4 twice
            decode_state.commit_step(toks.to(dev), lps.to(dev), ring_tok, ring_lp, ring_idx, tok, p)
        states.append([t.cpu() for t in (ring_tok, ring_lp, ring_idx, tok, p)])
    for a, b in zip(*states, strict=True):
        assert torch.equal(a, b)
