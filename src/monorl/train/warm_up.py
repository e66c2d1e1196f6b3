"""The trainer's passes before the first step: compiling (`warm_up`: forward+backward on a step's full-size packs
and a smaller one, capturing the full-size packs' graphs) and tracing the kernels a step launches
(`trace_kernels`, for the start-up's precompile). Weights and optimizer state are untouched; the gradients and
metric sums are dropped after. A mixin of `Trainer`, whose packing and accumulation it runs."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from monorl.compile import is_compiled
from monorl.train.frozen import frozen_forward
from monorl.train.losses import LossNorm
from monorl.train.optim import launch_update_kernels
from monorl.train.packing import MicroBatch, TrainSequence


class TrainerWarmUps:
    """`Trainer`'s warm-ups (this class holds no state of its own)."""

    def _warm_up_packs(self, prompt_ids: list[int], num_seqs: int, completion_len: int, smaller: bool = True,
                       group_size: int = 1) -> list[tuple[MicroBatch, LossNorm, Tensor, bool]]:
        """The warm-up's micro-batches: a rank's share of the step's full-size packs (num_seqs rollouts of
        completion_len tokens, in groups of group_size that share a prompt, as a step's do) and (smaller) one that
        differs in every size Dynamo sees (tokens, sequences, max_seqlen), so it compiles them as dynamic once, here,
        instead of recompiling at the first real step. (mb, norm, advantages, full size)."""
        comp = (list(prompt_ids) * (completion_len // max(1, len(prompt_ids)) + 1))[:completion_len] or [0]
        # a rank trains its share of a step (`_my_share`): the packs of the largest share, the same on every rank (their
        # collectives pair up). The whole step's packs were larger than the graphs' pool is planned for: they ran
        # without graphs, and step 1's capture grew the pool after the KV cache had taken the rest (Qwen3-8B, 4 H100).
        # The norm and advantages stay the whole step's, as a step's are: a graph's key holds the step's sequence
        # count, and graphs captured under the share's count were never replayed (every step captured its own)
        share = -(-num_seqs // self.world.size)
        norm = LossNorm.for_step(self.cfg.loss, [len(comp)] * num_seqs, self.device)
        adv = torch.ones(num_seqs, device=self.device)
        sizes = [(share, comp)] + ([(max(1, share // 4), comp[: max(1, len(comp) // 2)])] if smaller else [])
        packs = []
        for i, (n, c) in enumerate(sizes):
            # with a KL term the step's packs carry reference log-probs: so do these (the same graph key and code),
            # and a teacher's with distillation (`Trainer.frozen_models`; a step's are filled after packing)
            ref = [0.0] * len(c) if self.cfg.loss.kl_coef > 0 else None
            teacher = [0.0] * len(c) if self.teacher is not None else None
            seqs = [TrainSequence(list(prompt_ids), c, [0.0] * len(c), 1.0, ref_logprobs=ref,
                                  group=j // max(1, group_size), teacher_logprobs=teacher) for j in range(n)]
            packs += [(mb, norm, adv, i == 0) for mb in self._micro_batches(seqs)]
        return packs

    def warm_up(self, prompt_ids: list[int], num_seqs: int, completion_len: int, temperature: float = 1.0,
                group_size: int = 1) -> None:
        """Compile ahead of the first step: forward+backward on `_warm_up_packs`; with CUDA graphs, also capture
        the full-size packs' graphs. Then drop the gradients and metric sums. Weights and optimizer state are
        untouched. A model that is not compiled skips the eager passes when graphs are captured: the capture's
        own warm-up pass does what they did (first launches, cuBLAS and autograd set-up), and the smaller pack
        is only there for Dynamo."""
        self.model.train()
        full = []
        eager = self.graphs is None or is_compiled(self.model)
        for mb, norm, adv, is_full in self._warm_up_packs(prompt_ids, num_seqs, completion_len, smaller=eager,
                                                          group_size=group_size):
            if eager:
                self._accumulate(mb, norm, adv, temperature)
            full += [(mb, norm, adv)] if is_full else []
        if self.graphs is not None:  # after compiling, so capture time is only capture
            if self.device.type == "cuda" and eager:
                # the eager passes' freed blocks back to the driver before the graphs' pool takes its own: cached,
                # they doubled the reserved peak (1.7B: 116.9 GiB reserved for 62.3 allocated; traced on an H200)
                torch.cuda.empty_cache()
            for mb, norm, adv in full:
                self._ensure_graph(mb, norm, adv, temperature)
                for field, model in self.frozen_models():  # and the KL reference's, the teacher's forward of it
                    frozen_forward(self, model, mb, field, temperature)
        self._reset_accumulators()

    def trace_kernels(self, prompt_ids: list[int], num_seqs: int, completion_len: int, temperature: float,
                      first_pass: contextlib.AbstractContextManager | None = None, group_size: int = 1) -> None:
        """The warm-up's eager passes without graphs, for `monorl.speedups.precompile.recording()` to see the Triton
        kernels they launch (their outputs are garbage there: dropped with the gradients and metric sums).
        first_pass: a context the first pass alone runs in (the run's ATen op recorder)."""
        self.model.train()
        for i, (mb, norm, adv, _) in enumerate(self._warm_up_packs(prompt_ids, num_seqs, completion_len,
                                                                   group_size=group_size)):
            with first_pass if first_pass is not None and i == 0 else contextlib.nullcontext():
                self._accumulate(mb, norm, adv, temperature)
                if i == 0:  # the update's kernels too (on a throwaway parameter): else step 1 loads them
                    launch_update_kernels(self.device, self._update_on_device())
        self._reset_accumulators()
