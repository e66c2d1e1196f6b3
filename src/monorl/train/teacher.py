"""On-policy distillation (`--teacher.path`): a frozen teacher scores every sampled token, and the per-token reverse
KL to it becomes a per-token advantage (Thinking Machines, "On-Policy Distillation", 2025; Qwen3's on-policy
distillation stage; Agarwal et al. 2024, GKD, with lmbda 1 and beta 1).

For a sampled completion token t, with logp_student the trainer's own forward of this step, detached (pi_old: one
optimizer step per batch, as the rollout correction takes it) and logp_teacher the teacher's, both at the rollout's
temperature (so a student equal to its teacher has KL 0 at any temperature, and the KL is 0 where the student's
logits are the teacher's; distill at temperature 1 to match the teacher's own distribution):

    kl_t        = logp_student(t) - logp_teacher(t)     a one-sample estimate of KL(student || teacher) at t
    advantage_t = -kl_coef * kl_t  (+ task_weight * the task's advantage of its sequence)

so the policy loss pushes up tokens the teacher finds likelier than the student does, and down the others. Only
trained tokens count (the loss mask: an episode's tool results and other inserted tokens are context only). The
teacher's log-probs come from a trainer-side forward over the student's own micro-batches, kept on the device
(`fill_teacher_logprobs`; where the student's step replays CUDA graphs, each pack shape's teacher forward replays one
too); only the scored tokens' hidden states reach its LM head. The teacher is never sampled from. Its forward's wall
seconds (CUDA events on a GPU) are each step's metric `time/teacher_s` (part of `time/train_s`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class TeacherSection:
    # a frozen teacher for on-policy distillation: the same kinds of checkpoint as model.path (an HF directory, a
    # GGUF file, a Hub name, a monorl run directory), with the student's tokenizer; None: no teacher
    path: str | None = None
    kl_coef: float = 1.0  # weight of the per-token reverse KL to the teacher in each token's advantage
    # weight of the task's reward advantage beside the teacher's (0: distillation alone; the task's rewards are
    # still computed and reported)
    task_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.kl_coef < 0:
            raise ValueError(f"teacher.kl_coef must be >= 0, got {self.kl_coef}")
        if self.task_weight < 0:
            raise ValueError(f"teacher.task_weight must be >= 0, got {self.task_weight}")

    @property
    def enabled(self) -> bool:
        return self.path is not None


def distillation_terms(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, kl_coef: float
                       ) -> tuple[Tensor, Tensor]:
    """Per completion token ([N] each): the advantage the teacher adds, ``-kl_coef * kl``, and the reverse-KL
    estimate ``kl = logp_student - logp_teacher`` (0 where `mask` is 0). Both detached. A `where`, not a product:
    a padded row's log-prob need not be finite."""
    kl = (student_logprobs.detach().float() - teacher_logprobs.float()).where(mask > 0, 0.0)
    return -kl_coef * kl, kl


def fill_teacher_logprobs(trainer: Any, mbs: list[Any], temperature: float) -> Callable[[], float]:
    """Give each of this rank's micro-batches `mbs` (in place) the teacher's log-probs of its completion tokens, on
    the device, from a forward over the student's own pack: no second packing, no host round trip of the
    log-probs. Returns what reads its seconds, the GPU's work included: on CUDA two events, read after the step's
    own metrics sync (no sync of its own)."""
    if trainer.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t = time.perf_counter()
    for i, mb in enumerate(mbs):
        mbs[i] = dataclasses.replace(mb, teacher_logprobs=teacher_forward(trainer, mb, temperature))
    if trainer.device.type != "cuda":
        seconds = time.perf_counter() - t
        return lambda: seconds
    end.record()
    return lambda: (end.synchronize(), start.elapsed_time(end) / 1e3)[1]


@torch.no_grad()
def teacher_forward(trainer: Any, mb: Any, temperature: float) -> Tensor:
    """The teacher's log-probs of one micro-batch's completion tokens ([N] fp32, on the device). Where the student's
    step replays graphs, so does this: a graph per pack shape in the trainer's pool (a forward alone: one launch
    for the eager forward's hundreds), its output copied out of the graph's buffer; else eagerly."""
    graphs = trainer.graphs
    if graphs is None or mb.images or graphs.full():
        return trainer.response_logprobs(trainer.teacher, mb, temperature)
    mb = dataclasses.replace(mb, teacher_logprobs=None)  # what it computes: never an input (a warm-up's zeros)
    key = ("teacher", mb.shape, float(temperature))
    if not graphs.has(key):
        out = torch.empty(mb.targets.shape, dtype=torch.float32, device=trainer.device)
        graphs.capture(key, lambda m: out.copy_(trainer.response_logprobs(trainer.teacher, m, temperature)), (mb,),
                       reset=lambda: None, warmup=1)
        trainer.teacher_out[key] = out
    graphs.replay(key, (mb,))
    return trainer.teacher_out[key].clone()  # the next pack of this shape replays into the same buffer
