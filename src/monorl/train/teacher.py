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
(`monorl.train.frozen`, as the KL reference's are; where the student's step replays CUDA graphs, each pack shape's
teacher forward replays one too); only the scored tokens' hidden states reach its LM head. The teacher is never
sampled from. Its forward's wall seconds (CUDA events on a GPU) are each step's metric `time/teacher_s` (part of
`time/train_s`)."""

from __future__ import annotations

from dataclasses import dataclass

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
