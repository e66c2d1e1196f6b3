"""Policy losses on flat response tokens of packed micro-batches: GRPO, token-level GRPO, DAPO, Dr. GRPO.

Inputs (one micro-batch):
    logprobs      [N]  trainer log-probs of the response tokens (with grad)
    old_logprobs  [N]  the generator's log-probs of the same tokens: the importance ratio is taken against them
    advantages    [S]  one per sequence of the *step*
    seq_ids       [N]  int64, which of the step's S sequences each token belongs to (step-global indices, as
                       `monorl.train.packing` produces them)
    ref_logprobs  [N]  optional, a frozen reference policy's log-probs, for the KL penalty

The kinds:
    grpo        ratio_s = exp(mean_t(logp - old)) per sequence; loss_s = -min(r_s A_s, clip(r_s) A_s);
                mean over sequences. This is TorchTitan RL's `GRPOLoss` as used by its rl_grpo_qwen3_0_6b
                experiment (pytorch/torchtitan, torchtitan/experiments/rl/simple_grpo_sum_digits.py and
                grpo.py: ``ratio = exp(stack([lp.mean() for lp in per_sample_log_ratios]))``, clamp to
                ``[1 - clip_eps, 1 + clip_eps]``, ``-min(ratio * A, clipped * A).mean()``; clip_eps 0.2; its KL,
                when used, was k3 averaged per sample then over samples). Later TorchTitan versions moved to
                the per-token form below ("token_grpo").
    token_grpo  per-token ratio, loss_t = -min(r_t A, clip(r_t) A), mean over all response tokens of the step.
    dapo        token_grpo with the DAPO defaults: asymmetric clip (clip_high 0.28), token-mean.
    dr_grpo     per-token clipped surrogate, summed and divided by the constant num_seqs * dr_grpo_norm
                (Liu et al. 2025; pair it with `group_advantages(normalize_std=False)`).

KL penalty: k3 = exp(ref - logp) - (ref - logp) - 1 per token, reduced exactly like the policy term (per
sequence mean then over sequences for grpo; over step tokens for token_grpo / dapo; / (S * dr_grpo_norm) for
dr_grpo), times kl_coef.

Gradient accumulation: every reduction divides by a *step-level* count held in `LossNorm` (built once per
step from the response lengths of all its sequences), never by a micro-batch count, so the sum of the
micro-batch losses is exactly the loss of the whole step in one batch. The same holds for the metrics: each
is the micro-batch's share of the step value, so sum them over the step's micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

LOSS_KINDS = ("grpo", "token_grpo", "dapo", "dr_grpo")


@dataclass
class LossConfig:
    kind: str = "grpo"
    clip_low: float = 0.2  # ratio floor 1 - clip_low
    clip_high: float | None = None  # ratio ceiling 1 + clip_high; None: 0.28 for dapo, else 0.2
    kl_coef: float = 0.0  # weight of the k3 KL to the reference policy (needs ref_logprobs when > 0)
    dr_grpo_norm: float | None = None  # dr_grpo's constant per-sequence normaliser, e.g. max_new_tokens
    dual_clip: float | None = None  # cap the loss of negative-advantage units at -dual_clip * A (c > 1)
    # Per-token log-ratios are clamped to +-this before exp, so one -inf generator log-prob cannot make NaN
    # (as TorchTitan's compute_ratio does); tokens beyond it get no gradient.
    log_ratio_clamp: float = 20.0

    @property
    def ceiling(self) -> float:
        """The upper clip offset: clip_high, or its default (0.28 for dapo, else 0.2)."""
        if self.clip_high is not None:
            return self.clip_high
        return 0.28 if self.kind == "dapo" else 0.2

    def __post_init__(self) -> None:
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"LossConfig.kind must be one of {LOSS_KINDS}, got {self.kind!r}")
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high is not None and self.clip_high < 0.0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if self.kl_coef < 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.dr_grpo_norm is not None and not self.dr_grpo_norm > 0:
            raise ValueError(f"dr_grpo_norm must be > 0, got {self.dr_grpo_norm}")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")
        if not self.log_ratio_clamp > 0:
            raise ValueError(f"log_ratio_clamp must be > 0, got {self.log_ratio_clamp}")


@dataclass(frozen=True)
class LossNorm:
    """Step-level normalisers. Build once per optimizer step with `for_step`, pass to every micro-batch.
    The divisors are tensors, so a captured CUDA graph reads this step's values rather than baking them."""

    response_lengths: Tensor  # [S] fp32, response tokens of each sequence of the step
    num_tokens: int  # response tokens in the step
    num_seqs: int  # sequences with at least one response token
    denom: Tensor  # 0-d fp32: the policy (and KL) sum is divided by this
    unit_count: Tensor  # 0-d fp32: units (sequences for grpo, else tokens) the metrics average over (>= 1)

    @classmethod
    def for_step(cls, cfg: LossConfig, response_lengths: Sequence[int] | Tensor,
                 device: torch.device | str | None = None) -> LossNorm:
        lengths = torch.as_tensor(response_lengths, dtype=torch.float32).reshape(-1)
        if (lengths < 0).any():
            raise ValueError("response lengths must be >= 0")
        num_tokens = int(lengths.sum().item())
        num_seqs = int((lengths > 0).sum().item())
        if cfg.kind == "grpo":
            denom = num_seqs
        elif cfg.kind == "dr_grpo":
            if cfg.dr_grpo_norm is None:
                raise ValueError("kind='dr_grpo' needs dr_grpo_norm (a constant such as max_new_tokens)")
            denom = lengths.numel() * cfg.dr_grpo_norm
        else:
            denom = num_tokens
        units = num_seqs if cfg.kind == "grpo" else num_tokens
        # an all-empty step has a zero loss; max() keeps it 0 rather than 0/0
        scalars = torch.tensor([max(denom, 1), max(units, 1)], dtype=torch.float32).to(device)
        return cls(lengths.to(device), num_tokens, num_seqs, scalars[0], scalars[1])


