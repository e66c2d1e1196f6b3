"""A run's parts, built from the resolved config: `start_parts` does what every rank does first (the world, the
placement, the resume point, the resolved config and memory plan: `monorl.assembly.build_run`), then the placement's
own `build` (`run/placements.py`) adds the parts its ranks hold with the builders here, one per part, each taking
its config section(s). No builder asks which placement it serves: a placement is the list of builders it calls."""

from __future__ import annotations

import copy
import dataclasses
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from monorl.assembly import RunSpec, build_run, resolve_device
from monorl.compile import compile_blocks, setup_compile_cache
from monorl.config import RunConfig
from monorl.distributed.fsdp import shard_model_
from monorl.distributed.placement import Placement
from monorl.distributed.world import World, init_world
from monorl.distributed.world_fit import check_world
from monorl.fsutil import json_safe
from monorl.generate.build import build_generator, generator_group
from monorl.generate.generator import Generator, generator_dtype
from monorl.model.attention import resolve_backend
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.lora import apply_lora_
from monorl.model.qwen3_vl import freeze_vision_
from monorl.model.section import ModelSection
from monorl.model.source import load_policy
from monorl.rl.consumer import Publish, TrainerConsumer
from monorl.rl.loggers import check_loggers, open_loggers
from monorl.rl.ranks.weight_broadcast import WeightBroadcast
from monorl.rl.rollouts.producer import RolloutProducer
from monorl.rl.rollouts.sources import RolloutSource
from monorl.run.checkpoints import RunCheckpoints
from monorl.run.checkpoints.files import check_resume_point, find_checkpoint
from monorl.run.elastic import restart_count
from monorl.run.run_dir import RunDir
from monorl.run.startup import Startup
from monorl.train.trainer import Trainer

log = logging.getLogger("monorl")


@dataclass
class Parts:
    """What one rank holds; a placement's `build` fills the parts its ranks use (the others stay None)."""

    cfg: RunConfig  # the resolved config (`spec.cfg`)
    spec: RunSpec
    world: World
    placement: Placement
    device: torch.device
    boot: Startup
    resume_from: Path | None
    t_start: float
    policy: Any = None  # the trainer's policy (a generator rank drops the one it loaded)
    generator: Generator | None = None
    trainer: Trainer | None = None
    producer: RolloutProducer | None = None
    consumer: TrainerConsumer | None = None
    rollouts: RolloutSource | None = None
    checkpoints: RunCheckpoints | None = None
    run_dir: RunDir = None  # type: ignore[assignment]
    weights: WeightBroadcast | None = None  # disaggregated: the trainers' updates to the generators
    attn_backend: str = "sdpa"
    gen_dtype: torch.dtype = torch.float32
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def train_world(self) -> World:
        return self.placement.trainer_world

    @property
    def plan(self) -> Any:
        return self.spec.plan

    @property
    def tokenizer(self) -> Any:
        return self.spec.tokenizer

    @property
    def task(self) -> Any:
        return self.spec.task

    @property
    def startup(self) -> dict[str, float]:
        return self.boot.timings


