"""`monorl plan`: a run's memory plan on one GPU, before anything is loaded, with the cheapest change that fits
when it does not: the run's own assembly (`monorl.assembly`) up to the plan, on a GPU of a given size."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from monorl.agent.task import AgentTask
from monorl.assembly import change_resolver, longest_fitting_prompt, resolve_config, resolve_teacher
from monorl.config import RunConfig
from monorl.distributed.world import World
from monorl.distributed.world_fit import check_world
from monorl.model.source import image_processor, resolve_model
from monorl.plan import advise, auto_checkpointing, plan_memory
from monorl.plan_images import image_tokens_bound, tool_image_tokens_bound
from monorl.plan_rewards import resolve_model_rewards
from monorl.task_registry import load_task, task_object
from monorl.tasks.base import TaskDataNotFound


def plan_report(cfg: RunConfig, device_bytes: int, sample: int = 32, ranks: int = 1) -> tuple[str, bool]:
    """The table, the verdict and (when it does not fit) the cheapest change, for `cfg` on one GPU of
    `device_bytes` (of `ranks` GPUs: an FSDP run's per-GPU plan); reads the model's config.json and tokenizer (never
    its weights) and the task's prompts when its data is at hand (`longest_prompt`), a vision-language policy's
    images (its prompts' and its tools') and a judge's or reward model's config. Returns (text, fits)."""
    check_world(cfg, World(size=ranks))  # a rank count that does not divide the step: the run's own one-line error
    m, tok, source = resolve_model(cfg.model)
    teacher = resolve_teacher(cfg, tok)
    tm = teacher[0] if teacher else None
    max_len = cfg.generator.max_model_len or m.max_position_embeddings
    longest, where, prompts = longest_prompt(cfg, tok, max_len, sample)
    processor = image_processor(cfg.model, m)
    longest += (images := image_tokens_bound(prompts, processor))  # as `build_run` adds them
    task = task_object(cfg.task.name)
    agent = isinstance(task, AgentTask) or (isinstance(task, type) and issubclass(task, AgentTask))
    beside = {"image_tokens": images, "rewards": resolve_model_rewards(cfg, longest, torch.bfloat16),
              "tool_image_tokens": tool_image_tokens_bound(cfg.rollout.max_tool_images, cfg.rollout.max_new_tokens,
                                                           agent, processor)}
    cuda = torch.device("cuda")
    apply = change_resolver(cfg, m, cuda)  # the advice's changes, resolved as applying them would
    cfg, notes = resolve_config(cfg, m, cuda)  # auto settings as a run on a GPU resolves them
    lines = [f"model: {source}", *([f"teacher: {teacher[2]}"] if teacher else []), where, *notes]
    if not cfg.placement.disaggregated:
        text, fits = _one_gpu(cfg, m, longest, device_bytes, ranks, "both", apply, tm, beside)
        return "\n".join([*lines, *([f"one GPU of {ranks} (FSDP2)"] if ranks > 1 else []), text]), fits
    # disaggregated: a generator GPU holds a copy and its KV cache, a trainer GPU its FSDP2 share of the trainer
    g = cfg.placement.generator_ranks
    gen, gen_fits = _one_gpu(cfg, m, longest, device_bytes, g, "generator", apply, tm, beside)
    tr, tr_fits = _one_gpu(cfg, m, longest, device_bytes, ranks - g, "trainer", apply, tm, beside)
    lines += [f"a generator GPU ({g} of {ranks}, each generating 1/{g} of the step's prompt groups):", gen,
              f"a trainer GPU ({ranks - g} of {ranks}, FSDP2 over them):", tr]
    return "\n".join(lines), gen_fits and tr_fits


def longest_prompt(cfg: RunConfig, tokenizer: Any, max_len: int, sample: int) -> tuple[int, str, list[Any]]:
    """(the longest training prompt the plan sizes with, in tokens; the line saying where that length comes from;
    the prompts read, for their images):
    the longest of the task's first `sample` training prompts that fits, as a run checks them; without the task's
    data (a plan needs shapes, not data) the longest the task declares (`Task.max_prompt_tokens`), else the longest
    the config lets fit (generator.max_model_len - rollout.max_new_tokens)."""
    new = cfg.rollout.max_new_tokens
    try:
        task = load_task(cfg.task.name, **cfg.task.args)
    except TaskDataNotFound as e:
        declared = getattr(task_object(cfg.task.name), "max_prompt_tokens", None)
        if declared is not None:
            longest, whose = min(declared, max_len - new), f"the longest prompt task {cfg.task.name!r} declares"
        else:
            longest, whose = max_len - new, f"generator.max_model_len {max_len} - rollout.max_new_tokens {new}"
        longest = max(longest, 1)
        return longest, (f"task data not read ({e}): planned from prompts of {longest} tokens ({whose}) and {new} "
                         "new tokens"), []
    prompts = list(itertools.islice(task.train_prompts(seed=cfg.seed), sample))
    longest = longest_fitting_prompt(task, tokenizer, prompts, max_len, new, "training") or 1
    return longest, f"longest of the first {len(prompts)} training prompts: {longest} tokens", prompts


def _one_gpu(cfg: RunConfig, m: Any, longest: int, device_bytes: int, ranks: int, role: str,
             apply: Callable[[dict[str, Any]], RunConfig], teacher: Any = None,
             beside: dict[str, Any] | None = None) -> tuple[str, bool]:
    """One GPU's table of `ranks` of this role (`plan_memory`; beside: its images and model-graded rewards), and the
    cheapest change when it does not fit (`advise`, its changes resolved by `apply`)."""
    beside = beside or {}
    ac = auto_checkpointing(cfg, m, longest, device_bytes, ranks=ranks, role=role, teacher=teacher, **beside)
    plan = plan_memory(cfg, m, longest, device_bytes, activation_checkpointing=ac, ranks=ranks, role=role,
                       teacher=teacher, **beside)
    lines = []
    if (tp := cfg.generator.tensor_parallel_size) > 1:
        lines.append(f"generator: tensor-parallel over {tp} GPUs ({ranks // tp} group(s) of {tp}, each generating "
                     f"1/{ranks // tp} of the step's prompt groups)")
    if ac and cfg.trainer.activation_checkpointing is None and role != "generator":
        lines.append("trainer.activation_checkpointing: on (auto: the run does not fit without it)")
    lines.append(plan.table())
    if not plan.fits:  # the colocated run's advice (a disaggregated GPU's own is not searched)
        lines.append("cheapest change that fits: " + advise(cfg, m, longest, device_bytes, ranks, apply, teacher,
                                                            **beside)[0])
    return "\n".join(lines), bool(plan.fits)
