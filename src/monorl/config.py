"""Run configuration: `RunConfig` composes the sections, each owned by the package that reads it (model, tasks, rl,
generate, compile, train, distributed); what differs between two configs (checked when a run is resumed). Named
presets: `presets.py`; the `--a.b value` overrides: `cliargs.py` (`run_config`); every `auto` setting is decided by
`assembly.resolve_config`, the one place a config changes after it is parsed."""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from monorl.compile import CompileConfig
from monorl.distributed.placement import PlacementSection
from monorl.distributed.world import DistributedSection
from monorl.fsutil import json_safe
from monorl.generate.generator import GeneratorConfig
from monorl.model.lora import LoRAConfig
from monorl.model.section import ModelSection
from monorl.rl.advantages import GROUPLESS_ADVANTAGE_KINDS
from monorl.rl.loggers import LoggingSection
from monorl.rl.sections import CheckpointSection, RolloutSection, ValidationSection, WarmStartSection
from monorl.tasks.section import TaskSection
from monorl.train.losses import SEQ_KINDS
from monorl.train.teacher import TeacherSection
from monorl.train.trainer_config import TrainerConfig

__all__ = ["CheckpointSection", "ModelSection", "RolloutSection", "RunConfig", "TaskSection", "TeacherSection",
           "ValidationSection", "WarmStartSection", "config_diff", "config_from_dict", "format_config_diff"]


@dataclass
class RunConfig:
    preset: str = "tiny"  # the named preset this config started from (monorl presets)
    seed: int = 0  # seeds prompts, sampling, and the random weights' init
    steps: int = 10  # RL steps
    device: str = "auto"  # auto (cuda if available) | cpu | cuda | cuda:N
    run_dir: str | None = None  # default: runs/<preset>-<time>
    samples_per_step: int = 4  # rollouts written to samples.jsonl each step
    # stop (with a checkpoint and a one-line reason) after this many steps in a row in which every group's rewards
    # were equal and the gradient was 0, at a reward below the earlier steps' mean: the policy collapsed and trains
    # on nothing (at or above it the policy converged: a warning, and the run goes on; a run without any signal
    # from its start is warned about once); 0: never
    stop_without_signal: int = 3
    # generator and trainer log-probs equal bit for bit (invariant kernels; docs/guides/parity.md). auto (the
    # Qwen3 presets'): on for full fine-tuning on CUDA, where it costs 1.02-1.14x of a step (Qwen3-0.6B/1.7B, H200);
    # off with LoRA (1.65x: unmerged adapters), on CPU (reference code) and for Qwen3.5's hybrids (its Gated DeltaNet
    # rule in the mode: tens of times a default step); `resolve_batch_invariant_`
    batch_invariant: bool | Literal["auto"] = False
    model: ModelSection = field(default_factory=ModelSection)  # the policy: a checkpoint or random weights
    task: TaskSection = field(default_factory=TaskSection)  # prompts and rewards
    rollout: RolloutSection = field(default_factory=RolloutSection)  # sampling and advantages of each step
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)  # the generation engine (KV cache, slots)
    compile: CompileConfig = field(default_factory=CompileConfig)  # torch.compile and CUDA graphs, both sides
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # optimizer, lr schedule, packing, loss
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # rank > 0: adapters on a frozen base (docs/guides/memory.md)
    # on-policy distillation: a frozen teacher's per-token reverse KL in the advantage (docs/guides/distillation.md)
    teacher: TeacherSection = field(default_factory=TeacherSection)
    validation: ValidationSection = field(default_factory=ValidationSection)  # held-out evaluation: greedy, or pass@k
    warm_start: WarmStartSection = field(default_factory=WarmStartSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    placement: PlacementSection = field(default_factory=PlacementSection)  # colocated, or generator ranks apart

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        # the group advantages score a completion against its group (advantage = reward - group mean): with one
        # completion per prompt every advantage is 0 and nothing is learned (TRL refuses it too); REINFORCE++
        # without baseline normalises over the batch and needs no group
        if self.rollout.group_size < 2 and self.rollout.advantage not in GROUPLESS_ADVANTAGE_KINDS:
            raise ValueError(f"rollout.group_size must be >= 2: advantage {self.rollout.advantage!r} uses the group "
                             f"as baseline, so a group of {self.rollout.group_size} has zero advantage "
                             f"(rollout.advantage {' / '.join(GROUPLESS_ADVANTAGE_KINDS)} needs no group)")
        # the teacher's advantage is per token; grpo / gspo take one ratio and one advantage per sequence
        if self.teacher.enabled and self.trainer.loss.kind in SEQ_KINDS:
            raise ValueError(f"teacher.path gives each token its own advantage, which trainer.loss.kind "
                             f"{self.trainer.loss.kind!r} (one per sequence) cannot take: use --trainer.loss.kind "
                             "token_grpo (or dapo, dr_grpo, cispo)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Keys older config.json files hold that no longer exist (the run's compile policy now drives the generator
# through `compile.*`): dropped when a run dir is read back, so its checkpoints still resume.
RETIRED_CONFIG_KEYS = ("generator.compile", "generator.compile_backend", "generator.compile_mode",
                       "generator.cuda_graphs", "generator.fuse_projections")


def config_from_dict(data: dict[str, Any], cls: type = RunConfig, where: str = "") -> Any:
    """Rebuild a config from its `to_dict()` form (a run's config.json). Keys it lacks keep their defaults
    (a run dir from before a section existed); retired keys are dropped; other keys the dataclass lacks raise
    ValueError naming them."""
    hints = typing.get_type_hints(cls)
    data = {k: v for k, v in data.items() if where + k not in RETIRED_CONFIG_KEYS}
    if unknown := sorted(set(data) - set(hints)):
        raise ValueError(f"unknown config keys: {', '.join(where + k for k in unknown)}")
    kw: dict[str, Any] = {}
    for name, v in data.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp) and isinstance(v, dict):
            kw[name] = config_from_dict(v, tp, f"{where}{name}.")
        elif isinstance(v, list) and any(t is tuple or typing.get_origin(t) is tuple
                                         for t in (tp, *typing.get_args(tp))):
            kw[name] = tuple(v)  # JSON has no tuples
        else:
            kw[name] = v
    return cls(**kw)


# ---- config changes on resume ---------------------------------------------------------------------

def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict) and d:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


# Keys (and sections) that do not change what a run computes: where it lives and where it reports to.
IGNORED_CONFIG_KEYS = ("run_dir", "logging")


def config_diff(old: dict[str, Any], new: dict[str, Any],
                ignore: tuple[str, ...] = IGNORED_CONFIG_KEYS) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every key that differs between two `to_dict()` configs,
    compared in their JSON form (tuples and lists alike)."""
    a = _flatten(json.loads(json.dumps(json_safe(old), default=str)))
    b = _flatten(json.loads(json.dumps(json_safe(new), default=str)))
    missing = object()
    return [(k, a.get(k, missing), b.get(k, missing)) for k in sorted(set(a) | set(b))
            if not any(k == i or k.startswith(f"{i}.") for i in ignore) and k not in RETIRED_CONFIG_KEYS
            and a.get(k, missing) != b.get(k, missing)]


def format_config_diff(diff: list[tuple[str, Any, Any]]) -> str:
    def show(v: Any) -> str:
        return "(absent)" if not isinstance(v, str | int | float | bool | list | dict | None) else json.dumps(v)

    return "\n".join(f"  {k}: {show(a)} -> {show(b)}" for k, a, b in diff)