def start_parts(cfg: RunConfig, resume: str | Path | None, world: World | None) -> Parts:
    """Every rank's start: the world and its placement, the resume point (checked before any work), the seeds, the
    start-up timer, and the resolved config with its memory plan (which refuses a run that cannot fit before any
    weights are read)."""
    world = init_world(cfg.device, cfg.distributed.timeout_s, cfg.distributed.backend) if world is None else world
    check_world(cfg, world)
    # colocated: every rank generates and trains; disaggregated: the last G ranks generate, the others train
    placement = Placement.build(world, cfg.placement)
    t_start = time.perf_counter()
    resume_from = find_checkpoint(resume) if resume is not None else None
    if resume_from is not None:
        check_resume_point(resume_from)
    elif cfg.run_dir and restart_count() == 0:  # a restarted job (torchrun) starts over in its own directory
        # rank 0 looks, before any rank could have written there, and every rank gets its verdict
        refused = ""
        if world.is_main:
            try:
                RunDir.check_new(cfg.run_dir)
            except ValueError as e:
                refused = str(e)
        if refused := world.broadcast(refused):
            raise ValueError(refused)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device, world)
    check_loggers(cfg.logging)  # a missing optional extra fails before any work
    boot = Startup(cfg, device, placement.role_world)
    if device.type == "cuda":  # the CUDA context, timed apart from the work that would trigger it
        with boot.timed("cuda_init_s"):
            torch.empty(1, device=device)
    with boot.timed("prepare_s"):
        spec = build_run(cfg, device, world)
    for note in spec.notes:
        print(note, flush=True)
    boot.cfg = spec.cfg
    boot.plan_aten_preload(spec)  # its key, taken before construction adjusts anything
    gen_dtype = generator_dtype(spec.cfg.generator.dtype, device)
    return Parts(spec.cfg, spec, world, placement, device, boot, resume_from, t_start, gen_dtype=gen_dtype)


def load_policy_part(p: Parts) -> None:
    """The policy (LoRA: the frozen base held once, in the compute dtype, no fp32 master), the compile cache and the
    attention backend."""
    cfg = p.cfg
    with p.boot.timed("model_load_s"):
        p.policy, _, _ = load_policy(cfg.model, p.device, dtype=p.gen_dtype if cfg.lora.enabled else torch.float32,
                                     resolved=(p.spec.model_config, p.tokenizer, p.spec.model_source))
        if cfg.model.freeze_vision and not freeze_vision_(p.policy):
            log.warning("--model.freeze_vision: the model has no vision tower; nothing to freeze")
        if cfg.lora.enabled:
            apply_lora_(p.policy, cfg.lora, seed=cfg.model.init_seed, base_dtype=p.gen_dtype)
        p.policy.activation_checkpointing = p.plan.activation_checkpointing
    p.boot.compile_cache = setup_compile_cache(cfg.compile)
    p.attn_backend = resolve_backend(cfg.model.attn_backend, p.device, p.gen_dtype)


def generator_builder(p: Parts) -> Callable[[], Generator]:
    """The generator's copy of the policy (`generate/build.py`: in gen_dtype, fused projections, LoRA merged in),
    under the run's compile policy; batch-invariant runs make the policy invariant first. On CUDA its KV cache is
    sized after the trainer's warm-up has measured what training needs (`Startup.size_kv_cache`). Every rank
    creates every tensor-parallel group (--generator.tensor_parallel_size N: N consecutive ranks hold one copy)."""
    cfg = p.cfg
    tp = generator_group(cfg, p.world)
    if cfg.batch_invariant and p.device.type != "cuda":
        log.warning("batch_invariant on %s runs the invariant ops' reference path (fixed-order tree sums, many times "
                    "slower than the default kernels); --batch_invariant false for a quick run", p.device.type)
    if cfg.batch_invariant:
        make_batch_invariant_(p.policy)
    processor = p.spec.processor  # a vision-language policy's (None: text)

    def build() -> Generator:
        gen = build_generator(p.policy, cfg, p.tokenizer, tp, cfg.compile, allocate_kv=p.device.type != "cuda")
        gen.image_processor = processor
        return gen
    return build


def prepare_trainer_policy(p: Parts) -> torch.nn.Module | None:
    """The trainer's side of the policy: the KL reference (a copy; `run` sets it to the policy RL starts from),
    compiled blocks (before sharding: FSDP's hooks stay outside them), FSDP2 shards over the trainer ranks (after
    the reference copied the full weights). Returns the KL reference."""
    cfg = p.cfg
    p.boot.start_aten_preload()
    ref_model = None
    if cfg.trainer.loss.kl_coef > 0:
        ref_model = copy.deepcopy(p.policy).to(p.gen_dtype).eval().requires_grad_(False)
    if cfg.compile.enabled and cfg.compile.trainer:
        compile_blocks(p.policy, cfg.compile)
    if p.train_world.size > 1:
        shard_model_(p.policy, p.device, group=p.train_world.group)
    return ref_model


