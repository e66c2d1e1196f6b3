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
    from torch.utils.checkpoint import checkpoint

    def chunk_fn(h: Tensor, t: Tensor) -> Tensor:
        return model.token_logprobs(model.compute_logits(h), t, temperature)

    outs = []
    for s in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[s:s + chunk_size], tokens[s:s + chunk_size]
        if torch.is_grad_enabled() and h.requires_grad:
            # no RNG inside: skipping its save/restore keeps this capturable in a CUDA graph
            outs.append(checkpoint(chunk_fn, h, t, use_reentrant=False, preserve_rng_state=False))
        else:
            outs.append(chunk_fn(h, t))
    return torch.cat(outs) if outs else hidden.new_zeros(0, dtype=torch.float32)
