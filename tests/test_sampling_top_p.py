"""Top-p (nucleus) sampling is exact: goodness of fit against HF's warpers, exact nucleus sets, ties,
batch invariance, a full-size vocabulary.

The reference distribution is HF transformers' TemperatureLogitsWarper / TopKLogitsWarper /
TopPLogitsWarper followed by softmax. The chi-square tests draw from fixed keys, so they are
deterministic; their significance level (1e-4) only says how far from the reference a pass may be.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from monorl.generate.sampling import (
    SamplingParams,
    _count_prefix_below,
    _nucleus_threshold,
    sample,
    sequence_key,
)

ALPHA = 1e-4


def hf_probs(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """HF's sampling distribution [B, V] (temperature, then top-k, then top-p, then softmax)."""
    scores = logits.float().clone()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1)


def chi2_critical(df: int, alpha: float = ALPHA) -> float:
    """Upper alpha quantile of chi-square(df), Wilson-Hilferty approximation (no scipy needed)."""
    z = NormalDist().inv_cdf(1.0 - alpha)
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson chi-square of `counts` against `probs` over the support of `probs`, consecutive bins (by
    decreasing probability) pooled until each expects >= min_expected draws. Returns (statistic, df)."""
    n = int(counts.sum())
    support = torch.nonzero(probs > 0).flatten()
    support = support[torch.argsort(probs[support], descending=True, stable=True)]
    obs_bins, exp_bins, o, e = [], [], 0.0, 0.0
    for t in support.tolist():
        o, e = o + float(counts[t]), e + n * float(probs[t])
        if e >= min_expected:
            obs_bins.append(o)
            exp_bins.append(e)
            o, e = 0.0, 0.0
    if e > 0:  # the remainder joins the last bin
        obs_bins[-1] += o
        exp_bins[-1] += e
    stat = sum((ob - ex) ** 2 / ex for ob, ex in zip(obs_bins, exp_bins, strict=True))
    return stat, len(obs_bins) - 1


def draw(logits_row: torch.Tensor, n: int, params: SamplingParams, seed: int) -> torch.Tensor:
    """n independent draws from one row of logits: n rows with different sequence keys and positions."""
    keys = torch.tensor([sequence_key(seed, 0, i) for i in range(n)], dtype=torch.int64)
    pos = torch.arange(n, dtype=torch.int64) % 97 + 3
    tokens, _ = sample(logits_row[None].expand(n, -1), keys, pos, params)
    return tokens


def assert_fits(tokens: torch.Tensor, ref: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=ref.numel())
    outside = counts[ref == 0]
    assert int(outside.sum()) == 0, f"{int(outside.sum())} draws outside the nucleus"
    stat, df = chi2_stat(counts, ref)
    crit = chi2_critical(df) if df > 0 else 0.0
    top = int(ref.argmax())
    assert stat <= crit, (f"chi2 {stat:.1f} > {crit:.1f} (df {df}, alpha {ALPHA}); most likely token drawn "
                          f"{float(counts[top]) / tokens.numel():.4f} vs {float(ref[top]):.4f}")


LINEAR = torch.linspace(3.0, 0.0, 1000)  # V = 1000, logits falling linearly from 3 to 0
N_DRAWS = 6000


@pytest.mark.parametrize(("top_p", "temperature"), [(0.05, 1.0), (0.1, 1.0), (0.3, 1.0), (0.9, 1.0), (0.3, 0.7)])
def test_top_p_matches_hf_nucleus_distribution(top_p: float, temperature: float):
    ref = hf_probs(LINEAR[None], temperature, top_p)[0]
    tokens = draw(LINEAR, N_DRAWS, SamplingParams(temperature=temperature, top_p=top_p), seed=int(top_p * 1000))
    assert_fits(tokens, ref)


@pytest.mark.parametrize(("top_k", "top_p", "temperature", "logits"), [
    (200, 0.3, 1.0, LINEAR),
    (100, 0.8, 0.7, torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 2),
])
def test_top_k_then_top_p_matches_hf(top_k: int, top_p: float, temperature: float, logits: torch.Tensor):
    ref = hf_probs(logits[None], temperature, top_p, top_k)[0]
    tokens = draw(logits, N_DRAWS, SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k), seed=top_k)
    assert_fits(tokens, ref)


def test_nucleus_set_equals_hf():
    """The kept set (scaled logit >= threshold) is exactly HF's, over many random rows and top_p values
    (no ties in random fp32 logits), including rows with -inf (masked) logits and the top-k + top-p path."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(64, 3000, generator=g) * torch.linspace(0.3, 6.0, 64)[:, None]  # flat to peaked
    logits[::4, ::3] = float("-inf")
    for top_p in (1e-9, 0.02, 0.1, 0.5, 0.9, 0.99, 0.999999):
        srt = torch.sort(logits, dim=-1, descending=True).values
        ours = logits >= _nucleus_threshold(srt, top_p)
        assert torch.equal(ours, hf_probs(logits, top_p=top_p) > 0), top_p
        srt_k = torch.topk(logits, 50, dim=-1).values
        ours_k = logits >= _nucleus_threshold(srt_k, top_p)
        assert torch.equal(ours_k, hf_probs(logits, top_p=top_p, top_k=50) > 0), top_p


