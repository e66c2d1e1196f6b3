"""The trainer's chunked LM head (`monorl.model.logprobs._ChunkedHead`: the weight cast once, the chunks' weight
gradients summed in fp32) against autograd through the unchunked head."""

import pytest
import torch

from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.logprobs import chunked_token_logprobs, chunked_token_logprobs_entropy


def _inputs(model, n: int = 11, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, model.config.hidden_size, generator=g).to(dtype).requires_grad_()
    tokens = torch.randint(0, model.config.vocab_size, (n,), generator=g)
    grad = torch.randn(n, generator=g)
    return hidden, tokens, grad


def _reference(hidden, weight, tokens, grad, temperature):
    """Autograd through the whole head at once, in fp32: log-probs and the gradients of hidden and weight."""
    h = hidden.detach().float().requires_grad_()
    w = weight.detach().float().requires_grad_()
    lp = torch.log_softmax((h @ w.t()) / temperature, -1).gather(-1, tokens[:, None])[:, 0]
    dh, dw = torch.autograd.grad(lp, (h, w), grad)
    return lp.detach(), dh, dw


@pytest.mark.parametrize("chunk", [3, 4, 1024])
def test_chunked_head_matches_autograd_over_the_whole_head(chunk):
    model = build_model(model_shape("tiny"), "cpu", torch.float32, seed=0)
    weight = model.lm_head_weight
    hidden, tokens, grad = _inputs(model)
    lp, ent = chunked_token_logprobs_entropy(model, hidden, tokens, temperature=0.7, chunk_size=chunk)
    (lp * grad).sum().backward()
    ref_lp, ref_dh, ref_dw = _reference(hidden, weight, tokens, grad, 0.7)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(hidden.grad, ref_dh)
    torch.testing.assert_close(weight.grad, ref_dw)
    assert not ent.requires_grad and ent.shape == (11,)
    with torch.no_grad():  # the path without autograd gives the same values
        torch.testing.assert_close(chunked_token_logprobs(model, hidden, tokens, 0.7, chunk), lp, rtol=0, atol=0)


def test_chunked_head_in_bf16_sums_the_weight_gradient_in_fp32():
    """The trainer's CUDA setting on CPU: an fp32 master weight, bf16 hidden states under bf16 autocast. The weight
    gradient is fp32, of the bf16-rounded weight's product, and no worse than one bf16 rounding of the whole sum
    off the fp32 reference (each chunk's product rounded to bf16 and then added was the path before)."""
    model = build_model(model_shape("tiny"), "cpu", torch.float32, seed=0)
    weight = model.lm_head_weight
    hidden, tokens, grad = _inputs(model, n=40, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = chunked_token_logprobs(model, hidden, tokens, temperature=1.0, chunk_size=8)
    (lp * grad).sum().backward()
    assert weight.grad.dtype == torch.float32 and hidden.grad.dtype == torch.bfloat16
    ref_lp, ref_dh, ref_dw = _reference(hidden, weight.bfloat16(), tokens, grad, 1.0)
    torch.testing.assert_close(lp, ref_lp, rtol=2e-2, atol=2e-2)  # bf16 logits
    torch.testing.assert_close(hidden.grad.float(), ref_dh, rtol=2e-2, atol=2e-2)
    scale = ref_dw.abs().max()
    assert (weight.grad - ref_dw).abs().max() <= 2e-2 * scale


def test_chunked_head_of_the_batch_invariant_model_keeps_its_values():
    """In batch-invariant mode the chunked head's log-probs are the model's invariant ones, row for row whatever the
    chunking (generator log-probs equal the trainer's), and its hidden gradient is autograd's through those ops."""
    model = make_batch_invariant_(build_model(model_shape("tiny"), "cpu", torch.float32, seed=0))
    weight = model.lm_head_weight
    hidden, tokens, grad = _inputs(model, n=9)
    lp = chunked_token_logprobs(model, hidden, tokens, temperature=0.8, chunk_size=4)
    (lp * grad).sum().backward()
    dh, dw = hidden.grad.clone(), weight.grad.clone()
    rows = [model.token_logprobs(model.compute_logits(hidden[i:i + 1]), tokens[i:i + 1], 0.8) for i in range(9)]
    torch.testing.assert_close(lp, torch.cat(rows).detach(), rtol=0, atol=0)  # invariant: one row at a time
    hidden.grad = weight.grad = None
    for s in range(0, 9, 4):  # autograd through the invariant ops, chunk by chunk (the path before)
        out = model.token_logprobs(model.compute_logits(hidden[s:s + 4]), tokens[s:s + 4], 0.8)
        (out * grad[s:s + 4]).sum().backward()
    torch.testing.assert_close(dh, hidden.grad, rtol=0, atol=0)
    torch.testing.assert_close(dw, weight.grad)


def test_chunked_head_with_a_frozen_weight_and_no_rows():
    model = build_model(model_shape("tiny"), "cpu", torch.float32, seed=0)
    weight = model.lm_head_weight
    weight.requires_grad_(False)  # a LoRA run's frozen base
    hidden, tokens, grad = _inputs(model, n=5)
    lp = chunked_token_logprobs(model, hidden, tokens, chunk_size=2)
    (lp * grad).sum().backward()
    assert weight.grad is None
    torch.testing.assert_close(hidden.grad, _reference(hidden, weight, tokens, grad, 1.0)[1])
    weight.requires_grad_(True)
    empty = torch.zeros(0, model.config.hidden_size, requires_grad=True)
    lp = chunked_token_logprobs(model, empty, tokens[:0])
    assert lp.shape == (0,)
    lp.sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))


@pytest.mark.gpu
@pytest.mark.parametrize("invariant", [False, True])
def test_chunked_head_on_cuda(invariant):
    """On CUDA (bf16 autocast, fp32 master): the weight gradient comes from GEMMs with an fp32 output adding into one
    buffer (`torch.mm` / `torch.addmm` with out_dtype); it matches the fp32 reference on the bf16-rounded operands,
    and the log-probs are those of the unchunked head (bitwise in the batch-invariant mode)."""
    model = build_model(model_shape("tiny"), "cuda", torch.float32, seed=0)
    if invariant:
        make_batch_invariant_(model)
    weight = model.lm_head_weight
    hidden, tokens, grad = (t.cuda() for t in _inputs(model, n=300, dtype=torch.bfloat16))
    hidden = hidden.detach().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp = chunked_token_logprobs(model, hidden, tokens, temperature=0.9, chunk_size=64)
        whole = model.token_logprobs(model.compute_logits(hidden.detach()), tokens, 0.9)
    (lp * grad).sum().backward()
    if invariant:
        assert torch.equal(lp.detach(), whole)
    assert weight.grad.dtype == torch.float32
    ref_lp, ref_dh, ref_dw = _reference(hidden, weight.bfloat16(), tokens, grad, 0.9)
    torch.testing.assert_close(lp, ref_lp, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(hidden.grad.float(), ref_dh, rtol=2e-2, atol=2e-2)
    assert (weight.grad - ref_dw).abs().max() <= 1e-2 * ref_dw.abs().max()
