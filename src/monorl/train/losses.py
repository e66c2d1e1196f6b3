"""Policy losses on flat response tokens of packed micro-batches: GRPO, GSPO, token-level GRPO, DAPO, Dr. GRPO,
CISPO.

Inputs (one micro-batch):
    logprobs      [N]  trainer log-probs of the response tokens (with grad)
    old_logprobs  [N]  the generator's log-probs of the same tokens: the importance ratio is taken against them,
                       unless a rollout correction is on (then they give its IS weight; see below)
    advantages    [S]  one per sequence of the *step*
    seq_ids       [N]  int64, which of the step's S sequences each token belongs to (step-global indices, as
                       `monorl.train.packing` produces them)
    ref_logprobs  [N]  optional, a frozen reference policy's log-probs, for the KL penalty
    token_advantages [N]  optional, added to each token's sequence advantage (a distillation teacher's,
                       `monorl.train.teacher`); token kinds only: grpo / gspo take one advantage per sequence

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
    gspo        GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071): sequence-level
                ratio s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|) = exp(mean_t(logp - old)), clipped per sequence,
                loss_i = -min(s_i A_i, clip(s_i) A_i), mean over sequences. That objective (its eq. 5) is
                *mathematically identical* to the `grpo` kind above, which already takes TorchTitan's
                sequence-mean ratio: `gspo` is the same code path under GSPO's name and with GSPO's defaults,
                clip_low 3e-4 and clip_high 4e-4 (the paper's section 5.1; both configurable). Peers: verl
                `compute_policy_loss_gspo` in verl/trainer/ppo/core_algos.py (loss_agg_mode
                "seq-mean-token-mean"); TRL `importance_sampling_level="sequence"` in trl/trainer/grpo_trainer.py.
                GSPO-token (the paper's eq. 13, s_it = sg(s_i) * pi(y_it) / sg(pi(y_it)) with per-token
                advantages) is not a separate kind: with one advantage per sequence, as here, the paper notes it
                equals GSPO in value and gradient. Note the tiny clip range: ratios are taken against the
                generator's log-probs, so generator/trainer numerical mismatch alone can clip sequences (those
                get no gradient); watch clip_frac, or use batch_invariant.
    cispo       CISPO (MiniMax-M1, arXiv:2506.13585, section 3.1): loss_t = -sg(clip(r_t, 1 - clip_low,
                1 + clip_high)) * A * logp_t, summed over tokens and divided by the step's response tokens
                (token-mean). The clipped IS weight is a detached coefficient on REINFORCE, so every token keeps a
                gradient (no min, nothing switched off). Defaults: no lower bound (clip_low None: the paper
                "did not impose a lower bound on the IS weight"), clip_high 0.28 (the paper tunes only the upper
                bound without stating it; 0.28 is Trinity-RFT's CISPOPolicyLossFn default). Note the loss *value*
                is -w A logp, not a surrogate near -A: compare its gradient, not its value, with the other kinds.
                Peers: verl `compute_policy_loss_cispo` (verl/trainer/ppo/core_algos.py); TRL
                `loss_type="cispo"` (trl/trainer/grpo_trainer.py, which clamps at an absolute `epsilon_high`).
                dual_clip does not apply (there is no clipped branch to bound).

Clip metrics count units (sequences for grpo/gspo, tokens otherwise) whose ratio fell outside
[1 - clip_low, 1 + clip_high] (``clip_frac_low`` / ``clip_frac_high`` / ``clip_frac``, whatever the advantage's
sign; for cispo those are the tokens whose IS weight was truncated), and, as TRL's GRPOTrainer counts them,
the units whose clip is *active*: below the floor with a negative advantage (``clip_ratio/low_mean``), above
the ceiling with a positive one (``clip_ratio/high_mean``), either (``clip_ratio/region_mean``). Those are the
units the clip takes the gradient from (for cispo: whose IS weight was truncated where it weighs the update).

KL to the reference policy, per token with d = ref - logp (the estimators of Schulman, "Approximating KL
divergence", 2020, http://joschu.net/blog/kl-approx.html; samples are from the policy, so each estimates
KL(pi || ref)):
    k1 = -d                        unbiased, high variance, can be negative
    k2 = d^2 / 2                   biased, low variance, >= 0
    k3 = exp(d) - d - 1            unbiased, low variance, >= 0 (the default; TRL's and TorchTitan's)
selected by `kl_estimator`, reduced exactly like the policy term (per sequence mean then over sequences for
grpo / gspo; over step tokens for token_grpo / dapo / cispo; / (S * dr_grpo_norm) for dr_grpo). With
`kl_in_loss` (the default) kl_coef * KL is added to the loss; without it the KL is only reported as the `kl`
metric (verl's "use_kl_loss: False" monitoring); the reference policy is built when kl_coef > 0, so a
metric-only KL still needs kl_coef > 0 (its value then weights nothing).

Rollout correction (`rollout_correction`, off by default; `monorl.train.rollout_correction` has the formulation):
the ratio is taken against the trainer's own log-probs of this step, detached (pi_old: one optimizer step per
batch), so it is 1 in value and the clip metrics read 0; the mismatch pi_old / pi_rollout becomes a detached IS
weight per token, truncated (TIS) and / or with out-of-range units masked (MIS / IcePop), which scales each token's
surrogate (token kinds, cispo) or each token's log-ratio inside the sequence mean (grpo / gspo).

Gradient accumulation: every reduction divides by a *step-level* count held in `LossNorm` (built once per
step from the response lengths of all its sequences), never by a micro-batch count, so the sum of the
micro-batch losses is exactly the loss of the whole step in one batch. The same holds for the metrics: each
is the micro-batch's share of the step value, so sum them over the step's micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from torch import Tensor

from monorl.train.rollout_correction import SUM_METRICS, RolloutCorrectionConfig, correction_factors

LossKind = Literal["grpo", "token_grpo", "dapo", "dr_grpo", "gspo", "cispo"]
LOSS_KINDS: tuple[str, ...] = get_args(LossKind)
SEQ_KINDS = ("grpo", "gspo")  # one ratio per sequence: units are sequences, loss and KL are means over sequences
KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)


@dataclass
class LossConfig:
    kind: LossKind = "grpo"  # policy loss (formulas in monorl/train/losses.py)
    clip_low: float | None = None  # ratio floor 1 - clip_low; None: 3e-4 for gspo, no floor for cispo, else 0.2
    clip_high: float | None = None  # ratio ceiling 1 + clip_high; None: 0.28 for dapo / cispo, 4e-4 gspo, else 0.2
    kl_coef: float = 0.0  # weight of the KL to the reference policy (needs ref_logprobs when > 0)
    kl_estimator: KLEstimator = "k3"  # k1 | k2 | k3 (Schulman's estimators, see the module docstring)
    kl_in_loss: bool = True  # False: the KL is computed and reported as a metric, not added to the loss
    dr_grpo_norm: float | None = None  # dr_grpo's constant per-sequence normaliser, e.g. max_new_tokens
    dual_clip: float | None = None  # cap the loss of negative-advantage units at -dual_clip * A (c > 1)
    # Per-token log-ratios are clamped to +-this before exp, so one -inf generator log-prob cannot make NaN
    # (as TorchTitan's compute_ratio does); tokens beyond it get no gradient.
    log_ratio_clamp: float = 20.0
    # importance weights for the generator/trainer mismatch when batch_invariant is off (verl's rollout correction)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    @property
    def floor(self) -> float:
        """The lower clip offset: clip_low, or its default (3e-4 for gspo, 1.0 = no floor for cispo, else 0.2)."""
        if self.clip_low is not None:
            return self.clip_low
        return {"gspo": 3e-4, "cispo": 1.0}.get(self.kind, 0.2)

    @property
    def ceiling(self) -> float:
        """The upper clip offset: clip_high, or its default (0.28 for dapo and cispo, 4e-4 for gspo, else 0.2)."""
        if self.clip_high is not None:
            return self.clip_high
        return {"dapo": 0.28, "cispo": 0.28, "gspo": 4e-4}.get(self.kind, 0.2)

    def __post_init__(self) -> None:
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"LossConfig.kind must be one of {LOSS_KINDS}, got {self.kind!r}")
        if self.clip_low is not None and not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in [0, 1) (or None: the kind's default), got {self.clip_low}")
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
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if not self.kl_in_loss and self.kl_coef == 0:
            raise ValueError("kl_in_loss=False reports the KL to the reference policy as a metric only, and the "
                             "reference is built only when kl_coef > 0: set kl_coef > 0 (it then weights nothing)")
        if self.kind == "cispo" and self.dual_clip is not None:
            raise ValueError("dual_clip does not apply to kind='cispo' (its clipped IS weight has no branch to cap)")


@dataclass(frozen=True)
class LossNorm:
    """Step-level normalisers. Build once per optimizer step with `for_step`, pass to every micro-batch.
    The divisors are tensors, so a captured CUDA graph reads this step's values rather than baking them."""

    response_lengths: Tensor  # [S] fp32, response tokens of each sequence of the step
    num_tokens: int  # response tokens in the step
    num_seqs: int  # sequences with at least one response token
    denom: Tensor  # 0-d fp32: the policy (and KL) sum is divided by this
    unit_count: Tensor  # 0-d fp32: units (sequences for grpo/gspo, else tokens) the metrics average over (>= 1)
    token_count: Tensor  # 0-d fp32: num_tokens (>= 1), as a tensor for the rollout correction's metrics
    seq_count: Tensor  # 0-d fp32: num_seqs (>= 1), likewise

    @classmethod
    def for_step(cls, cfg: LossConfig, response_lengths: Sequence[int] | Tensor,
                 device: torch.device | str | None = None) -> LossNorm:
        lengths = torch.as_tensor(response_lengths, dtype=torch.float32).reshape(-1)
        if (lengths < 0).any():
            raise ValueError("response lengths must be >= 0")
        num_tokens = int(lengths.sum().item())
        num_seqs = int((lengths > 0).sum().item())
        if cfg.kind in SEQ_KINDS:
            denom = num_seqs
        elif cfg.kind == "dr_grpo":
            if cfg.dr_grpo_norm is None:
                raise ValueError("kind='dr_grpo' needs dr_grpo_norm (a constant such as max_new_tokens)")
            denom = lengths.numel() * cfg.dr_grpo_norm
        else:
            denom = num_tokens
        units = num_seqs if cfg.kind in SEQ_KINDS else num_tokens
        # an all-empty step has a zero loss; max() keeps it 0 rather than 0/0
        scalars = torch.tensor([max(denom, 1), max(units, 1), max(num_tokens, 1), max(num_seqs, 1)],
                               dtype=torch.float32).to(device)
        return cls(lengths.to(device), num_tokens, num_seqs, *scalars)