def test_tiny_top_p_is_greedy_and_ties_are_all_kept():
    row = torch.randn(500, generator=torch.Generator().manual_seed(5))
    assert (draw(row, 200, SamplingParams(top_p=1e-9), seed=1) == row.argmax()).all()
    # Ties at the boundary are all kept: with 10 equal logits every token is in the nucleus (HF keeps
    # ceil(0.3 * 10) of them, chosen by its sort order), so sampling is uniform over all 10.
    flat = torch.cat([torch.zeros(10), torch.full((90,), -5.0)])
    tokens = draw(flat, 2000, SamplingParams(top_p=0.3), seed=2)
    assert set(tokens.tolist()) == set(range(10))
    stat, df = chi2_stat(torch.bincount(tokens, minlength=100), torch.cat([torch.full((10,), 0.1), torch.zeros(90)]))
    assert stat <= chi2_critical(df)


@pytest.mark.parametrize("params", [
    SamplingParams(top_p=0.1), SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(top_k=50, top_p=0.8),
    SamplingParams(top_k=20), SamplingParams(temperature=1.3), SamplingParams(temperature=0.0),
])
def test_sampling_is_batch_invariant(params: SamplingParams):
    """A row's token is the same alone (B=1), in a batch of 2 (either slot), and in a batch of 37."""
    g = torch.Generator().manual_seed(7)
    V = 1000
    target = torch.randn(6, V, generator=g) * 2
    others = torch.randn(36, V, generator=g) * torch.rand(36, 1, generator=g) * 5
    keys_o = torch.randint(0, 2**32, (36,), generator=g)
    pos_o = torch.randint(0, 4096, (36,), generator=g)
    for r in range(target.shape[0]):
        x, k, p = target[r:r + 1], torch.tensor([sequence_key(9, r, 0)]), torch.tensor([17 + r])
        alone = sample(x, k, p, params)[0]
        first = sample(torch.cat([x, others[:1]]), torch.cat([k, keys_o[:1]]), torch.cat([p, pos_o[:1]]), params)[0]
        second = sample(torch.cat([others[:1], x]), torch.cat([keys_o[:1], k]), torch.cat([pos_o[:1], p]), params)[0]
        at = 5 + 4 * r
        big = sample(torch.cat([others[:at], x, others[at:]]), torch.cat([keys_o[:at], k, keys_o[at:]]),
                     torch.cat([pos_o[:at], p, pos_o[at:]]), params)[0]
        assert int(alone[0]) == int(first[0]) == int(second[1]) == int(big[at]), r


def test_blocked_prefix_count_equals_plain_cumsum():
    g = torch.Generator().manual_seed(17)
    for n in (1, 7, 1024, 1025, 2048, 3 * 1024 + 5):
        q = (torch.rand(6, n, generator=g) ** 6 * 2**40).long() * (torch.rand(6, n, generator=g) > 0.3)
        q[:, 0] += 1
        total = q.sum(-1, keepdim=True)
        before = q.cumsum(-1) - q
        # limits on block boundaries, at the total, just above a prefix sum, and random
        idx = torch.randint(0, n, (6, 1), generator=g)
        for limit in (torch.ones_like(total), total, before.gather(1, idx) + 1, before.gather(1, idx),
                      before[:, min(n - 1, 1024):min(n - 1, 1024) + 1].clamp(min=1),
                      (total.double() * torch.rand(6, 1, generator=g, dtype=torch.float64)).ceil().long().clamp(min=1)):
            assert torch.equal(_count_prefix_below(q, limit), (before < limit).sum(-1, keepdim=True)), n


@pytest.mark.parametrize(("dtype", "temperature"), [(torch.float32, 1.0), (torch.bfloat16, 0.8)])
def test_large_vocabulary_draws_only_nucleus_tokens(dtype: torch.dtype, temperature: float):
    V = 151936
    g = torch.Generator().manual_seed(13)
    logits = (torch.randn(4, V, generator=g) * torch.tensor([[1.0], [2.5], [4.0], [8.0]])).to(dtype)
    logits[3, 100_000:] = float("-inf")
    keys = torch.tensor([sequence_key(4, i, 0) for i in range(4)])
    scaled = logits.float() / temperature
    for top_p in (0.1, 0.9):
        # HF's set, plus the tokens tied with its smallest kept logit (bf16 logits have many ties)
        hf_min = scaled.masked_fill(hf_probs(scaled, top_p=top_p) == 0, float("inf")).amin(-1, keepdim=True)
        inside = scaled >= hf_min
        srt = torch.sort(scaled, dim=-1, descending=True).values
        assert torch.equal(scaled >= _nucleus_threshold(srt, top_p), inside)
        for step in range(3):
            params = SamplingParams(temperature=temperature, top_p=top_p)
            tokens, lp = sample(logits, keys, torch.full((4,), 100 + step), params)
            assert inside.gather(-1, tokens[:, None]).all()
            assert torch.isfinite(lp).all()


def test_sampling_params_refuse_non_finite_temperature():
    for t in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite number"):
            SamplingParams(temperature=t)
