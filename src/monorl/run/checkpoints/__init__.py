"""A run's checkpoints: the training checkpoints a resume continues from (single-process files, or DCP shards
written by several ranks together), the final export (an HF checkpoint, or a LoRA run's PEFT adapter), and the
restore that puts a run back where a checkpoint left it (policy, optimizer, schedule, RNG, the producer's data
position)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from monorl.distributed.world import World
from monorl.model.config import ModelConfig
from monorl.model.decoder import DecoderForCausalLM, build_model
from monorl.model.hf_checkpoint import save_checkpoint
from monorl.model.image_processing import ImageProcessor
from monorl.model.lora import LoRAConfig, apply_lora_, is_lora, save_adapter, save_merged_checkpoint
from monorl.rl.rollouts.metrics import ValidationResult
from monorl.run.checkpoints.files import load_training_checkpoint, save_training_checkpoint
from monorl.run.checkpoints.sharded import (
    full_policy_on_main,
    is_sharded_checkpoint,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
from monorl.train.trainer import Trainer


@dataclass
class Restored:
    step: int  # the first step to run
    data_position: int  # the producer's next training prompt
    pre: ValidationResult  # the pre-training validation (a resume does not repeat it)
    num_tokens: int


class RunCheckpoints:
    def __init__(self, root: Path, policy: torch.nn.Module, trainer: Trainer, tokenizer: Any, world: World,
                 config_source: torch.nn.Module, keep_last: int, processor: ImageProcessor | None = None) -> None:
        """root: the run directory's checkpoints/; config_source: a module whose config the sharded export
        writes (the generator's full copy, or a trainer rank's policy); world: the ranks that hold the trainer
        state (a disaggregated run's trainers); processor: a vision-language policy's image processor, the run's
        (its files go in every checkpoint, so that transformers' AutoProcessor loads one)."""
        self.root, self.policy, self.trainer, self.tokenizer, self.world = root, policy, trainer, tokenizer, world
        self.processor = processor
        self.config_source, self.keep_last = config_source, keep_last

    def save(self, step: int, data_position: int, meta: dict[str, Any]) -> Path:
        """Checkpoint after `step` completed steps. Several ranks write one sharded (DCP) checkpoint together."""
        kw = {"data_position": data_position, "tokenizer": self.tokenizer, "meta": meta, "keep_last": self.keep_last,
              "processor": self.processor}
        if self.world.size > 1:
            return save_sharded_checkpoint(self.root, step, self.policy, self.trainer, self.world,
                                           config_source=self.config_source, **kw)
        return save_training_checkpoint(self.root, step, self.policy, self.trainer, **kw)

    def restore(self, path: Path) -> Restored:
        """Load a training checkpoint into the policy (in place) and the trainer."""
        if is_sharded_checkpoint(path):  # written by several ranks; loads on any number
            ckpt = load_sharded_checkpoint(path, self.policy, self.trainer, group=self.world.group)
        elif self.world.size > 1:
            raise ValueError(f"{path} is a single-process checkpoint, which resumes on one process only (runs on "
                             "several ranks write sharded checkpoints, which resume on any number)")
        else:
            ckpt = load_training_checkpoint(path, self.policy, self.trainer)
        pre = ckpt.meta.get("pre_validation")
        if not isinstance(pre, dict):
            raise ValueError(f"{path / 'meta.json'} has no pre_validation entry")
        return Restored(ckpt.step, ckpt.data_position, ValidationResult(**pre), int(ckpt.meta.get("num_tokens", 0)))

    def save_final(self, model_config: ModelConfig, lora: LoRAConfig, base_path: str | None, merged: bool) -> None:
        """checkpoints/final: the policy as an HF checkpoint (fp32); a LoRA run's adapter in PEFT's format (loads with
        `PeftModel.from_pretrained(base, dir)`), plus checkpoints/final_merged (base + adapters, the base's dtype)
        with `merged`."""
        final = self.root / "final"
        policy = self.policy
        if self.world.size > 1:  # gathered into one plain CPU copy on rank 0, which alone writes
            def plain_policy() -> DecoderForCausalLM:  # unsharded, on CPU, of the run's shape; values unset
                model = build_model(model_config, torch.device("cpu"), torch.float32, seed=None)
                if lora.enabled:
                    apply_lora_(model, lora, base_dtype=next(self.config_source.parameters()).dtype)
                return model

            policy = full_policy_on_main(policy, self.world, plain_policy)
            if policy is None:
                return
        if not is_lora(policy):
            save_checkpoint(policy, final, dtype=torch.float32, tokenizer=self.tokenizer, processor=self.processor)
            return
        save_adapter(policy, final, base_model_name_or_path=base_path)
        self.tokenizer.save(final)
        if merged:
            save_merged_checkpoint(policy, self.root / "final_merged", tokenizer=self.tokenizer,
                                   processor=self.processor)
