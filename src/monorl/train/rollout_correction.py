"""Rollout correction: importance weights for the generator/trainer mismatch when batch invariance is off.

Without `batch_invariant`, the generator's log-probs (pi_rollout) differ from what the trainer computes for the
same weights (pi_old): other kernels, another dtype, another batch layout. monorl's default takes the PPO ratio
against pi_rollout directly (verl's "bypass" mode), so that mismatch reads as policy change and is clipped like
one. With a correction on, the loss is decoupled, as in verl's rollout correction, TIS (Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training") and IcePop (Ring-1T):

    ratio  r_t = pi_theta(t) / pi_old(t)          the PPO / GRPO ratio, clipped as usual
    weight w_t = pi_old(t) / pi_rollout(t)         the IS weight, detached: it corrects the sampling distribution

pi_old must be the trainer's own log-probs before the update. monorl takes one optimizer step per batch, so
pi_old is the trainer's forward of this very step, detached (`logprobs.detach()`): no second forward, and r = 1 in
value (its gradient is grad log pi_theta). With several updates per batch pi_old would have to come from a no-grad
forward before the first update, as the KL reference's log-probs do (`monorl.train.frozen`).

Two mechanisms, each at a level (verl's `rollout_is` / `rollout_rs`):
    rollout_is      importance weights, truncated (TIS): w <- min(w, rollout_is_threshold)
    rollout_rs      rejection (masked IS, MIS / IcePop): units whose w is outside [rollout_rs_threshold_lower,
                    rollout_rs_threshold] get zero loss weight
    level token     w_t per token
          sequence  w_s = prod_t w_t = exp(sum_t log w_t), broadcast to the sequence's tokens
          geometric w_s = exp(mean_t log w_t), the per-token geometric mean (length-independent thresholds)
Both can be on (IcePop is token IS + token RS at the same bounds). Log-weights are clamped to +-`log_ratio_clamp`
(verl's safety bound), so one -inf generator log-prob cannot make inf.

The resulting per-token factor f_t = w_t * keep_t scales each token's surrogate (token kinds, cispo) or each token's
log-ratio inside the sequence mean (grpo / gspo: the gradient is then mean_t f_t grad log pi_t, as a token-level
weight should be; a sequence-level f scales the whole sequence's gradient). Masked units keep their place in the
step's normaliser, as TRL's `vllm_importance_sampling_mode="token_mask"` does: the normaliser is fixed before the
forward that finds them (verl drops them from it). The KL term is not weighted.

Metrics (verl's names, shares of the step summed over micro-batches; min / max reduced by the trainer): the raw
weight's mean, min and max over the units of the IS level (the RS level when only rejection is on), the share of
those units truncated (`rollout_is_ratio_fraction_high`), and the share of response tokens masked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

CorrectionLevel = Literal["token", "sequence", "geometric"]
CORRECTION_LEVELS: tuple[str, ...] = get_args(CorrectionLevel)
SUM_METRICS = ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_ratio_fraction_high",
               "rollout_corr/rollout_rs_masked_fraction")
MAX_METRIC, MIN_METRIC = "rollout_corr/rollout_is_max", "rollout_corr/rollout_is_min"


@dataclass
class RolloutCorrectionConfig:
    """Importance weights for the generator/trainer mismatch when batch_invariant is off: truncated (TIS) and / or
    masked (MIS, IcePop), per token, sequence or geometric mean (verl's algorithm.rollout_correction keys).

    TRL's vllm_importance_sampling_mode "token_truncate" with cap C is rollout_is=token, rollout_is_threshold=C; its
    "sequence_mask" is rollout_is=sequence plus rollout_rs=sequence with rollout_rs_threshold=C and
    rollout_rs_threshold_lower=0."""

    rollout_is: CorrectionLevel | None = None  # truncated IS weights pi_old / pi_rollout at this level (None: off)
    rollout_is_threshold: float = 2.0  # TIS cap C: weights are min(w, C)
    rollout_rs: CorrectionLevel | None = None  # masked IS: drop units whose weight is out of range (None: off)
    rollout_rs_threshold: float = 2.0  # units with weight above this get zero loss weight
    rollout_rs_threshold_lower: float | None = None  # units with weight below this too; None: 1 / rollout_rs_threshold

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None

    @property
    def rs_lower(self) -> float:
        lower = self.rollout_rs_threshold_lower
        return 1.0 / self.rollout_rs_threshold if lower is None else lower

    def __post_init__(self) -> None:
        for key in ("rollout_is", "rollout_rs"):
            if getattr(self, key) not in (None, *CORRECTION_LEVELS):
                raise ValueError(f"rollout_correction.{key} must be none or one of {', '.join(CORRECTION_LEVELS)}, "
                                 f"got {getattr(self, key)!r}")
        if not self.rollout_is_threshold > 0:
            raise ValueError(f"rollout_correction.rollout_is_threshold must be > 0, got {self.rollout_is_threshold}")
        if not 0 <= self.rs_lower < self.rollout_rs_threshold:
            raise ValueError("rollout_correction needs 0 <= rollout_rs_threshold_lower < rollout_rs_threshold, got "
                             f"{self.rs_lower} and {self.rollout_rs_threshold}")


def _log_weight(token_log_w: Tensor, level: str, seq_ids: Tensor, mask: Tensor, lengths: Tensor,
                bound: float) -> tuple[Tensor, Tensor]:
    """The log-weight at `level`, within +-bound: per unit ([N] tokens, or [S] sequences) and broadcast to
    tokens ([N])."""
    if level == "token":
        return token_log_w, token_log_w
    seq_sum = torch.zeros(lengths.numel(), device=token_log_w.device).index_add(0, seq_ids, token_log_w * mask)
    if level == "geometric":
        seq_sum = seq_sum / lengths.clamp(min=1.0)
    seq_sum = seq_sum.clamp(-bound, bound)  # a long sequence's product would overflow fp32
    return seq_sum, seq_sum[seq_ids]


def correction_factors(trainer_logprobs: Tensor, rollout_logprobs: Tensor, seq_ids: Tensor, mask: Tensor,
                       lengths: Tensor, token_count: Tensor, seq_count: Tensor, cfg: RolloutCorrectionConfig,
                       log_ratio_clamp: float) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token factor f = w * keep ([N], detached; 0 on padded rows) for one micro-batch, and its metrics.
    trainer_logprobs are pi_old (detached), rollout_logprobs the generator's; mask [N] marks real rows; lengths
    [S] the step's response lengths; token_count / seq_count the step's units (0-d, >= 1). Sequence levels need
    each sequence whole in the micro-batch (packing keeps them whole). No host sync (trainer CUDA graphs)."""
    real = mask > 0
    # where, not a product: a padded row's log-prob need not be finite
    token_log_w = torch.where(real, trainer_logprobs.detach().float() - rollout_logprobs.float(), 0.0)
    token_log_w = token_log_w.clamp(-log_ratio_clamp, log_ratio_clamp)
    present = torch.zeros(lengths.numel(), device=mask.device).index_add_(0, seq_ids, mask) > 0
    factor = mask.float()
    if cfg.rollout_is is not None:
        _, is_log_w = _log_weight(token_log_w, cfg.rollout_is, seq_ids, mask, lengths, log_ratio_clamp)
        factor = factor * torch.exp(is_log_w).clamp(max=cfg.rollout_is_threshold)
    masked = torch.zeros_like(factor)
    if cfg.rollout_rs is not None:
        _, rs_log_w = _log_weight(token_log_w, cfg.rollout_rs, seq_ids, mask, lengths, log_ratio_clamp)
        w = torch.exp(rs_log_w)
        rejected = ((w > cfg.rollout_rs_threshold) | (w < cfg.rs_lower)) & real
        factor = torch.where(rejected, 0.0, factor)
        masked = rejected.float()
    # the metrics' units: the IS level's, or the RS level's when only rejection is on
    level = cfg.rollout_is or cfg.rollout_rs
    unit_log_w, _ = _log_weight(token_log_w, level, seq_ids, mask, lengths, log_ratio_clamp)
    units = real if level == "token" else present
    w = torch.exp(unit_log_w)
    count = token_count if level == "token" else seq_count
    metrics: dict[str, Tensor] = {}
    metrics["rollout_corr/rollout_is_mean"] = torch.where(units, w, 0.0).sum() / count
    over = (w > cfg.rollout_is_threshold) & units if cfg.rollout_is is not None else torch.zeros_like(units)
    metrics["rollout_corr/rollout_is_ratio_fraction_high"] = over.sum().float() / count
    metrics["rollout_corr/rollout_rs_masked_fraction"] = masked.sum() / token_count
    metrics[MAX_METRIC] = torch.where(units, w, float("-inf")).max()
    metrics[MIN_METRIC] = torch.where(units, w, float("inf")).min()
    return factor.detach(), metrics