def loss_metric_names(has_ref: bool, correction: bool = False) -> tuple[str, ...]:
    """The keys of `policy_loss`'s metrics that sum over micro-batches, in order (`kl` only with ref_logprobs, the
    rollout correction's with it on; its min / max, `rollout_correction.MIN_METRIC` / `MAX_METRIC`, come besides)."""
    names = ("loss", "pg_loss", "ratio_mean", "clip_frac_low", "clip_frac_high", "clip_frac",
             "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
    names = (*names, "kl") if has_ref else names
    return (*names, *SUM_METRICS) if correction else names


def _surrogate_loss(ratio: Tensor, adv: Tensor, cfg: LossConfig) -> Tensor:
    """-min(r A, clip(r) A), optionally dual-clipped: per unit (token or sequence)."""
    clipped = ratio.clamp(1.0 - cfg.floor, 1.0 + cfg.ceiling)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    if cfg.dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -cfg.dual_clip * adv), loss)
    return loss


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, seq_ids: Tensor, cfg: LossConfig,
                norm: LossNorm, ref_logprobs: Tensor | None = None,
                token_mask: Tensor | None = None, token_advantages: Tensor | None = None
                ) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the step loss, and its share of each metric (all detached):
    ``loss``, ``pg_loss``, ``kl`` (when ref_logprobs is given), ``ratio_mean``, ``clip_frac`` (=
    ``clip_frac_low + clip_frac_high``: units whose ratio fell outside the clip range) and
    ``clip_ratio/{low,high,region}_mean`` (TRL's: units whose clip is active). Units are sequences for
    grpo / gspo, tokens otherwise. `token_mask` [N] (1 real, 0 padding) drops padded rows of a static pack.

    For grpo / gspo every sequence's tokens must all be in one micro-batch (packing keeps sequences whole).
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
    if token_advantages is not None and (token_advantages.shape != n or cfg.kind in SEQ_KINDS):
        raise ValueError(f"token_advantages {tuple(token_advantages.shape)} must match logprobs {tuple(n)}, with a "
                         f"per-token loss kind (got {cfg.kind!r})")

    lp = logprobs.float()
    adv = advantages.detach().float()
    mask = torch.ones_like(lp) if token_mask is None else token_mask.float()
    corr = cfg.rollout_correction
    factor, corr_metrics = mask, {}  # per-token loss weight: the IS weight with a correction on, else 0 / 1
    if corr.enabled:  # the ratio against pi_old (this forward, detached); the generator's log-probs weight it
        factor, corr_metrics = correction_factors(
            lp.detach(), old_logprobs, seq_ids, mask, norm.response_lengths.to(lp.device),
            norm.token_count.to(lp.device), norm.seq_count.to(lp.device), corr, cfg.log_ratio_clamp)
        log_ratio = torch.where(mask > 0, lp - lp.detach(), 0.0)
    else:
        log_ratio = (lp - old_logprobs.detach().float()).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp) * mask
    kl_tok = None
    if ref_logprobs is not None:
        d = (ref_logprobs.detach().float() - lp).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
        if cfg.kl_estimator == "k1":
            kl_tok = -d * mask
        elif cfg.kl_estimator == "k2":
            kl_tok = 0.5 * d.square() * mask
        else:
            kl_tok = (torch.exp(d) - d - 1.0) * mask

    tok_adv = adv[seq_ids] if token_advantages is None else adv[seq_ids] + token_advantages.detach().float()
    if cfg.kind in SEQ_KINDS:
        lengths = norm.response_lengths.to(lp.device)
        present = torch.zeros(num_seqs_step, device=lp.device).index_add_(0, seq_ids, mask) > 0
        per_len = 1.0 / lengths.clamp(min=1.0)
        weighted = log_ratio * factor if corr.enabled else log_ratio
        seq_log_ratio = torch.zeros(num_seqs_step, device=lp.device).index_add(0, seq_ids, weighted) * per_len
        ratio = torch.exp(seq_log_ratio)
        # sequences of the step outside this micro-batch would read as ratio 1: mask them out
        pg = (_surrogate_loss(ratio, adv, cfg) * present).sum() / norm.denom
        kl = None
        if kl_tok is not None:
            kl = (torch.zeros(num_seqs_step, device=lp.device).index_add(0, seq_ids, kl_tok) * per_len).sum()
            kl = kl / norm.denom
        units, unit_mask, unit_adv = ratio, present, adv
    elif cfg.kind == "cispo":
        ratio = torch.exp(log_ratio)
        weight = ratio.detach().clamp(1.0 - cfg.floor, 1.0 + cfg.ceiling)
        # where, not a product: a padded row's log-prob need not be finite, and 0 * inf is NaN
        pg = -(weight * factor * tok_adv * torch.where(mask > 0, lp, 0.0)).sum() / norm.denom
        kl = kl_tok.sum() / norm.denom if kl_tok is not None else None
        units, unit_mask, unit_adv = ratio, None if token_mask is None else mask > 0, tok_adv
    else:
        ratio = torch.exp(log_ratio)
        pg = (_surrogate_loss(ratio, tok_adv, cfg) * factor).sum() / norm.denom
        kl = kl_tok.sum() / norm.denom if kl_tok is not None else None
        units, unit_mask, unit_adv = ratio, None if token_mask is None else mask > 0, tok_adv
    unit_count = norm.unit_count.to(lp.device)

    loss = pg if kl is None or cfg.kl_coef == 0 or not cfg.kl_in_loss else pg + cfg.kl_coef * kl
    with torch.no_grad():
        u = units.detach()
        low = u < 1.0 - cfg.floor
        high = u > 1.0 + cfg.ceiling
        if unit_mask is not None:
            u, low, high = u * unit_mask, low & unit_mask, high & unit_mask
        low_active, high_active = low & (unit_adv < 0), high & (unit_adv > 0)  # TRL's clip_ratio
        metrics = {
            "loss": loss.detach(),
            "pg_loss": pg.detach(),
            "ratio_mean": u.sum() / unit_count,
            "clip_frac_low": low.sum().float() / unit_count,
            "clip_frac_high": high.sum().float() / unit_count,
        }
        metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
        metrics["clip_ratio/low_mean"] = low_active.sum().float() / unit_count
        metrics["clip_ratio/high_mean"] = high_active.sum().float() / unit_count
        metrics["clip_ratio/region_mean"] = metrics["clip_ratio/low_mean"] + metrics["clip_ratio/high_mean"]
        if kl is not None:
            metrics["kl"] = kl.detach()
        metrics.update(corr_metrics)
    return loss, metrics
