"""`monorl.ops.sequence_of_rows`: the sequence of each packed row, searched over the whole cu_seqlens (Inductor on
CUDA could not lower the search over `cu_seqlens[1:]`, a slice view), equal to that search on every pack: empty
sequences, rows past the last end."""

from __future__ import annotations

import pytest
import torch

from monorl.ops import sequence_of_rows


@pytest.mark.parametrize("lengths", [[5], [3, 0, 4], [0, 0, 2, 7, 0], [1, 1, 1]])
def test_sequence_of_rows_equals_the_search_over_the_ends(lengths):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    rows = torch.arange(int(cu[-1]) + 3)  # and three past the last end
    want = torch.searchsorted(cu[1:], rows, right=True)
    assert torch.equal(sequence_of_rows(cu, rows), want)
    # each real row lies in a sequence that holds it
    seq = sequence_of_rows(cu, rows[: int(cu[-1])])
    assert bool(((cu[seq] <= rows[: int(cu[-1])]) & (rows[: int(cu[-1])] < cu[seq + 1])).all())
