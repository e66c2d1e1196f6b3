"""The trainer step on the shared model: packed forward -> response log-probs -> policy loss ->
backward (accumulated over micro-batches to one step) -> clip -> AdamW -> lr schedule.

The trainer owns the fp32 master weights and optimizer state; on CUDA the forward runs under bf16
autocast, so its matmuls see the same bf16-rounded weights the generator holds. The compute dtype is this one
setting in both modes: a batch-invariant model (`monorl.model.batch_invariant`) casts its embedding output to
autocast's dtype and its weights to their inputs' dtype, so it computes in exactly the generator's dtype.

With `cuda_graphs`, packs are static (`packing.pack(static=True)`) and each micro-batch is one replay of a graph
captured per pack shape (`train.graphs`; a pack's image grids are part of its shape: the tower runs inside the graph,
forward and backward); without, `_accumulate` runs directly.

Several ranks (`world`, an FSDP2-sharded model: `monorl.distributed`): every rank is given the whole step's
sequences and trains its contiguous share of them, balanced by packed tokens (`packing.token_share`). The loss
normalisers come from the whole step, so each rank's loss is its share of the one-rank loss and the summed gradients
equal the one-rank gradient; the metric sums are added over ranks. FSDP's collectives need every rank to run as many
micro-batches as the busiest one: the others run copies with every token masked (loss and gradient exactly zero).
With `cuda_graphs` each micro-batch, its all-gathers and reduce-scatters included, is one graph replay there too.

A mixture-of-experts policy may add the routers' load-balancing loss (`router_aux_loss`: router_aux_loss_coef times
transformers' `load_balancing_loss_func` of each micro-batch's router logits, weighted by its share of the step's
trained tokens), as HF adds it under `output_router_logits`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from monorl.compile import is_compiled
from monorl.distributed.fsdp import is_sharded
from monorl.distributed.world import SINGLE, World
from monorl.model.batch_invariant import is_batch_invariant
from monorl.model.decoder import DecoderForCausalLM
from monorl.model.logprobs import chunked_token_logprobs, chunked_token_logprobs_entropy
from monorl.model.moe import grouped_mm_serves
from monorl.model.moe_routing import RouterTap, load_balancing_loss
from monorl.ops.gated_delta_padded import capturable as padded_capturable
from monorl.ops.row_copies import take_rows
from monorl.train.frozen import FROZEN_FIELDS, fill_frozen_logprobs
from monorl.train.graphs import TrainGraphs, graph_blocker
from monorl.train.losses import LossNorm, loss_metric_names, policy_loss
from monorl.train.optim import clip_and_step, lr_factor, make_optimizer
from monorl.train.packing import (
    MicroBatch,
    PackShape,
    TrainSequence,
    covering_shape,
    make_micro_batches,
    masked_copy,
    model_forward,
    token_share,
)
from monorl.train.rollout_correction import MAX_METRIC, MIN_METRIC
from monorl.train.teacher import TeacherSection, distillation_terms
from monorl.train.trainer_config import TrainerConfig
from monorl.train.warm_up import TrainerWarmUps

log = logging.getLogger(__name__)


_METRIC_SLOTS = 24  # device accumulator: the loss's metrics, then logprob-diff sum, token count, entropy sum
_AUX_SLOT = _METRIC_SLOTS - 1  # ... and in the last slot the routers' load-balancing loss (router_aux_loss)
_TEACHER_SLOT = _METRIC_SLOTS - 2  # ... before it the distillation teacher's reverse-KL sum
# device max accumulator: logprob-diff max, then the rollout correction's IS-weight max and (negated) min
_MAX_SLOTS = 3


class Trainer(TrainerWarmUps):
    """The trainer step (see the module docstring); its ahead-of-time warm-ups are `TrainerWarmUps`'."""

    def __init__(self, model: DecoderForCausalLM, cfg: TrainerConfig, total_steps: int, attn_backend: str = "sdpa",
                 ref_model: DecoderForCausalLM | None = None, cuda_graphs: bool = False,
                 static_shapes: bool | None = None, max_graph_tokens: int | None = None,
                 world: World = SINGLE, teacher: DecoderForCausalLM | None = None,
                 distill: TeacherSection | None = None) -> None:
        """cuda_graphs: replay each micro-batch from a graph captured per pack shape (CUDA with the flash
        backend or a batch-invariant model, whose attention reads no host values; ignored elsewhere). All graphs
        share one memory pool, sized by the largest captured pack: max_graph_tokens (the memory plan's largest
        micro-batch) bounds it, and a larger pack runs without a graph (logged once).
        static_shapes: pad packs to bucketed shapes (default: when graphs are used; set on CPU, it runs the
        graphs' exact computation).
        world: the ranks this trainer is one of (see the module docstring; the model is then FSDP-sharded).
        teacher, distill: a frozen distillation teacher (a full copy on every rank), its section (kl_coef)."""
        self.model, self.cfg, self.total_steps, self.world = model, cfg, total_steps, world
        self.attn_backend, self.ref_model = attn_backend, ref_model
        self.teacher, self.teacher_kl_coef = teacher, (distill or TeacherSection()).kl_coef
        self.frozen_out: dict[tuple, Tensor] = {}  # each frozen forward's graph's output buffer (train/frozen.py)
        self.device = next(model.parameters()).device
        params = [p for p in model.parameters() if p.requires_grad]
        moe = model.config.is_moe
        if cfg.router_aux_loss and not moe:
            raise ValueError("trainer.router_aux_loss needs a mixture-of-experts model (model_type qwen3_moe)")
        self.router_tap = RouterTap(model) if cfg.router_aux_loss and model.config.router_aux_loss_coef > 0 else None
        grouped = moe and cfg.compute_dtype != "float32" and grouped_mm_serves(
            self.device, model.config.hidden_size, model.config.moe_intermediate_size)
        blocker = graph_blocker(model.config, is_batch_invariant(model), attn_backend == "flash", grouped,
                                lambda: padded_capturable(self.device))
        # under FSDP2 a graph captures the micro-batch's all-gathers and reduce-scatters with its kernels (NCCL
        # kernels capture; FSDP's side streams join the capture through its events and draw their buffers from the
        # graph's pool): one launch replaces the eager step's thousands (0.300 -> 0.066 s, 2 H200, #45)
        use_graphs = cuda_graphs and self.device.type == "cuda" and blocker is None
        if cuda_graphs and self.device.type == "cuda" and not use_graphs:
            log.warning("trainer CUDA graphs: %s; running without", blocker)
        self.static_shapes = use_graphs if static_shapes is None else static_shapes
        self.graphs = TrainGraphs(params, self.device) if use_graphs else None
        self.max_graph_tokens = max_graph_tokens
        self._warned_graph_size = False
        # metric sums stay on the device and cross to the host once per step (a sync per micro-batch would
        # stall the CPU that queues the next one); fixed buffers, so captured graphs can accumulate into them
        self._acc = torch.zeros(_METRIC_SLOTS, dtype=torch.float64, device=self.device)
        self._acc_max = torch.zeros(_MAX_SLOTS, dtype=torch.float32, device=self.device)
        self.optimizer = make_optimizer(params, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2), cfg.eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(s, cfg.warmup_steps, total_steps, cfg.schedule, cfg.min_lr_ratio),
        )
        dt = cfg.compute_dtype
        if dt == "auto":
            dt = "bfloat16" if self.device.type == "cuda" else "float32"
        self.autocast_dtype = torch.bfloat16 if dt == "bfloat16" else None
        self.step_count = 0

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def response_logprobs(self, model: DecoderForCausalLM, mb: MicroBatch, temperature: float) -> Tensor:
        """Log-probs of the completion tokens of one micro-batch, [N] fp32."""
        with self._autocast():
            hidden = take_rows(model_forward(model, mb), mb.logit_index)
            return chunked_token_logprobs(model, hidden, mb.targets, temperature, self.cfg.logprob_chunk)

    def logprobs_entropy(self, mb: MicroBatch, temperature: float) -> tuple[Tensor, Tensor]:
        """The policy's log-probs of one micro-batch's completion tokens ([N] fp32, with grad) and the entropy of
        its distribution at each ([N] fp32, detached), from the same chunks of logits."""
        with self._autocast():
            hidden = take_rows(model_forward(self.model, mb), mb.logit_index)
            return chunked_token_logprobs_entropy(self.model, hidden, mb.targets, temperature, self.cfg.logprob_chunk)

    def frozen_models(self) -> list[tuple[str, DecoderForCausalLM]]:
        """The frozen models that score a step's packs, each with the MicroBatch field it fills
        (`fill_frozen_logprobs`): the KL reference (when the loss has a KL term), the distillation teacher."""
        kl_ref = self.ref_model is not None and self.cfg.loss.kl_coef > 0
        return ([("ref_logprobs", self.ref_model)] if kl_ref else []) + (
            [("teacher_logprobs", self.teacher)] if self.teacher is not None else [])

    def _apply_gradients(self) -> tuple[Tensor | float, Tensor | bool, float]:
        """Clip, step AdamW and the schedule; a non-finite gradient norm skips the update (weights and moments
        untouched). Returns (gradient norm, skipped, lr). With a fused optimizer on one rank (a single-GPU run) the
        skip is decided on the device (fused AdamW's `found_inf`) and the first two are device tensors: nothing here
        waits for the GPU, so the update (and whatever the caller queues next) is launched while the backward still
        runs, and the caller reads them with its own sync (`_read_update`). Elsewhere the norm is read here first."""
        lr = self.optimizer.param_groups[0]["lr"]
        norm, skipped = clip_and_step(list(self.model.parameters()), self.optimizer, self.cfg.max_grad_norm,
                                      on_device=self._update_on_device())
        with warnings.catch_warnings():  # a skipped update (non-finite norm) still counts as a step of the schedule
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=self.graphs is None)  # graphs write into the fixed .grad buffers
        self.step_count += 1
        return norm, skipped, lr

    def _update_on_device(self) -> bool:
        return bool(self.optimizer.defaults.get("fused")) and not is_sharded(self.model)

    def _read_update(self, norm: float, skipped: float | bool) -> tuple[float, bool]:
        """`_apply_gradients`' norm and skip as read on the host; logs a skipped update."""
        if skipped:
            log.warning("non-finite gradient norm (%s) at trainer step %d: update skipped", norm, self.step_count - 1)
        return float(norm), bool(skipped)

    def _micro_batches(self, seqs: Sequence[TrainSequence], indices: Sequence[int] | None = None,
                       cover: Callable[[MicroBatch], PackShape | None] | None = None) -> list[MicroBatch]:
        return make_micro_batches(seqs, self.cfg.micro_batch_tokens, self.device, self.attn_backend,
                                  static=self.static_shapes, indices=indices, share_prompts=self.cfg.share_prompts,
                                  cover=cover, vision=self.model.config.vision)

    def _my_share(self, seqs: Sequence[TrainSequence]) -> range:
        """The slice of the step's `seqs` this rank trains (all of them on one rank): balanced by packed tokens."""
        return token_share(seqs, self.world.rank, self.world.size, self.cfg.share_prompts)

    def _my_micro_batches(self, seqs: Sequence[TrainSequence], cover: Callable[[MicroBatch], PackShape | None] | None
                          = None) -> tuple[list[MicroBatch], int]:
        """This rank's packed micro-batches of its share of `seqs` (all of them on one rank), padded with fully
        masked copies to the most any rank has (FSDP runs one all-gather per block per pass on every rank);
        and how many of them are real. cover: see `make_micro_batches`."""
        mbs = [mb for mb in self._micro_batches(seqs, self._my_share(seqs), cover) if mb.num_targets > 0]
        real = len(mbs)
        if (most := self.world.max_int(real)) > real:
            template = mbs[0] if mbs else self._micro_batches(
                [dataclasses.replace(seqs[0], masked=False)], [0])[0]
            mbs += [masked_copy(template)] * (most - real)
        return mbs, real

    def _reduce_metrics(self, extra: list[float], local: Sequence[Tensor | float] = ()
                        ) -> tuple[list[float], list[float], list[float]]:
        """The step's metric sums followed by `extra` host counts, added over ranks; the maxima, the max over ranks;
        and `local` (this rank's scalars, device tensors or numbers) as they are. One host sync (two collectives on
        several ranks)."""
        sums = torch.cat([self._acc, torch.tensor(extra, dtype=torch.float64, device=self.device)])
        if self.world.size > 1:
            self.world.all_reduce_(sums)
            self.world.all_reduce_(self._acc_max, "max")
        mine = [torch.as_tensor(v, dtype=torch.float64, device=self.device).reshape(1) for v in local]
        host = torch.cat([sums, self._acc_max.double(), *mine]).tolist()
        n, m = sums.numel(), self._acc_max.numel()
        return host[:n], host[n:n + m], host[n + m:]

    def _reset_accumulators(self) -> None:
        """Zero the gradients (keeping the fixed buffers while graphs exist) and the metric sums."""
        self.optimizer.zero_grad(set_to_none=self.graphs is None)
        self._acc.zero_()
        self._zero_acc_max()

    def _zero_acc_max(self) -> None:
        self._acc_max.zero_()
        self._acc_max[1:].fill_(float("-inf"))  # max and -min of IS weights: any weight beats them

    def _accumulate(self, mb: MicroBatch, norm: LossNorm, advantages: Tensor, temperature: float) -> None:
        """One micro-batch: forward, loss, backward (into .grad), metric sums (into the device buffers).
        No host sync: this is the body a trainer CUDA graph captures."""
        tap = self.router_tap if self.router_tap is not None else contextlib.nullcontext()
        with tap:
            logprobs, entropy = self.logprobs_entropy(mb, temperature)
        token_adv = None
        if mb.teacher_logprobs is not None:  # the distillation teacher's per-token advantage and reverse KL
            token_adv, teacher_kl = distillation_terms(logprobs, mb.teacher_logprobs, mb.token_mask,
                                                       self.teacher_kl_coef)
            self._acc[_TEACHER_SLOT] += teacher_kl.sum().double()
        loss, metrics = policy_loss(logprobs, mb.old_logprobs, advantages, mb.seq_ids, self.cfg.loss, norm,
                                    ref_logprobs=mb.ref_logprobs, token_mask=mb.token_mask,
                                    token_advantages=token_adv)
        if self.router_tap is not None:
            cfg = self.model.config
            aux = load_balancing_loss(self.router_tap.logits(), cfg.num_experts, cfg.num_experts_per_tok)
            self.router_tap.clear()  # (a checkpointed block's recompute records again in backward: cleared next time)
            aux = aux * mb.token_mask.sum() / norm.token_count  # this micro-batch's share of the step
            loss = loss + cfg.router_aux_loss_coef * aux
            self._acc[_AUX_SLOT] += aux.detach().double()
        loss.backward()
        diff = (logprobs.detach() - mb.old_logprobs).abs() * mb.token_mask
        correction = self.cfg.loss.rollout_correction.enabled
        names = loss_metric_names(mb.ref_logprobs is not None, correction)
        vals = torch.stack([*(metrics[k] for k in names), diff.sum(), mb.token_mask.sum(),
                            (entropy * mb.token_mask).sum()]).double()
        self._acc[: vals.numel()] += vals  # each micro-batch returns its share of the step value
        maxes = [diff.max()] + ([metrics[MAX_METRIC], -metrics[MIN_METRIC]] if correction else [])
        torch.maximum(self._acc_max[: len(maxes)], torch.stack(maxes), out=self._acc_max[: len(maxes)])

    def _graph_key(self, mb: MicroBatch, num_seqs: int, temperature: float) -> tuple:
        # the frozen log-probs `_accumulate` will read: the frozen models' join a step's packs after packing (and
        # after `_cover` keys them), a sequence may carry its own
        filled = {f for f, _ in self.frozen_models()}
        frozen = tuple(f for f in FROZEN_FIELDS if f in filled or getattr(mb, f) is not None)
        return (mb.shape, num_seqs, frozen, float(temperature))

    def _cover(self, num_seqs: int, temperature: float) -> Callable[[MicroBatch], PackShape | None] | None:
        """With graphs: for a pack whose key has no graph, a captured shape of the same key otherwise that holds it
        within `graph_pad_slack` (`covering_shape`)."""
        graphs, slack = self.graphs, self.cfg.graph_pad_slack
        if graphs is None or slack <= 0:
            return None

        def cover(mb: MicroBatch) -> PackShape | None:
            key = self._graph_key(mb, num_seqs, temperature)
            if graphs.has(key):
                return None
            return covering_shape(mb.shape, [k[0] for k in graphs.graphs if k[1:] == key[1:]], slack,
                                  self.cfg.micro_batch_tokens)
        return cover

    def _ensure_graph(self, mb: MicroBatch, norm: LossNorm, advantages: Tensor, temperature: float) -> tuple | None:
        """Capture the graph for this micro-batch's key if needed; its key, or None when no graph serves it."""
        assert self.graphs is not None
        key = self._graph_key(mb, advantages.numel(), temperature)
        if self.graphs.has(key):
            return key
        if self.graphs.full():
            return None
        if self.max_graph_tokens is not None and mb.shape.full_tokens > self.max_graph_tokens:
            if not self._warned_graph_size:
                log.warning("trainer: a %d-token pack is larger than the %d tokens the memory plan sized the "
                            "CUDA-graph pool for; such packs run without a graph",
                            mb.shape.full_tokens, self.max_graph_tokens)
                self._warned_graph_size = True
            return None
        self.graphs.capture(key, lambda m, n, a: self._accumulate(m, n, a, temperature), (mb, norm, advantages),
                            reset=self._reset_accumulators, warmup=self._capture_warmup())
        return key

    def _capture_warmup(self) -> int:
        """Eager passes before a capture: one where nothing compiles (Dynamo's first passes want two)."""
        return 2 if is_compiled(self.model) else 1

    def _match_capture_passes(self, mbs: list[MicroBatch], norm: LossNorm, advantages: Tensor,
                              temperature: float) -> int:
        """Under FSDP every rank must run the same collectives in the same order. A capture's warm-up passes run
        them eagerly (the capture none), and ranks whose packs differ in shape capture different numbers of graphs:
        before any capture, a rank that will warm up fewer passes this step than the most any rank will runs the
        difference as fully masked eager passes (exactly zero to gradients and metrics). Without this a tiny run on
        2 H200s hung at its first step with a new pack shape on one rank. Returns the most warm-up passes any rank
        runs this step (0 on one rank)."""
        if self.world.size == 1:
            return 0
        assert self.graphs is not None
        fit = [self._graph_key(mb, advantages.numel(), temperature) for mb in mbs
               if self.max_graph_tokens is None or mb.shape.full_tokens <= self.max_graph_tokens]
        mine = self.graphs.new_captures(fit) * self._capture_warmup()
        most = self.world.max_int(mine)
        for _ in range(most - mine):  # > 0: some rank has micro-batches, so every rank has
            self._accumulate(masked_copy(mbs[0]), norm, advantages, temperature)
        return most

    def sft_step(self, seqs: Sequence[TrainSequence]) -> dict[str, float]:
        """One supervised step: mean negative log-likelihood of the completion tokens (warm start)."""
        self.model.train()
        mbs, _ = self._my_micro_batches(seqs)
        ntok = max(1, sum(s.trained_tokens for s in seqs))  # the whole step's, on every rank
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for mb in mbs:
            lp = self.response_logprobs(self.model, mb, 1.0)
            loss = -(lp * mb.token_mask).sum() / ntok
            loss.backward()
            total += loss.detach().double()  # summed on the device: one sync per step, not per micro-batch
        self.world.all_reduce_(total)
        norm, skipped, lr = self._apply_gradients()
        loss, norm, skipped = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device).reshape(())
                                           for v in (total.squeeze(), norm, skipped)]).tolist()
        grad_norm, skipped = self._read_update(norm, skipped)
        return {"loss": loss, "grad_norm": grad_norm, "learning_rate": lr, "skipped": float(skipped)}

    def step(self, seqs: Sequence[TrainSequence], temperature: float = 1.0,
             after_update: Callable[[], None] | None = None) -> dict[str, float]:
        """One optimizer step over all `seqs` (accumulated over packed micro-batches). after_update: called once
        the update is queued and before the step's host sync (the RL loop's weight sync: on one GPU its copies are
        then queued while the backward runs, not after the host has waited for it)."""
        if not seqs:
            raise ValueError("trainer.step needs at least one sequence")
        cfg = self.cfg
        self.model.train()
        norm = LossNorm.for_step(cfg.loss, [s.trained_tokens for s in seqs], self.device)
        advantages = torch.tensor([s.advantage for s in seqs], dtype=torch.float32, device=self.device)
        mbs, real = self._my_micro_batches(seqs, self._cover(len(seqs), temperature))
        # the KL reference's and the teacher's log-probs, on these packs (before any capture or accumulation)
        frozen_s = {f: fill_frozen_logprobs(self, model, mbs, f, temperature) for f, model in self.frozen_models()}
        teacher_s = frozen_s.get("teacher_logprobs")
        keys: list[tuple | None] = [None] * len(mbs)
        if self.graphs is not None:
            # capture every new shape first: a capture's warm-up runs accumulate, and are then cleared
            warm_ups = self._match_capture_passes(mbs, norm, advantages, temperature)
            keys = [self._ensure_graph(mb, norm, advantages, temperature) for mb in mbs]
            if warm_ups:
                # a capture's reset clears its own rank's gradients, but each warm-up pass's reduce-scatter also
                # added its micro-batch to every other rank's shards: a rank that captured nothing after another's
                # warm-up (its masked passes came first) kept that in its update (2 GPUs: its weights 19% of the
                # steps' change away from eager's). Every rank clears the warm-ups' gradients here.
                self.optimizer.zero_grad(set_to_none=False)
            self.graphs.install_grads()
        self._acc.zero_()
        self._zero_acc_max()
        for mb, key in zip(mbs, keys, strict=True):
            if key is not None:
                self.graphs.replay(key, (mb, norm, advantages))
            else:
                self._accumulate(mb, norm, advantages, temperature)
        correction = cfg.loss.rollout_correction.enabled
        names = loss_metric_names(bool(mbs) and mbs[0].ref_logprobs is not None, correction)
        norm, skipped, lr = self._apply_gradients()
        if after_update is not None:
            after_update()
        # the step's one metrics sync (summed / maxed over ranks; the norm and skip are every rank's own)
        host, maxes, local = self._reduce_metrics([real, sum(mb.num_real_tokens for mb in mbs)], [norm, skipped])
        grad_norm, skipped = self._read_update(*local)
        sums = dict(zip(names, host, strict=False))
        k = len(names)
        d_sum, d_count, ent_sum, d_max = host[k], host[k + 1], host[k + 2], maxes[0]
        num_mbs, train_tokens = host[_METRIC_SLOTS], host[_METRIC_SLOTS + 1]
        if correction and mbs:
            sums[MAX_METRIC], sums[MIN_METRIC] = maxes[1], -maxes[2]
        out = {
            "loss": sums.get("loss", 0.0) if mbs else 0.0,
            "grad_norm": grad_norm,
            "learning_rate": lr,
            "entropy": ent_sum / d_count if d_count else 0.0,  # token mean over the step's trained tokens
            "logprob_diff_mean": d_sum / d_count if d_count else 0.0,
            "logprob_diff_max": d_max,
            "skipped": float(skipped),
            "micro_batches": int(num_mbs),  # over all ranks, real ones only
            "train_tokens": int(train_tokens),
        }
        out.update({k: v for k, v in sums.items() if k != "loss"} if mbs else {})
        if teacher_s is not None:  # the mean per-token reverse KL to the teacher over the trained tokens; its forward
            out |= {"teacher/kl": host[_TEACHER_SLOT] / d_count if d_count else 0.0, "time/teacher_s": teacher_s()}
        if self.router_tap is not None:
            out["moe/aux_loss"] = host[_AUX_SLOT]  # the step's load-balancing loss (before its coefficient)
        return out | (self.graphs.log.since_last_read() if self.graphs is not None else {})

    def release_graphs(self) -> None:
        """Drop the captured graphs (before the process group goes: `TrainGraphs.release`); a step recaptures."""
        if self.graphs is not None:
            self.graphs.release()

    def anchor_reference(self) -> None:
        """Make the KL reference (if any) a copy of the policy as it is now: call it where RL starts (after a
        warm start), so the penalty holds the policy near its RL starting point."""
        if self.ref_model is None:
            return
        if is_sharded(self.model):  # the reference is a full copy on every rank: gather into it
            from monorl.distributed.weight_sync import sync_weights_

            sync_weights_(self.ref_model, self.model)
        else:
            self.ref_model.load_state_dict(self.model.state_dict())  # in place, cast to the reference's dtype

    def state_dict(self) -> dict[str, Any]:
        """What a resumed trainer needs besides the policy's weights: optimizer moments, the schedule's position,
        the step count, and the KL reference's weights (when there is one)."""
        state: dict[str, Any] = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                                 "trainer_step_count": self.step_count}
        if self.ref_model is not None:
            state["ref_model"] = self.ref_model.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s state (optimizer moments move to the parameters' device). A state without a
        KL reference (saved with kl_coef 0, or by a monorl that did not store it) keeps the current one."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = int(state["trainer_step_count"])
        if self.ref_model is not None:
            if "ref_model" in state:
                self.ref_model.load_state_dict(state["ref_model"])
            else:
                log.warning("the checkpoint has no KL reference weights (saved with kl_coef 0, or by an older "
                            "monorl): the KL reference stays the model this trainer was given")
