"""Sampling parameters and the sampler that runs inside the decode step (and its CUDA graph).

Randomness is counter-based: the Gumbel noise for token `v` of a sample is a hash of
(seed, prompt index, sample index, position of the generated token, v). So a sample's tokens depend
only on those numbers -- not on which slot it ran in, what else was in the batch, eager vs CUDA graph,
or how many sequences fit at once -- and there is no RNG state to register with a graph.

Sampling is Gumbel-max over the temperature-scaled logits restricted to the top-k / top-p set, which
draws exactly from softmax(logits / T) renormalised over that set. Nothing sorts the whole vocabulary
(top-k uses topk, top-p a few Gumbel candidates, see `_top_p_sample`), and everything is a fixed-shape
tensor program, so it runs inside the CUDA graph. The returned log-prob is of the
temperature-scaled distribution *before* truncation (`monorl.model.logprobs.token_logprobs`, the
trainer's function), with temperature 1.0 for greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from monorl.model.logprobs import token_logprobs

_M32 = 0xFFFFFFFF
# Odd multipliers below 2**31, so that (x < 2**32) * c never overflows int64 on any backend.
_C1, _C2, _C3 = 0x7FEB352D, 0x2C1B3C6D, 0x297A2D39


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0.0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()  # in addition to the generator's eos ids
    stop_strings: tuple[str, ...] = ()  # needs a tokenizer
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.stop_strings = tuple(self.stop_strings)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        return 1.0 if self.greedy else self.temperature

    def sampler_key(self) -> tuple[float, float, int]:
        """What the sampler's computation depends on (a CUDA graph is captured per key)."""
        if self.greedy:
            return (0.0, 1.0, 0)
        return (float(self.temperature), float(self.top_p), int(self.top_k))


def _mix32(x):  # Tensor -> Tensor or int -> int
    """A 32-bit integer finaliser (xorshift-multiply): int64 tensors holding values < 2**32, or ints."""
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    x = x ^ (x >> 16)
    x = (x * _C3) & _M32
    return x ^ (x >> 15)


def sequence_key(seed: int, prompt_index: int, sample_index: int) -> int:
    """Per-sample 32-bit key (host side, plain ints) for `sample`."""
    x = seed & _M32
    for v in (prompt_index, sample_index):
        x = _mix32((x ^ ((v * 0x9E3779B1) & _M32)) & _M32)
    return x


def gumbel_noise(keys: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """Standard Gumbel noise [B, V] (fp32), a pure function of (key, position, token id)."""
    row = _mix32((keys ^ ((positions * 0x61C88647) & _M32)) & _M32)  # [B]
    vocab = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    x = _mix32((row[:, None] + vocab[None, :] * 0x6A09E667) & _M32)
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1), never 0 or 1
    return -torch.log(-torch.log(u))


def _top_k_threshold(scaled: Tensor, top_p: float, top_k: int) -> Tensor:
    """Per-row smallest logit kept by top-k (then top-p within the top-k, as HF orders them) [B, 1]."""
    srt = torch.topk(scaled, top_k, dim=-1).values  # sorted, descending
    if top_p >= 1.0:
        return srt[:, -1:]
    probs = torch.softmax(srt, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of better-ranked tokens
    n_keep = (before < top_p).sum(dim=-1, keepdim=True)  # >= 1: the first always stays
    return srt.gather(-1, n_keep - 1)


def _top_p_sample(scaled: Tensor, noise: Tensor, top_p: float, candidates: int) -> Tensor:
    """Exact nucleus sampling without sorting the vocabulary. Gumbel-max restricted to a set S picks the
    first token of the perturbed order that lies in S; so take the top few of the perturbed logits and
    keep the first one inside the nucleus (token c is inside iff the mass of tokens more probable than c
    is < top_p). If none of them is (probability ~ tail_mass ** candidates), take the most probable token."""
    probs = torch.softmax(scaled, dim=-1)
    cand = torch.topk(scaled + noise, candidates, dim=-1).indices  # [B, K], perturbed order
    pc = probs.gather(-1, cand)
    above = torch.where(probs[:, None, :] > pc[:, :, None], probs[:, None, :], 0.0).sum(-1)  # [B, K]
    inside = above < top_p
    first = torch.argmax(inside.to(torch.int32), dim=-1, keepdim=True)  # first True (argmax returns the first max)
    chosen = cand.gather(-1, first)[:, 0]
    return torch.where(inside.any(dim=-1), chosen, torch.argmax(probs, dim=-1))


def sample(logits: Tensor, keys: Tensor, positions: Tensor, params: SamplingParams,
           top_p_candidates: int = 8) -> tuple[Tensor, Tensor]:
    """logits [B, V] -> (tokens int64 [B], log-probs fp32 [B]). `keys` [B] int64 (see `sequence_key`),
    `positions` [B] int64: the position the sampled token will have. No host sync, no vocabulary sort."""
    V = logits.shape[-1]
    if params.greedy:
        tokens = torch.argmax(logits, dim=-1)
    else:
        scaled = logits.float() / params.temperature
        noise = gumbel_noise(keys, positions, V)
        if 0 < params.top_k < V:
            thresh = _top_k_threshold(scaled, params.top_p, params.top_k)
            tokens = torch.argmax((scaled + noise).masked_fill(scaled < thresh, float("-inf")), dim=-1)
        elif params.top_p < 1.0:
            tokens = _top_p_sample(scaled, noise, params.top_p, min(top_p_candidates, V))
        else:
            tokens = torch.argmax(scaled + noise, dim=-1)
    return tokens, token_logprobs(logits, tokens, params.logprob_temperature)
