"""Log-probabilities of chosen tokens: the one function the generator and the trainer share. Both call it
through the model (`DecoderForCausalLM.token_logprobs`), so a batch-invariant model
(`monorl.model.batch_invariant`) gives both its invariant form.

Log-probs are of the temperature-scaled distribution, `log_softmax(logits / temperature)`, i.e. the
distribution the generator actually sampled from (before top-p / top-k truncation). The trainer
passes the same temperature, so the importance ratio compares like with like.
"""

from __future__ import annotations

import torch
from torch import Tensor

from monorl.ops.entropy import token_entropy
from monorl.ops.matmul_invariant import mm_fp32

__all__ = ["chunked_token_logprobs", "chunked_token_logprobs_entropy", "token_entropy", "token_logprobs"]


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """logits [N, V] (any dtype), tokens [N] -> fp32 log p(token) [N]."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None].long()).squeeze(-1)


def chunked_token_logprobs(model: torch.nn.Module, hidden: Tensor, tokens: Tensor, temperature: float = 1.0,
                           chunk_size: int = 1024) -> Tensor:
    """LM head + log-softmax in chunks of rows, so fp32 [rows, vocab] logits never exist for the
    whole input at once. hidden [N, D], tokens [N] -> [N] fp32. Differentiable (`_ChunkedHead`: each chunk's
    logits are recomputed in backward, so peak memory stays one chunk)."""
    return _chunked(model, hidden, tokens, temperature, chunk_size, entropy=False)[0]


def chunked_token_logprobs_entropy(model: torch.nn.Module, hidden: Tensor, tokens: Tensor, temperature: float = 1.0,
                                   chunk_size: int = 1024) -> tuple[Tensor, Tensor]:
    """`chunked_token_logprobs` and, from the same chunk of logits, each row's entropy (`token_entropy`, [N]
    fp32, detached): the entropy metric costs no second LM-head matmul."""
    lp, ent = _chunked(model, hidden, tokens, temperature, chunk_size, entropy=True)
    assert ent is not None
    return lp, ent


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    """The LM head's matmul dtype: autocast's when it is on (the trainer's bf16 on CUDA), else the input's."""
    dev = hidden.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype


def _chunked(model: torch.nn.Module, hidden: Tensor, tokens: Tensor, temperature: float, chunk_size: int,
             entropy: bool) -> tuple[Tensor, Tensor | None]:
    weight = model.lm_head_weight
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        lp, ent = _ChunkedHead.apply(hidden, weight, tokens, model, float(temperature), chunk_size, entropy)
        return lp, ent if entropy else None
    return _forward_chunks(model, hidden, weight.to(_compute_dtype(hidden)), tokens, temperature, chunk_size, entropy)


def _forward_chunks(model: torch.nn.Module, hidden: Tensor, weight: Tensor, tokens: Tensor, temperature: float,
                    chunk_size: int, entropy: bool) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) chunk by chunk, `weight` already in the compute dtype."""
    lps, ents = [], []
    for s in range(0, hidden.shape[0], chunk_size):
        logits = model.compute_logits(hidden[s:s + chunk_size].to(weight.dtype), weight)
        lps.append(model.token_logprobs(logits, tokens[s:s + chunk_size], temperature))
        if entropy:
            ents.append(token_entropy(logits, temperature))
    empty = hidden.new_zeros(0, dtype=torch.float32)
    lp = torch.cat(lps) if lps else empty
    return lp, (torch.cat(ents) if ents else empty) if entropy else None


class _ChunkedHead(torch.autograd.Function):
    """LM head + token log-probs over chunks of rows, differentiable. Why not autograd over each chunk
    (checkpointed, as before): the fp32 master weight was cast to bf16 for every chunk and again in every chunk's
    recompute, and each chunk's bf16 weight gradient cast to fp32 and added into .grad -- for Qwen3-0.6B's 155M-entry
    head and 4 chunks, ~20 GB of memory traffic a step. Here the weight is cast once each way, and the chunks'
    gradients add up in one fp32 buffer inside the GEMMs (`matmul_invariant.mm_fp32`), so also without a bf16
    rounding per chunk.
    Forward values are the model's own `compute_logits` / `token_logprobs` (the batch-invariant ones in that mode),
    and the hidden states' gradient is the same product as autograd's."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, tokens: Tensor, model: torch.nn.Module, temperature: float,
                chunk_size: int, entropy: bool) -> tuple[Tensor, Tensor]:
        w = weight.to(_compute_dtype(hidden))
        lp, ent = _forward_chunks(model, hidden, w, tokens, temperature, chunk_size, entropy)
        ent = ent if ent is not None else lp.new_zeros(0)
        ctx.mark_non_differentiable(ent)
        ctx.save_for_backward(hidden, weight, tokens, lp)
        ctx.model, ctx.temperature, ctx.chunk_size, ctx.compute_dtype = model, temperature, chunk_size, w.dtype
        return lp, ent

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_entropy: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, tokens, lp = ctx.saved_tensors
        model, chunk = ctx.model, ctx.chunk_size
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        w = weight.to(ctx.compute_dtype)  # cast again rather than held from forward (vocab x hidden bf16)
        d_hidden = torch.empty_like(hidden) if need_hidden else None
        d_weight: Tensor | None = None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk].to(w.dtype)
            logits = model.compute_logits(h, w).detach().requires_grad_()
            # the gradient of sum(out * g) is exactly autograd.grad(out, logits, g) (g times 1.0), but takes no
            # grad_outputs: torch checks those with symbolic_shapes, whose first import (sympy) costs ~0.5 s
            with torch.enable_grad():
                out = (model.token_logprobs(logits, tokens[s:s + chunk], ctx.temperature) * grad[s:s + chunk]).sum()
            (d_logits,) = torch.autograd.grad(out, logits)
            if d_hidden is not None:
                d_hidden[s:s + chunk] = d_logits @ w
            if need_weight:
                d_weight = mm_fp32(d_weight, d_logits.t(), h)
        if need_weight and d_weight is None:  # no rows
            d_weight = torch.zeros_like(weight)
        return d_hidden, None if d_weight is None else d_weight.to(weight.dtype), None, None, None, None, None
