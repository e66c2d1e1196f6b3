"""The fast CUDA varlen backend (torch.nn.attention.varlen) against the portable SDPA backend."""

import pytest
import torch

from monorl.model import VarlenContext, build_model, model_shape
from monorl.model.attention import resolve_backend

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("heads", [(16, 8), (8, 8), (8, 1)])
def test_flash_varlen_equals_sdpa(heads):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    hq, hkv = heads
    lengths = [5, 17, 1, 64, 33]
    g = torch.Generator(device="cuda").manual_seed(0)
    T = sum(lengths)
    q = torch.randn(T, hq, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(T, hkv, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(T, hkv, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    flash = VarlenContext.from_lengths(lengths, "cuda", backend="flash").attend(q, k, v)
    sdpa = VarlenContext.from_lengths(lengths, "cuda", backend="sdpa").attend(q, k, v)
    torch.testing.assert_close(flash.float(), sdpa.float(), atol=2e-2, rtol=2e-2)


def test_model_logits_flash_vs_sdpa():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert resolve_backend("auto", torch.device("cuda"), torch.bfloat16) == "flash"
    model = build_model(model_shape("tiny"), "cuda", torch.bfloat16, seed=0)
    seqs = [list(range(3, 3 + n)) for n in (7, 30, 2)]
    a = model.logits_for(seqs, backend="flash")
    b = model.logits_for(seqs, backend="sdpa")
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.float(), y.float(), atol=3e-2, rtol=3e-2)


def test_flash_varlen_gqa_without_autograd_equals_expanded_heads():
    """Outside autograd the flash kernel takes the kv heads as they are (torch 2.11's wrapper has no GQA flag): the
    output is bitwise the one of kv heads expanded to the query heads."""
    from monorl.model.attention import flash_varlen

    lengths = [5, 17, 1, 300, 33]
    g = torch.Generator(device="cuda").manual_seed(1)
    T = sum(lengths)
    q = torch.randn(T, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(T, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(T, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    with torch.no_grad():
        gqa = flash_varlen(q, k, v, cu, max(lengths))
        expanded = flash_varlen(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), cu, max(lengths))
    assert torch.equal(gqa, expanded)
