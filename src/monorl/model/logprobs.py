"""Log-probabilities of chosen tokens: the one function the generator and the trainer share. Both call it
through the model (`Qwen3ForCausalLM.token_logprobs`), so a batch-invariant model
(`monorl.model.batch_invariant`) gives both its invariant form.

Log-probs are of the temperature-scaled distribution, `log_softmax(logits / temperature)`, i.e. the
distribution the generator actually sampled from (before top-p / top-k truncation). The trainer
passes the same temperature, so the importance ratio compares like with like.
"""

from __future__ import annotations

import torch
from torch import Tensor

from monorl.ops.entropy import token_entropy

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
    whole input at once. hidden [N, D], tokens [N] -> [N] fp32. Differentiable (each chunk is
    recomputed in backward through checkpointing, so peak memory stays one chunk)."""
    return _chunked(model, hidden, tokens, temperature, chunk_size, entropy=False)[0]


def chunked_token_logprobs_entropy(model: torch.nn.Module, hidden: Tensor, tokens: Tensor, temperature: float = 1.0,
                                   chunk_size: int = 1024) -> tuple[Tensor, Tensor]:
    """`chunked_token_logprobs` and, from the same chunk of logits, each row's entropy (`token_entropy`, [N]
    fp32, detached): the entropy metric costs no second LM-head matmul."""
    lp, ent = _chunked(model, hidden, tokens, temperature, chunk_size, entropy=True)
    assert ent is not None
    return lp, ent


def _chunked(model: torch.nn.Module, hidden: Tensor, tokens: Tensor, temperature: float, chunk_size: int,
             entropy: bool) -> tuple[Tensor, Tensor | None]:
    from torch.utils.checkpoint import checkpoint

    def chunk_fn(h: Tensor, t: Tensor, slot: list[Tensor] | None) -> Tensor:
        logits = model.compute_logits(h)
        if slot is not None and not slot:
            # filled on the forward call only: checkpoint's recompute in backward finds it full and skips the
            # (gradient-free) entropy, so it saves no tensors and costs nothing there
            slot.append(token_entropy(logits, temperature))
        return model.token_logprobs(logits, t, temperature)

    outs, ents = [], []
    for s in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[s:s + chunk_size], tokens[s:s + chunk_size]
        slot: list[Tensor] | None = [] if entropy else None
        if torch.is_grad_enabled() and h.requires_grad:
            # no RNG inside: skipping its save/restore keeps this capturable in a CUDA graph
            outs.append(checkpoint(chunk_fn, h, t, slot, use_reentrant=False, preserve_rng_state=False))
        else:
            outs.append(chunk_fn(h, t, slot))
        if slot is not None:
            ents.append(slot[0])
    empty = hidden.new_zeros(0, dtype=torch.float32)
    lp = torch.cat(outs) if outs else empty
    return lp, (torch.cat(ents) if ents else empty) if entropy else None