def build_teacher(p: Parts) -> torch.nn.Module | None:
    """The distillation teacher (`--teacher.path`), where the trainer is: a frozen model loaded by the policy's
    loader (any checkpoint kind model.path takes) in the generator's dtype (bf16 on CUDA), sharded over the trainer
    ranks as the policy is (FSDP2: a block gathered at a time; every rank runs as many forwards, the trainer pads
    its micro-batches to the most any rank has); batch-invariant like the policy in batch-invariant runs. None
    without a teacher."""
    t = p.cfg.teacher
    if not t.enabled:
        return None
    with p.boot.timed("teacher_load_s"):
        teacher, _, _ = load_policy(ModelSection(path=t.path), p.device, dtype=p.gen_dtype,
                                    resolved=p.spec.teacher)
    if p.cfg.batch_invariant:
        make_batch_invariant_(teacher)
    teacher.eval().requires_grad_(False)
    if p.train_world.size > 1:
        shard_model_(teacher, p.device, group=p.train_world.group)
        if p.world.is_main:
            print(f"teacher: sharded over the {p.train_world.size} trainer ranks", flush=True)
    return teacher


def build_trainer(p: Parts, ref_model: torch.nn.Module | None) -> Trainer:
    cfg = p.cfg
    trainer_cfg = cfg.trainer
    if cfg.batch_invariant:  # the trainer computes in the generator's dtype (its autocast dtype: see Trainer)
        trainer_cfg = dataclasses.replace(trainer_cfg, compute_dtype=str(p.gen_dtype).removeprefix("torch."))
    return Trainer(p.policy, trainer_cfg, total_steps=cfg.steps,
                   attn_backend="flash" if p.attn_backend == "flash" else "sdpa", ref_model=ref_model,
                   cuda_graphs=cfg.compile.trainer_cuda_graphs, max_graph_tokens=p.plan.micro_batch_tokens,
                   world=p.train_world, teacher=build_teacher(p), distill=cfg.teacher)


def build_producer(p: Parts, generator: Generator, policy_version: Callable[[], int]) -> RolloutProducer:
    return RolloutProducer(p.spec, generator, p.placement.generator_world, policy_version)


def build_consumer(p: Parts, trainer: Trainer, publish: Publish, routing_model: torch.nn.Module | None
                   ) -> TrainerConsumer:
    task_weight = p.cfg.teacher.task_weight if p.cfg.teacher.enabled else 1.0
    return TrainerConsumer(p.cfg.rollout, p.cfg.trainer.loss.kind, trainer, publish, p.device, routing_model,
                           task_weight)


def open_run_dir(p: Parts) -> RunDir:
    """The run directory, created last, so a bad config, checkpoint or data file leaves no empty one behind: rank 0
    names it (a default path holds the time) and alone writes it (config.json; TensorBoard / W&B loggers)."""
    cfg, world = p.cfg, p.world
    run_dir = RunDir(world.broadcast(cfg.run_dir or str(RunDir.default_path(cfg.preset))), writer=world.is_main)
    run_dir.write_config(cfg.to_dict())
    if world.is_main:
        run_dir.loggers = open_loggers(cfg.logging, run_dir.path, json_safe(cfg.to_dict()))
    return run_dir


def join_run_dir(p: Parts) -> RunDir:
    """The run directory rank 0 named, for a rank that writes nothing there (a generator rank)."""
    return RunDir(p.world.broadcast(p.cfg.run_dir), writer=False)


def build_checkpoints(p: Parts, config_source: torch.nn.Module) -> RunCheckpoints:
    """config_source: a module whose config the sharded export writes (the generator's full copy, or the policy)."""
    return RunCheckpoints(p.run_dir.checkpoints, p.policy, p.trainer, p.tokenizer, p.train_world,
                          keep_last=p.cfg.checkpoint.keep_last, config_source=config_source,
                          processor=p.spec.processor)
