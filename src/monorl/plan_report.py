"""`monorl plan`: a run's memory plan on one GPU, before anything is loaded, with the cheapest change that fits
when it does not: the run's own assembly (`monorl.assembly`) up to the plan, on a GPU of a given size."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from monorl.assembly import longest_fitting_prompt, resolve_config
from monorl.config import RunConfig
from monorl.distributed.world import World, check_world
from monorl.model.source import resolve_model
from monorl.plan import advise, auto_checkpointing, plan_memory
from monorl.tasks import load_task


def plan_report(cfg: RunConfig, device_bytes: int, sample: int = 32, ranks: int = 1) -> tuple[str, bool]:
    """The table, the verdict and (when it does not fit) the cheapest change, for `cfg` on one GPU of
    `device_bytes` (of `ranks` GPUs: an FSDP run's per-GPU plan); reads the model's config.json and tokenizer (never
    its weights) and the task's prompts. Returns (text, fits)."""
    check_world(cfg, World(size=ranks))  # a rank count that does not divide the step: the run's own one-line error
    m, tok, source = resolve_model(cfg.model)
    task = load_task(cfg.task.name, **cfg.task.args)
    max_len = cfg.generator.max_model_len or m.max_position_embeddings
    prompts = list(itertools.islice(task.train_prompts(seed=cfg.seed), sample))
    longest = longest_fitting_prompt(task, tok, prompts, max_len, cfg.rollout.max_new_tokens, "training") or 1
    cfg, notes = resolve_config(cfg, m, torch.device("cuda"))  # auto settings as a run on a GPU resolves them
    lines = [f"model: {source}", f"longest of the first {len(prompts)} training prompts: {longest} tokens", *notes]
    if not cfg.placement.disaggregated:
        text, fits = _one_gpu(cfg, m, longest, device_bytes, ranks, "both")
        return "\n".join([*lines, *([f"one GPU of {ranks} (FSDP2)"] if ranks > 1 else []), text]), fits
    # disaggregated: a generator GPU holds a copy and its KV cache, a trainer GPU its FSDP2 share of the trainer
    g = cfg.placement.generator_ranks
    gen, gen_fits = _one_gpu(cfg, m, longest, device_bytes, g, "generator")
    tr, tr_fits = _one_gpu(cfg, m, longest, device_bytes, ranks - g, "trainer")
    lines += [f"a generator GPU ({g} of {ranks}, each generating 1/{g} of the step's prompt groups):", gen,
              f"a trainer GPU ({ranks - g} of {ranks}, FSDP2 over them):", tr]
    return "\n".join(lines), gen_fits and tr_fits


def _one_gpu(cfg: RunConfig, m: Any, longest: int, device_bytes: int, ranks: int, role: str) -> tuple[str, bool]:
    """One GPU's table of `ranks` of this role (`plan_memory`), and the cheapest change when it does not fit."""
    ac = auto_checkpointing(cfg, m, longest, device_bytes, ranks=ranks, role=role)
    plan = plan_memory(cfg, m, longest, device_bytes, activation_checkpointing=ac, ranks=ranks, role=role)
    lines = []
    if (tp := cfg.generator.tensor_parallel_size) > 1:
        lines.append(f"generator: tensor-parallel over {tp} GPUs ({ranks // tp} group(s) of {tp}, each generating "
                     f"1/{ranks // tp} of the step's prompt groups)")
    if ac and cfg.trainer.activation_checkpointing is None and role != "generator":
        lines.append("trainer.activation_checkpointing: on (auto: the run does not fit without it)")
    lines.append(plan.table())
    if not plan.fits:  # the colocated run's advice (a disaggregated GPU's own is not searched)
        lines.append("cheapest change that fits: " + advise(cfg, m, longest, device_bytes, ranks)[0])
    return "\n".join(lines), bool(plan.fits)
