"""Sampling parameters and the sampler that runs inside the decode step (and its CUDA graph).

Randomness is counter-based: the Gumbel noise for token `v` of a sample is a hash of
(seed, prompt index, sample index, position of the generated token, v). So a sample's tokens depend
only on those numbers -- not on which slot it ran in, what else was in the batch, eager vs CUDA graph,
or how many sequences fit at once -- and there is no RNG state to register with a graph.

Sampling is Gumbel-max over the temperature-scaled logits restricted to the top-k / top-p set, which
draws exactly from softmax(logits / T) renormalised over that set. The set is found per row from the
logits sorted in descending order (`torch.topk` for top-k, a full-vocabulary `torch.sort` for top-p
alone; plain temperature sampling and greedy sort nothing), and the nucleus is computed in integer fixed
point, so its cumulative sums are exact and independent of reduction order (see `_nucleus_threshold`).
Everything is a fixed-shape tensor program without host syncs, so it runs inside the CUDA graph, and a
row's token depends only on that row's logits, key and position, never on the rest of the batch. The
returned log-prob is of the temperature-scaled distribution *before* truncation
(`monorl.model.logprobs.token_logprobs`, the trainer's function), with temperature 1.0 for greedy
decoding.

On CUDA, greedy, temperature and top-p sampling run as three Triton kernels (`monorl.ops.sample_kernels`) that
compute the same tokens (a batch-invariant model's log-probs then come from its own kernel); top-k and other devices
use the code below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from monorl.model.logprobs import token_logprobs
from monorl.ops import HAS_TRITON, sample_kernels

_default_token_logprobs = token_logprobs  # the trainer's; a batch-invariant model brings its own
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
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):  # nan passes `< 0` checks
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
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
    return -torch.log(-torch.log(uniform_from_hash(x)))


def uniform_from_hash(x: Tensor) -> Tensor:
    """A 32-bit hash (int64 values < 2**32) as a uniform in (0, 1), fp32: an odd multiple of 2**-24 from its top 23
    bits. Each is exactly an fp32 value, so none is 0 or 1 and every Gumbel noise is finite (at most 16.6). The
    former (top 24 bits + 0.5) / 2**24 rounded its largest value to 1.0 in fp32: an infinite noise, so a uniformly
    random token won in V / 2**24 of the rows (1.6% at Gemma 3's 262,144 tokens, 0.9% at Qwen3's), and RL
    trained on that junk. `sample_kernels` computes the same values."""
    return ((x >> 9) * 2 + 1).to(torch.float32) * (1.0 / (1 << 24))


_SCAN_BLOCK = 1024


def _count_prefix_below(q: Tensor, limit: Tensor) -> Tensor:
    """Per row, how many positions i have sum(q[:, :i]) < limit; q [B, n] int64 >= 0, limit [B, 1] >= 1.
    Since the prefix sums never decrease, those positions are a prefix (>= 1 long).

    A blocked scan: block masses, a scan over the blocks, then a scan inside the one block where the
    limit is crossed. Integer sums are exact, so this equals the plain cumsum; but no scan is longer than
    max(_SCAN_BLOCK, n / _SCAN_BLOCK), which keeps torch.compile on its plain (unsplit) scan kernels --
    its split scan of a long int64 row fails to compile with a dynamic batch (torch 2.11)."""
    B, n = q.shape
    if n <= _SCAN_BLOCK:
        return ((torch.cumsum(q, dim=-1) - q) < limit).sum(dim=-1, keepdim=True)
    L = _SCAN_BLOCK
    nb = -(-n // L)
    if nb * L != n:
        q = torch.nn.functional.pad(q, (0, nb * L - n))  # zero mass: never counted (total >= limit)
    blocks = q.view(B, nb, L)
    mass = blocks.sum(dim=-1)  # [B, nb]
    start = torch.cumsum(mass, dim=-1) - mass  # mass before each block
    b = (start < limit).sum(dim=-1, keepdim=True) - 1  # [B, 1] the block where the limit is crossed (>= 0)
    blk = blocks.gather(1, b[:, :, None].expand(B, 1, L))[:, 0]  # [B, L]
    before = start.gather(1, b) + torch.cumsum(blk, dim=-1) - blk
    return b * L + (before < limit).sum(dim=-1, keepdim=True)


def _nucleus_threshold(srt: Tensor, top_p: float) -> Tensor:
    """Smallest logit of the top-p nucleus [B, 1], from logits `srt` [B, n] sorted descending per row.

    A token is in the nucleus iff the probability mass of the tokens with a strictly larger logit is
    < top_p (HF's TopPLogitsWarper rule; the most likely token is always in). Tokens tied with the
    boundary token are all kept (HF keeps an arbitrary subset of them, by its sort order), so the kept set
    is a function of the logit values alone.

    The masses are integers: q = floor(exp(logit - max) * 2**K), with K chosen from the (static) n so the
    row total stays below 2**62. Integer sums are exact, so the nucleus does not depend on the reduction
    order a backend picks for a batch shape (a float cumsum's result may), so sampling stays batch-invariant.
    The truncation error is < 2**-K per token, i.e. < n * 2**-K of the row's total mass (< 2**-26 for
    n < 2**18), below fp32 softmax rounding."""
    n = int(srt.shape[-1])  # static per vocabulary (specialised under torch.compile)
    scale = float(2 ** (62 - n.bit_length()))  # n * scale < 2**62: no int64 overflow
    q = (torch.exp(srt - srt[:, :1]) * scale).to(torch.int64)  # in [0, scale], exp(0) * scale exactly
    # before < top_p * total  <=>  before < ceil(top_p * total), for an integer `before`
    limit = torch.ceil(q.sum(dim=-1, keepdim=True).to(torch.float64) * top_p).to(torch.int64)  # >= 1
    n_keep = _count_prefix_below(q, limit)  # >= 1, <= n
    return srt.gather(-1, n_keep - 1)


def sample(logits: Tensor, keys: Tensor, positions: Tensor, params: SamplingParams,
           token_logprobs=token_logprobs, kernels: bool = True) -> tuple[Tensor, Tensor]:
    """logits [B, V] -> (tokens int64 [B], log-probs fp32 [B]). `keys` [B] int64 (see `sequence_key`),
    `positions` [B] int64: the position the sampled token will have. No host sync. Top-k then top-p
    (HF's order: the nucleus is taken of the distribution renormalised over the top-k).
    kernels: on CUDA, the Triton sampler where it applies (module docstring); False: always the PyTorch ops."""
    V = logits.shape[-1]
    if kernels and HAS_TRITON and logits.is_cuda and not 0 < params.top_k < V:
        tokens, logprobs = sample_kernels.sample(logits, keys, positions, params.temperature, params.top_p)
        if token_logprobs is not _default_token_logprobs:  # a batch-invariant model's: its own kernel
            logprobs = token_logprobs(logits, tokens, params.logprob_temperature)
        return tokens, logprobs
    if params.greedy:
        tokens = torch.argmax(logits, dim=-1)
    else:
        scaled = logits.float() / params.temperature
        noise = gumbel_noise(keys, positions, V)
        if 0 < params.top_k < V:
            srt = torch.topk(scaled, params.top_k, dim=-1).values  # sorted, descending
        elif params.top_p < 1.0:
            # x -> float(x) / T is monotone, so scaling the sorted logits gives exactly the sorted `scaled`;
            # sorting in the logits' own dtype (bf16 from the model: half the radix passes) is faster.
            srt = torch.sort(logits, dim=-1, descending=True).values.float() / params.temperature
        else:
            srt = None
        if srt is None:
            tokens = torch.argmax(scaled + noise, dim=-1)
        else:
            thresh = srt[:, -1:] if params.top_p >= 1.0 else _nucleus_threshold(srt, params.top_p)
            tokens = torch.argmax((scaled + noise).masked_fill(scaled < thresh, float("-inf")), dim=-1)
    return tokens, token_logprobs(logits, tokens, params.logprob_temperature)
