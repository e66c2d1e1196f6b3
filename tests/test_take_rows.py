"""`take_rows` (monorl.ops.row_copies): x[index] for rows named at most once, whose backward places the gradient
rows (index_add_ into zeros) instead of autograd's sort-based accumulating index_put: the same values and
gradients as x[index], a repeated row's (a padding row's) gradients still summed."""

import torch

from monorl.ops.row_copies import take_rows


def test_take_rows_equals_indexing_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 3, 4, generator=g, requires_grad=True)
    index = torch.tensor([7, 0, 3, 10, 5])
    grad = torch.randn(5, 3, 4, generator=g)
    (ours,) = torch.autograd.grad(take_rows(x, index), x, grad)
    (theirs,) = torch.autograd.grad(x[index], x, grad)
    assert torch.equal(take_rows(x, index), x[index])
    assert torch.equal(ours, theirs)
    assert torch.equal(take_rows(x.detach(), index), x.detach()[index])  # no graph: a plain gather


def test_take_rows_sums_a_repeated_row():
    x = torch.zeros(4, 2, requires_grad=True)
    grad = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 4.0]])
    (ours,) = torch.autograd.grad(take_rows(x, torch.tensor([0, 0, 2])), x, grad)
    assert torch.equal(ours, torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 4.0], [0.0, 0.0]]))