def loss_metric_names(has_ref: bool) -> tuple[str, ...]:
    """The keys of `policy_loss`'s metrics, in order (`kl` only with ref_logprobs)."""
    names = ("loss", "pg_loss", "ratio_mean", "clip_frac_low", "clip_frac_high", "clip_frac")
    return (*names, "kl") if has_ref else names


def _surrogate_loss(ratio: Tensor, adv: Tensor, cfg: LossConfig) -> Tensor:
    """-min(r A, clip(r) A), optionally dual-clipped: per unit (token or sequence)."""
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.ceiling)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    if cfg.dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -cfg.dual_clip * adv), loss)
    return loss


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, seq_ids: Tensor, cfg: LossConfig,
                norm: LossNorm, ref_logprobs: Tensor | None = None,
                token_mask: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the step loss, and its share of each metric (all detached):
    ``loss``, ``pg_loss``, ``kl`` (when ref_logprobs is given), ``ratio_mean``, ``clip_frac`` (=
    ``clip_frac_low + clip_frac_high``: units whose ratio fell outside the clip range). Units are sequences for
    grpo, tokens otherwise. `token_mask` [N] (1 real, 0 padding) drops padded rows of a static pack.

    For grpo every sequence's tokens must all be in one micro-batch (packing keeps sequences whole).
    No host sync and no data-dependent control flow: it runs inside the trainer's CUDA graph.
    """
    n = logprobs.shape
    if logprobs.dim() != 1 or old_logprobs.shape != n or seq_ids.shape != n:
        raise ValueError(f"logprobs {tuple(n)}, old_logprobs {tuple(old_logprobs.shape)} and seq_ids "
                         f"{tuple(seq_ids.shape)} must be equal 1-D shapes")
    if ref_logprobs is not None and ref_logprobs.shape != n:
        raise ValueError(f"ref_logprobs {tuple(ref_logprobs.shape)} must match logprobs {tuple(n)}")
    num_seqs_step = norm.response_lengths.numel()
    if advantages.shape != (num_seqs_step,):
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [S] with S={num_seqs_step} (LossNorm)")
    if seq_ids.dtype != torch.int64:
        raise TypeError(f"seq_ids must be int64, got {seq_ids.dtype}")
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if token_mask is not None and token_mask.shape != n:
        raise ValueError(f"token_mask {tuple(token_mask.shape)} must match logprobs {tuple(n)}")

    lp = logprobs.float()
    adv = advantages.detach().float()
    mask = torch.ones_like(lp) if token_mask is None else token_mask.float()
    log_ratio = (lp - old_logprobs.detach().float()).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp) * mask
    kl_tok = None
    if ref_logprobs is not None:
        d = (ref_logprobs.detach().float() - lp).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
        kl_tok = (torch.exp(d) - d - 1.0) * mask

    if cfg.kind == "grpo":
        lengths = norm.response_lengths.to(lp.device)
        present = torch.zeros(num_seqs_step, device=lp.device).index_add_(0, seq_ids, mask) > 0
        per_len = 1.0 / lengths.clamp(min=1.0)
        seq_log_ratio = torch.zeros(num_seqs_step, device=lp.device).index_add(0, seq_ids, log_ratio) * per_len
        ratio = torch.exp(seq_log_ratio)
        # sequences of the step outside this micro-batch would read as ratio 1: mask them out
        pg = (_surrogate_loss(ratio, adv, cfg) * present).sum() / norm.denom
        kl = None
        if kl_tok is not None:
            kl = (torch.zeros(num_seqs_step, device=lp.device).index_add(0, seq_ids, kl_tok) * per_len).sum()
            kl = kl / norm.denom
        units, unit_mask = ratio, present
    else:
        ratio = torch.exp(log_ratio)
        pg = (_surrogate_loss(ratio, adv[seq_ids], cfg) * mask).sum() / norm.denom
        kl = kl_tok.sum() / norm.denom if kl_tok is not None else None
        units, unit_mask = ratio, None if token_mask is None else mask > 0
    unit_count = norm.unit_count.to(lp.device)

    loss = pg if kl is None or cfg.kl_coef == 0 else pg + cfg.kl_coef * kl
    with torch.no_grad():
        u = units.detach()
        low = u < 1.0 - cfg.clip_low
        high = u > 1.0 + cfg.ceiling
        if unit_mask is not None:
            u, low, high = u * unit_mask, low & unit_mask, high & unit_mask
        metrics = {
            "loss": loss.detach(),
            "pg_loss": pg.detach(),
            "ratio_mean": u.sum() / unit_count,
            "clip_frac_low": low.sum().float() / unit_count,
            "clip_frac_high": high.sum().float() / unit_count,
        }
        metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
        if kl is not None:
            metrics["kl"] = kl.detach()
    return loss, metrics
