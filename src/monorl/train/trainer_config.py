"""The run config's `trainer` section: optimizer, lr schedule, packing, compute dtype, loss, trainer CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from monorl.train.losses import LossConfig
from monorl.train.optim import SCHEDULES, Schedule


@dataclass
class TrainerConfig:
    lr: float = 2e-6  # peak learning rate (AdamW)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.999  # AdamW beta2
    eps: float = 1e-8  # AdamW epsilon
    max_grad_norm: float = 1.0  # clip the global gradient norm to this
    warmup_steps: int = 2  # linear lr warmup steps
    schedule: Schedule = "linear"  # lr after warmup: linear or cosine decay to min_lr_ratio, or constant
    min_lr_ratio: float = 0.0  # the decay's final lr, as a fraction of lr
    micro_batch_tokens: int = 8192  # token budget of one packed micro-batch (whole sequences, shared prompts or not)
    # a prompt group's prompt packed once, its forward and backward run once for the group; attention still sees
    # every sequence whole, so each token's log-prob is the unshared one (monorl.train.packing)
    share_prompts: bool = True
    logprob_chunk: int = 1024  # rows of LM head + log-softmax at a time
    compute_dtype: Literal["auto", "bfloat16", "float32"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    # recompute each block's activations in backward (keeps only block inputs); none: on when the memory plan
    # says the run does not fit without it (monorl.plan)
    activation_checkpointing: bool | None = None
    loss: LossConfig = field(default_factory=LossConfig)  # the policy loss and the KL to the reference
    # mixture-of-experts policies: add the routers' load-balancing loss, weighted by config.json's
    # router_aux_loss_coef (off by default, as in transformers, whose output_router_logits is off)
    router_aux_loss: bool = False
    # with trainer CUDA graphs: a pack whose shape has no graph yet is padded to a captured shape that holds it when
    # that adds at most this share of its tokens and rows, or of micro_batch_tokens for a smaller pack (a capture
    # costs an eager pass and the capture, ~1 s for Qwen3-1.7B under FSDP; long-tailed batches make new shapes for
    # many steps: benchmarks/count_pack_shapes.py); 0: every new shape is captured
    graph_pad_slack: float = 0.25

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"trainer.lr must be > 0, got {self.lr}")
        if self.micro_batch_tokens < 16:
            raise ValueError(f"trainer.micro_batch_tokens must be >= 16, got {self.micro_batch_tokens}")
        if self.compute_dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"trainer.compute_dtype must be auto|bfloat16|float32, got {self.compute_dtype!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"trainer.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.max_grad_norm <= 0:
            raise ValueError(f"trainer.max_grad_norm must be > 0, got {self.max_grad_norm}")
        if self.graph_pad_slack < 0:
            raise ValueError(f"trainer.graph_pad_slack must be >= 0, got {self.graph_pad_slack}")
