"""The CPU building block of the batch-invariant ops: a sum in one fixed order."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def tree_sum(x: Tensor) -> Tensor:
    """Sum over the last dim by adjacent pairs, zero-padded to a power of two. Only elementwise adds, so
    a row's result does not depend on the other rows; and trailing zeros (masked keys, padding) do not
    change it: a subtree over real values is the same for any padded length, and adding +0 is exact."""
    n = x.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        x = F.pad(x, (0, p - n))
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]
