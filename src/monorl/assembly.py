"""Assembly: a run's decisions, each made once, before anything heavy is built. `resolve_config` turns the
config a user gave into the one the run executes (a copy: paths absolute, `auto` settings decided); `build_run`
adds what the run reads before loading weights (architecture, tokenizer, task, prompts, memory plan). `train`,
`plan`, `eval`, `generate` and `parity` all start here.

Layering: assembly sits above the packages it assembles (model, generate, train, tasks, plan) and below `rl/`,
`eval/` and the CLI, which call it.
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from monorl.agent.task import AgentTask
from monorl.compile_auto import auto_backend, run_compile_key
from monorl.config import RunConfig
from monorl.config_paths import with_absolute_paths
from monorl.distributed.world import SINGLE, World
from monorl.model.config import ModelConfig
from monorl.model.section import ModelSection
from monorl.model.source import image_processor, resolve_model
from monorl.model.vocab_match import check_same_vocab
from monorl.plan import MemoryPlan, run_memory_plan, with_overrides
from monorl.plan_images import image_tokens_bound, tool_image_tokens_bound
from monorl.plan_rewards import resolve_model_rewards, size_judges_
from monorl.task_registry import load_task
from monorl.tasks.base import Prompt, Task
from monorl.tasks.rewards import OVERLONG

log = logging.getLogger("monorl")


def resolve_device(name: str, world: World = SINGLE) -> torch.device:
    """The run's device; on several ranks each takes its node's GPU LOCAL_RANK (`init_world` selected it)."""
    if world.size > 1 and (name.startswith("cuda") or (name == "auto" and torch.cuda.is_available())):
        return torch.device("cuda", world.local_rank)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return dev


def resolve_batch_invariant_(cfg: RunConfig, device: torch.device, m: ModelConfig | None = None) -> str | None:
    """Replace batch_invariant auto in `cfg` by what it means for this run: on for full fine-tuning on CUDA (cost
    1.02-1.14x of a step, Qwen3-0.6B/1.7B on an H200), off with LoRA (1.65x: the generator runs the adapters as
    separate matmuls, unmerged), on CPU (the invariant ops' reference path) and for a model `m` with Gated DeltaNet
    layers (the mode's rule is plain-PyTorch tree sums over materialised products, recomputing a whole 64-token
    chunk at every decode step: Qwen3.5-0.8B's W0 step did not finish its first step in ~115 s on an H100, against
    4.3 s in the default mode, 2026-12-07). Returns the line saying which, or None when it was not auto. Before
    anything reads it: the memory plan and the compile key depend on it."""
    if cfg.batch_invariant != "auto":
        return None
    hybrid = m is not None and "linear_attention" in m.layer_types
    cfg.batch_invariant = device.type == "cuda" and not cfg.lora.enabled and not hybrid
    if cfg.batch_invariant:
        why = "full fine-tuning on CUDA"
    elif cfg.lora.enabled or device.type != "cuda":
        why = "LoRA" if cfg.lora.enabled else device.type
    else:
        why = ("Gated DeltaNet layers: the mode's rule is plain PyTorch, tens of times a default step; "
               "batch_invariant true asks for it")
    return f"batch_invariant auto -> {str(cfg.batch_invariant).lower()} ({why})"


def resolve_compile_backend_(cfg: RunConfig, m: ModelConfig, device: torch.device) -> str | None:
    """Replace compile.backend auto in `cfg` by what `compile_auto.auto_backend` picks (before the memory plan, which
    depends on it); the line saying why, or None when the backend was not auto."""
    if cfg.compile.backend != "auto":
        return None
    cfg.compile.backend, why = auto_backend(cfg.steps, device, cfg.compile.cache_path, run_compile_key(cfg, m),
                                            cfg.batch_invariant)
    return why


def resolve_config(cfg: RunConfig, model_config: ModelConfig, device: torch.device,
                   world: World = SINGLE) -> tuple[RunConfig, list[str]]:
    """The config the run executes, as a copy of `cfg`: paths absolute (config.json names the same files from any
    directory), batch_invariant and compile.backend `auto` decided for this device (rank 0's choice on every rank),
    Dr.GRPO's normaliser defaulted to max_new_tokens. Returns (config, lines saying what `auto` chose)."""
    cfg = with_absolute_paths(copy.deepcopy(cfg))
    notes = [why for why in (resolve_batch_invariant_(cfg, device, model_config),
                             resolve_compile_backend_(cfg, model_config, device))
             if why]
    cfg.compile.backend = world.broadcast(cfg.compile.backend)  # rank 0's choice (its node's cache marker)
    loss = cfg.trainer.loss
    if loss.kind == "dr_grpo" and loss.dr_grpo_norm is None:
        loss.dr_grpo_norm = float(cfg.rollout.max_new_tokens)  # Dr.GRPO's constant normaliser
    return cfg, notes


def change_resolver(given: RunConfig, model_config: ModelConfig,
                    device: torch.device) -> Callable[[dict[str, Any]], RunConfig]:
    """What the memory plan's advice (`monorl.plan.advise`) plans a candidate change with: the config as `given` with
    the change's keys set, resolved as a run given those keys resolves it (one process: no collective)."""
    return lambda overrides: resolve_config(with_overrides(given, overrides), model_config, device)[0]


def longest_fitting_prompt(task: Task, tokenizer: Any, prompts: list[Prompt], max_len: int, new_tokens: int,
                           what: str) -> int | None:
    """The one prompt-fit check: refuse a context that fits none of `prompts` with room for `new_tokens` (every
    step would skip everything), warn when only some fit. A prompt is measured as the run renders it (`Task.render`:
    for an agent task, the episode's first conversation with its tool schemas and system prompt; an episode's
    context is max_model_len too). Returns the longest fitting prompt's length in tokens (None for no prompts)."""
    if not prompts:
        return None
    lengths = [len(tokenizer.encode(task.render(p, tokenizer))) for p in prompts]
    fit = [n for n in lengths if n + new_tokens <= max_len]
    if not fit:
        rendered = " (as its episode starts: tool schemas and system prompt included)" if isinstance(
            task, AgentTask) else ""
        raise ValueError(f"generator.max_model_len={max_len} fits none of the first {len(prompts)} {what} prompts: "
                         f"the shortest{rendered} is {min(lengths)} tokens and {new_tokens} new tokens must fit after "
                         f"it; raise generator.max_model_len to at least {min(lengths) + new_tokens} or lower "
                         "max_new_tokens")
    if len(fit) < len(prompts):
        log.warning("%d of the first %d %s prompts do not fit generator.max_model_len=%d with %d new tokens; they will "
                    "be skipped", len(prompts) - len(fit), len(prompts), what, max_len, new_tokens)
    return max(fit)


def reward_components(cfg: RunConfig, task: Task) -> tuple[str, ...]:
    """The training reward's components: the task's, and `OVERLONG` with rollout.overlong_buffer. Refuses a
    validation.pass_component the task does not have, and a task component named `OVERLONG`."""
    comps, v = task.reward_components, cfg.validation
    if v.pass_component is not None and v.pass_component not in comps:
        raise ValueError(f"validation.pass_component {v.pass_component!r} is not a reward component of task "
                         f"{task.name!r} ({', '.join(comps) or 'none'})")
    if cfg.rollout.overlong_buffer > 0:
        if OVERLONG in comps:
            raise ValueError(f"rollout.overlong_buffer adds a reward component {OVERLONG!r}, which task "
                             f"{task.name!r} already has")
        comps = (*comps, OVERLONG)
    return comps


def resolve_teacher(cfg: RunConfig, tokenizer: Any) -> tuple[ModelConfig, Any, str] | None:
    """The distillation teacher's architecture, tokenizer and source (teacher.path, read as model.path is, no
    weights), refused in one line when its tokenizer is not the student's; None without a teacher."""
    if not cfg.teacher.enabled:
        return None
    try:
        teacher = resolve_model(ModelSection(path=cfg.teacher.path))
    except (OSError, ValueError) as e:  # the model.path messages, said of the teacher
        raise ValueError(f"teacher.path {cfg.teacher.path}: {e}") from None
    check_same_vocab(tokenizer, teacher[1], f"teacher.path {cfg.teacher.path}")
    return teacher


@dataclass
class RunSpec:
    """What a run decided before loading weights (`build_run`)."""

    cfg: RunConfig  # resolved (`resolve_config`)
    device: torch.device
    model_config: ModelConfig
    tokenizer: Any
    model_source: str  # where the weights come from, in words
    task: Task
    max_len: int  # the generator's context: prompt + completion must fit
    val_prompts: list[Prompt]
    max_prompt_tokens: int  # the longest training prompt that fits (what the memory plan sizes packs with)
    components: tuple[str, ...]  # the training reward's components
    pass_component: str | None  # validation's pass/fail component (accuracy)
    warm_start_steps: int  # 0 when the task has no reference solutions
    plan: MemoryPlan | None = None
    teacher: tuple[ModelConfig, Any, str] | None = None  # the distillation teacher's `resolve_model` (teacher.path)
    processor: Any = None  # a vision-language policy's image processor (`image_processor`; None: text)
    notes: list[str] = field(default_factory=list)  # what resolving `auto` settings chose


def build_run(cfg: RunConfig, device: torch.device, world: World = SINGLE, plan: bool = True,
              sample: int = 32) -> RunSpec:
    """Resolve `cfg` and read what the run needs before any weights: the architecture and tokenizer, the task,
    the validation prompts, the prompt-fit check (the first `sample` training prompts of the seed's stream, which
    also surfaces a task's refusal of the seed), and (plan=True) the memory plan, which refuses a run that cannot
    fit. A default preset's warm start and validation need what a user's dataset may lack: they are skipped, saying
    so, rather than refused."""
    model_config, tokenizer, source = resolve_model(cfg.model)
    teacher = resolve_teacher(cfg, tokenizer)
    task: Task = load_task(cfg.task.name, **cfg.task.args)
    warm_start_steps = cfg.warm_start.steps
    if warm_start_steps > 0 and not ((hasattr(task, "solution") or hasattr(task, "solution_messages"))
                                     and getattr(task, "has_solutions", True)):
        print(f"warm start: skipped (task {task.name!r} has no reference solutions; warm_start.steps="
              f"{cfg.warm_start.steps} is ignored)", flush=True)
        warm_start_steps = 0
    num_val = cfg.validation.num_prompts
    if num_val > 0 and not task.has_held_out():
        print(f"validation: skipped (task {task.name!r} has no held-out split; validation.num_prompts={num_val} is "
              "ignored)", flush=True)
        num_val = 0
    max_len = cfg.generator.max_model_len or model_config.max_position_embeddings
    val_prompts = task.val_prompts(num_val)
    r, v = cfg.rollout, cfg.validation
    train = list(itertools.islice(task.train_prompts(seed=cfg.seed), sample))
    longest = longest_fitting_prompt(task, tokenizer, train, max_len, r.max_new_tokens, "training") or 1
    # a prompt's images at the processor's max_pixels: prompt tokens the plan sizes the KV cache and packs with
    processor = image_processor(cfg.model, model_config)
    longest += (image_tokens := image_tokens_bound(train, processor))
    tool_images = tool_image_tokens_bound(r.max_tool_images, r.max_new_tokens, isinstance(task, AgentTask), processor)
    # a judge's and a reward model's architectures; the judge's engine sized as the plan counts it
    rewards = resolve_model_rewards(cfg, longest, torch.bfloat16 if device.type == "cuda" else torch.float32)
    size_judges_(task, rewards)
    longest_fitting_prompt(task, tokenizer, val_prompts, max_len, v.max_new_tokens or r.max_new_tokens, "validation")
    components = reward_components(cfg, task)
    pass_component = v.pass_component or (task.reward_components or (None,))[0]
    given = cfg
    cfg, notes = resolve_config(cfg, model_config, device, world)  # before the plan, which reads what it decides
    spec = RunSpec(cfg, device, model_config, tokenizer, source, task, max_len, val_prompts, longest, components,
                   pass_component, warm_start_steps, teacher=teacher, processor=processor, notes=notes)
    if plan:
        spec.plan = run_memory_plan(cfg, model_config, longest, device, world.size, world.rank,
                                    change_resolver(given, model_config, device),
                                    teacher=teacher[0] if teacher else None, image_tokens=image_tokens,
                                    tool_image_tokens=tool_images, rewards=rewards)
    return spec
