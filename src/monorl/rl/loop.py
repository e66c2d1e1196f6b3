"""The GRPO loop: sample prompts -> n completions each -> rewards (-> DAPO's dynamic sampling) -> advantages ->
train -> weight sync, with validation (greedy, or pass@k) before the first step, every validation.every steps,
and after the last."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import itertools
import logging
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from monorl.compile import compile_blocks, compile_counters, is_compiled, setup_compile_cache
from monorl.compile_auto import mark_compiled, resolve_auto_, run_aten_key, run_compile_key, run_kernels_key
from monorl.config import RunConfig, resolve_batch_invariant_
from monorl.config_paths import with_absolute_paths
from monorl.console import best_effort
from monorl.distributed.checkpoint import (
    full_policy_on_main,
    is_sharded_checkpoint,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
from monorl.distributed.elastic import die_for_test, restart_count, restart_resume_path
from monorl.distributed.fsdp import shard_model_
from monorl.distributed.world import SINGLE, World, check_world, close_world, init_world, quiet_unless_main
from monorl.fsutil import json_safe
from monorl.generate.engine import Generator
from monorl.generate.kv_cache import kv_cache_bytes_needed
from monorl.generate.sampling import SamplingParams
from monorl.model.attention import resolve_backend
from monorl.model.batch_invariant import is_batch_invariant, make_batch_invariant_
from monorl.model.checkpoint import load_checkpoint, load_config, save_checkpoint
from monorl.model.config import MODEL_SHAPES, ModelConfig, model_shape
from monorl.model.hub import resolve_model_path
from monorl.model.lora import apply_lora_, is_lora, save_adapter, save_merged_checkpoint
from monorl.model.qwen3 import Qwen3ForCausalLM, build_model
from monorl.model.tokenizer import TOKENIZER_FILE, CharTokenizer, eos_ids, load_tokenizer
from monorl.ops import HAS_TRITON
from monorl.ops.precompile import (
    TritonKeyPrefetch,
    compile_ahead,
    default_threads,
    load_specs,
    recording,
    save_specs,
    specs_path,
)
from monorl.ops.preload import AtenRecorder, Preload, save_ops, start_preload
from monorl.plan import GiB, run_memory_plan
from monorl.rl.checkpointing import (
    check_resume_point,
    find_checkpoint,
    load_training_checkpoint,
    save_training_checkpoint,
    step_checkpoints,
)
from monorl.rl.dynamic_sampling import fill_batch, sampling_metric
from monorl.rl.loggers import check_loggers, open_loggers
from monorl.rl.rollouts import (
    OVERLONG,
    Rollout,
    add_overlong_penalty,
    assign_advantages,
    encode_prompts,
    generate_rollouts,
)
from monorl.rl.run_dir import RunDir
from monorl.rl.stopping import GracefulStop
from monorl.rl.summary import (
    RunResult,
    ValidationResult,
    compile_roi,
    format_duration,
    sample_rows,
    step_line,
    step_metrics,
    summarize,
    trainer_graph_stats,
    write_summary,
)
from monorl.rl.weight_sync import sync_weights_
from monorl.tasks import load_task
from monorl.tasks.base import RewardError, Task
from monorl.tasks.reward_context import RewardContext
from monorl.tasks.stream import PromptStream
from monorl.train.packing import TrainSequence
from monorl.train.trainer import Trainer, TrainerConfig

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


def resolve_model(cfg: RunConfig) -> tuple[ModelConfig, Any, str]:
    """The policy's architecture, its tokenizer, and a line saying where its weights will come from -- without
    reading any weights (the memory plan runs on this): a checkpoint's weights (`model.path`), random weights of
    its config.json (`model.path` + `model.random_init`), or random weights of a named shape (`model.shape`, no
    path). A path always means "load these weights" unless random_init is set: a preset's shape never overrides
    it."""
    m = cfg.model
    if m.path:
        path, origin = resolve_model_path(m.path)  # a local directory, or a Hub name through its cache
        mcfg = load_config(path)  # names a missing directory or config.json first
        if not (path / TOKENIZER_FILE).is_file():  # the char tokenizer would silently mis-tokenize a real vocab
            raise FileNotFoundError(f"model.path {path} has no {TOKENIZER_FILE}: copy the model's tokenizer files "
                                    "there (tokenizer.json, tokenizer_config.json)")
        tok = load_tokenizer(path)
        if m.random_init:
            source = f"random init (seed {m.init_seed}) of {path / 'config.json'} (model.random_init=true)"
        else:
            source = f"weights of {path}{origin}"
    else:
        if m.shape is None:
            raise ValueError("model.path is not set: give --model.path <HF checkpoint dir>, or --model.shape NAME for "
                             f"random weights of a named shape ({', '.join(MODEL_SHAPES)})")
        mcfg = model_shape(m.shape)
        tok = CharTokenizer()
        source = f"random init (seed {m.init_seed}) of shape {m.shape!r}"
    if tok.vocab_size > mcfg.vocab_size:
        raise ValueError(f"tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {mcfg.vocab_size}")
    return mcfg, tok, source


def load_policy(cfg: RunConfig, device: torch.device, dtype: torch.dtype = torch.float32,
                resolved: tuple[ModelConfig, Any, str] | None = None) -> tuple[Qwen3ForCausalLM, Any, str]:
    """The policy (in `dtype`: the trainer's fp32 masters, or a LoRA run's frozen base), its tokenizer, and the
    line `resolve_model` gives (pass its result as `resolved` when already at hand: a real tokenizer takes ~1 s
    to read)."""
    mcfg, tok, source = resolved or resolve_model(cfg)
    m = cfg.model
    if m.path and not m.random_init:
        model = load_checkpoint(resolve_model_path(m.path)[0], device=device, dtype=dtype)
    else:
        model = build_model(mcfg, device, dtype, seed=m.init_seed)
    return model, tok, source


class GRPORun:
    """Holds the pieces of one run; `run()` executes it."""

    def __init__(self, cfg: RunConfig, progress: bool = True, resume: str | Path | None = None,
                 world: World | None = None) -> None:
        """world: this process among the run's ranks (default: torchrun's, joined here; one process outside
        torchrun). Several ranks shard the trainer (FSDP2) and split each step's prompt groups."""
        self.cfg, self.progress = cfg, progress
        self.world = world = init_world(cfg.device, cfg.distributed.timeout_s,
                                        cfg.distributed.backend) if world is None else world
        check_world(cfg, world)
        self.t_start = time.perf_counter()
        self.phase_s = {"warm_start_s": 0.0, "validation_s": 0.0, "checkpoint_s": 0.0}
        # a run dir or checkpoint dir to continue from; resolved first so a bad path fails before any work
        self.resume_from = find_checkpoint(resume) if resume is not None else None
        if self.resume_from is not None:
            check_resume_point(self.resume_from)
        elif cfg.run_dir and restart_count() == 0:  # a restarted job (torchrun) starts over in its own directory
            RunDir.check_new(cfg.run_dir)
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.device = resolve_device(cfg.device, world)
        check_loggers(cfg.logging)  # a missing optional extra fails before any work
        self.startup: dict[str, float] = {}
        self.compile_s = 0.0

        # Triton's cache key, computed by a child process meanwhile (see `compile_kernels_ahead`)
        self.triton_key = (TritonKeyPrefetch() if self.device.type == "cuda" and cfg.compile.kernel_compile_threads
                           != 1 else None)
        t = time.perf_counter()
        if self.device.type == "cuda":  # the CUDA context, timed apart from the work that would trigger it
            torch.empty(1, device=self.device)
            self.startup["cuda_init_s"] = time.perf_counter() - t
            t = time.perf_counter()
        # architecture, tokenizer, task and prompts first: the memory plan needs them, and refuses a run that cannot
        # fit before any weights are read
        self.model_config, self.tokenizer, self.model_source = resolve_model(cfg)
        self.task: Task = load_task(cfg.task.name, **cfg.task.args)
        # the default preset's warm start and validation need what a user's dataset may lack: skip them, saying so
        self.warm_start_steps = cfg.warm_start.steps
        if self.warm_start_steps > 0 and not hasattr(self.task, "solution"):
            print(f"warm start: skipped (task {self.task.name!r} has no reference solutions; warm_start.steps="
                  f"{cfg.warm_start.steps} is ignored)", flush=True)
            self.warm_start_steps = 0
        num_val = cfg.validation.num_prompts
        if num_val > 0 and not self.task.has_held_out():
            print(f"validation: skipped (task {self.task.name!r} has no held-out split; validation.num_prompts="
                  f"{num_val} is ignored)", flush=True)
            num_val = 0
        # prompt + completion must fit the generator's context
        self.max_len = cfg.generator.max_model_len or self.model_config.max_position_embeddings
        self.train_prompts = PromptStream(self.task, cfg.seed)  # knows its position, for checkpoints
        # (max_new_tokens, prompts, encode_prompts' result) of the next step's first prompts (`encode_ahead`)
        self.encoded_ahead: tuple[int, list, tuple[list, list[list[int]]]] | None = None
        self.val_prompts = self.task.val_prompts(num_val)
        self.max_prompt_tokens = self.check_prompts_fit()
        self.components = self.check_components()
        self.pass_component = cfg.validation.pass_component or (self.task.reward_components or (None,))[0]
        # what dynamic sampling's filter reads (default: the pass component, as DAPO filters on accuracy)
        self.sampling_metric = sampling_metric(cfg.rollout.dynamic_sampling_metric, self.components,
                                               self.pass_component)
        on_gpu = self.device.type == "cuda"
        if why := resolve_batch_invariant_(cfg, self.device):  # before the plan and the compile key, which read it
            print(why, flush=True)
        if why := resolve_auto_(cfg, self.model_config, self.device):  # compile.backend auto; the plan depends on it
            print(why, flush=True)
        cfg.compile.backend = world.broadcast(cfg.compile.backend)  # rank 0's choice (its node's cache marker)
        self.plan = run_memory_plan(cfg, self.model_config, self.max_prompt_tokens, self.device, world.size)
        self.startup["prepare_s"] = time.perf_counter() - t  # tokenizer, task, prompt checks, memory plan
        # the key of the ATen ops list (`monorl.ops.preload`), taken before construction adjusts cfg
        self.aten_ops_path: Path | None = None
        self.aten_preload: Preload | None = None
        if on_gpu and HAS_TRITON:
            self.aten_ops_path = specs_path(run_aten_key(cfg, self.model_config, world.size)).with_suffix(".aten.json")
        t = time.perf_counter()

        gen_dtype = torch.bfloat16 if on_gpu else torch.float32
        lora = cfg.lora
        # LoRA: the frozen base is held once, in the compute dtype (it needs no fp32 master)
        self.policy, _, _ = load_policy(cfg, self.device, dtype=gen_dtype if lora.enabled else torch.float32,
                                        resolved=(self.model_config, self.tokenizer, self.model_source))
        if lora.enabled:
            apply_lora_(self.policy, lora, seed=cfg.model.init_seed, base_dtype=gen_dtype)
        self.policy.activation_checkpointing = self.plan.activation_checkpointing
        self.startup["model_load_s"] = time.perf_counter() - t

        cc = cfg.compile
        self.compile_cache = setup_compile_cache(cc)
        self.attn_backend = resolve_backend(cfg.model.attn_backend, self.device, gen_dtype)
        t = time.perf_counter()
        # the generator builds its own copy of the policy (in gen_dtype, fused projections, LoRA merged in) under
        # the run's compile policy; batch-invariant LoRA runs keep LoRA's separate adapter matmuls (unfused), which
        # the bitwise guarantee is for (a fused projection's invariant GEMM computes each output column as the
        # unfused one does: `monorl.ops.matmul_invariant`). On CUDA its KV cache is sized after the trainer's
        # warm-up has measured what training needs (`size_kv_cache`).
        self.generator = Generator(self.policy, cfg.generator, tokenizer=self.tokenizer,
                                   eos_token_ids=eos_ids(self.tokenizer, self.model_config), compile=cc,
                                   allocate_kv=not on_gpu,
                                   lora=lora if cfg.batch_invariant and lora.enabled else None)
        if cfg.batch_invariant and not on_gpu:
            log.warning("batch_invariant on %s runs the invariant ops' reference path (fixed-order tree sums, many "
                        "times slower than the default kernels); --batch_invariant false for a quick run",
                        self.device.type)
        if cfg.batch_invariant:  # both sides converted once, here (the reference copy below inherits the policy's)
            make_batch_invariant_(self.policy)
            make_batch_invariant_(self.generator.model)
        self.startup["generator_init_s"] = time.perf_counter() - t
        if self.aten_ops_path is not None:
            # the ATen kernels an earlier run's trainer warm-up launched, launched once in a thread while this one
            # builds the trainer (AdamW imports torch._dynamo) and loads the Triton kernels (joined in `warm_up`);
            # not sooner: the model load's and the generator's own CUDA work contend with it in the driver
            # (model_load_s 0.06 -> 0.41 s, generator_init_s 0.06 -> 0.33 s started before them, H100)
            self.aten_preload = start_preload(self.aten_ops_path, self.device)
        t = time.perf_counter()

        if cfg.trainer.loss.kind == "dr_grpo" and cfg.trainer.loss.dr_grpo_norm is None:
            cfg.trainer.loss.dr_grpo_norm = float(cfg.rollout.max_new_tokens)  # Dr.GRPO's constant normaliser
        ref_model = None
        if cfg.trainer.loss.kl_coef > 0:  # the KL reference; `run` sets it to the policy RL starts from
            ref_model = copy.deepcopy(self.policy).to(gen_dtype).eval().requires_grad_(False)
        trainer_cfg = cfg.trainer
        if cfg.batch_invariant:  # the trainer computes in the generator's dtype (its autocast dtype: see Trainer)
            trainer_cfg = dataclasses.replace(trainer_cfg, compute_dtype=str(gen_dtype).removeprefix("torch."))
        if cc.enabled and cc.trainer:  # before sharding: FSDP's hooks then stay outside the compiled blocks
            compile_blocks(self.policy, cc)
        if world.size > 1:  # after the generator and the KL reference copied the full weights
            shard_model_(self.policy, self.device)
        self.trainer = Trainer(self.policy, trainer_cfg, total_steps=cfg.steps,
                               attn_backend="flash" if self.attn_backend == "flash" else "sdpa",
                               ref_model=ref_model, cuda_graphs=cc.trainer_cuda_graphs,
                               max_graph_tokens=self.plan.micro_batch_tokens, world=world)
        self.trainer_transient_bytes: int | None = None  # measured by the trainer's warm-up (CUDA)
        self.memory_marks: dict[str, tuple[int, int]] = {}  # (allocated, reserved) bytes at points of the run (CUDA)
        self.reward_failed_steps = 0  # consecutive steps whose reward failed on every completion
        self.num_tokens = 0  # prompt + completion tokens trained on so far (TRL's num_tokens)
        self.warned_short_batch = False
        # created last, so a bad config, checkpoint or data file leaves no empty run directory behind; rank 0
        # names it (a default path holds the time) and alone writes it
        self.run_dir = RunDir(world.broadcast(cfg.run_dir or str(RunDir.default_path(cfg.preset))),
                              writer=world.is_main)
        self.run_dir.write_config(cfg.to_dict())
        if world.is_main:  # TensorBoard / W&B: rank 0's, as the rest of the run directory
            self.run_dir.loggers = open_loggers(cfg.logging, self.run_dir.path, json_safe(cfg.to_dict()))
        self.startup["trainer_init_s"] = time.perf_counter() - t  # KL reference, Trainer (AdamW), run dir, loggers

    def check_prompts_fit(self, sample: int = 32) -> int:
        """Refuse, before any work, a context that fits none of the prompts with room for max_new_tokens
        (every step would skip everything); warn when only some fit. Reads the first `sample` training prompts
        of the seed's stream (which also surfaces a task's refusal of the seed) and the validation prompts.
        Returns the longest training prompt that fits, in tokens (what the memory plan sizes packs with)."""
        r, v = self.cfg.rollout, self.cfg.validation
        train = list(itertools.islice(self.task.train_prompts(seed=self.cfg.seed), sample))
        longest = 1
        for what, prompts, new_tokens in (("training", train, r.max_new_tokens),
                                          ("validation", self.val_prompts, v.max_new_tokens or r.max_new_tokens)):
            if not prompts:
                continue
            lengths = [len(self.tokenizer.encode(self.task.render(p, self.tokenizer))) for p in prompts]
            fit = sum(n + new_tokens <= self.max_len for n in lengths)
            if fit == 0:
                raise ValueError(f"generator.max_model_len={self.max_len} fits none of the first {len(prompts)} "
                                 f"{what} prompts: the shortest is {min(lengths)} tokens and {new_tokens} new tokens "
                                 f"must fit after it; raise generator.max_model_len to at least "
                                 f"{min(lengths) + new_tokens} or lower max_new_tokens")
            if fit < len(prompts):
                log.warning("%d of the first %d %s prompts do not fit generator.max_model_len=%d with %d new tokens;"
                            " they will be skipped", len(prompts) - fit, len(prompts), what, self.max_len, new_tokens)
            if what == "training":
                longest = max(n for n in lengths if n + new_tokens <= self.max_len)
        return longest

    def check_components(self) -> tuple[str, ...]:
        """The training reward's components: the task's, and `OVERLONG` with rollout.overlong_buffer. Refuses a
        validation.pass_component the task does not have, and a task component named `OVERLONG`."""
        comps, v = self.task.reward_components, self.cfg.validation
        if v.pass_component is not None and v.pass_component not in comps:
            raise ValueError(f"validation.pass_component {v.pass_component!r} is not a reward component of task "
                             f"{self.task.name!r} ({', '.join(comps) or 'none'})")
        if self.cfg.rollout.overlong_buffer > 0:
            if OVERLONG in comps:
                raise ValueError(f"rollout.overlong_buffer adds a reward component {OVERLONG!r}, which task "
                                 f"{self.task.name!r} already has")
            comps = (*comps, OVERLONG)
        return comps

    def warm_up(self) -> None:
        """Compile and capture before the first step, so the startup split says what they cost and steady
        state compiles nothing: a trainer forward+backward on two pack sizes (no optimizer step: weights
        untouched), whose peak memory sizes the generator's KV cache (`size_kv_cache`), then a short generation
        with each sampler the run uses (rollouts, greedy validation)."""
        cc = self.cfg.compile
        cuda = self.device.type == "cuda"
        trainer_graphs = self.trainer.graphs is not None
        text = self.task.render(self.val_prompts[0], self.tokenizer) if self.val_prompts else "warm up"
        prompt = self.tokenizer.encode(text)
        # two prompts of different lengths: Dynamo specialises a dimension of size 1 (one prompt), which
        # would cost a recompile at the first real prefill
        gen_prompts = [prompt, prompt[: max(2, len(prompt) - 3)]]
        samplers = [dataclasses.replace(sp, max_new_tokens=4)
                    for sp in (self.sampling(0), SamplingParams(max_new_tokens=4, temperature=0.0))]
        if cuda:
            self.compile_kernels_ahead(prompt, gen_prompts, samplers)
        self.join_aten_preload()
        t = time.perf_counter()
        if (cc.enabled and cc.trainer) or trainer_graphs:
            if cuda:
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
            r = self.cfg.rollout
            self.trainer.warm_up(prompt, r.prompts_per_step * r.group_size, r.max_new_tokens, r.temperature,
                                 group_size=r.group_size)
            if cuda:  # what a step allocates beyond what stays allocated (activations, gradients)
                torch.cuda.synchronize(self.device)
                self.trainer_transient_bytes = (torch.cuda.max_memory_allocated(self.device)
                                                - torch.cuda.memory_allocated(self.device))
        self.mark_memory("after trainer warm-up")
        capture = self.trainer.graphs.capture_s if trainer_graphs else 0.0
        self.startup["trainer_graph_capture_s"] = capture
        self.startup["trainer_compile_s"] = time.perf_counter() - t - capture
        t = time.perf_counter()
        self.size_kv_cache()
        self.startup["kv_alloc_s"] = time.perf_counter() - t  # the cache and the model runner's buffers
        self.mark_memory("after KV cache")
        if not (cc.enabled or self.generator.use_graphs):
            self.compile_s = self.startup["trainer_compile_s"]
            return
        t = time.perf_counter()
        with self.world.main_first():  # the other ranks load what rank 0 compiled (compile.cache_dir)
            for sp in samplers:
                self.generator.generate(gen_prompts, sp, n=2)
        if cuda:
            torch.cuda.synchronize()
        gen_s = time.perf_counter() - t
        self.startup["graph_capture_s"] = self.generator.runner.timings["graph_capture_s"]
        self.startup["generator_compile_s"] = gen_s - self.startup["graph_capture_s"]
        self.mark_memory("after generator warm-up")
        self.compile_s = self.startup["generator_compile_s"] + self.startup["trainer_compile_s"]
        if cc.enabled and self.compile_cache is not None:  # compile.backend auto: the next run finds a warm cache
            mark_compiled(self.compile_cache, run_compile_key(self.cfg, self.model_config), self.compile_s)

    def join_aten_preload(self) -> None:
        """Wait for the ATen preload thread (before any CUDA graph capture or memory measurement) and say what it
        did; `aten_preload_wait_s` is what the main thread waited for it."""
        pre, self.aten_preload = self.aten_preload, None
        if pre is None:
            return
        pre.join()
        self.startup["aten_preload_wait_s"] = pre.wait_s
        print(f"aten: {pre.ran} kernels launched ahead in a thread ({pre.failed} of the kept list skipped) in "
              f"{pre.run_s:.2f} s; waited {pre.wait_s:.2f} s for it", flush=True)

    def compile_kernels_ahead(self, prompt: list[int], gen_prompts: list[list[int]],
                              samplers: list[SamplingParams]) -> None:
        """Compile the Triton kernels the warm-ups will launch, in parallel threads, before them
        (`monorl.ops.precompile`): their launches are traced first, skipped, by the warm-ups' own passes -- the
        trainer's when its model runs monorl's kernels (batch-invariant mode), the generator's -- except where
        torch.compile runs a model (those passes would compile it here). The traced list is kept beside Triton's
        cache; a later run with the same shapes, settings and code loads it instead of tracing. Rank-local (each
        rank traces the same passes; FSDP's collectives in them run on every rank)."""
        threads = self.cfg.compile.kernel_compile_threads or default_threads()
        traced = {"trainer": is_batch_invariant(self.policy) and not is_compiled(self.policy),
                  "generator": not is_compiled(self.generator.model)}
        if not HAS_TRITON or threads == 1 or not any(traced.values()):
            return
        kept = specs_path(run_kernels_key(self.cfg, self.model_config, self.world.size, traced))
        rec = load_specs(kept)
        if rec is not None:
            try:
                self.startup["kernel_compile_s"] = compile_ahead(rec, self.device, threads, self.triton_key)
                self.startup["kernel_trace_s"] = 0.0
                print(f"triton: {len(rec.specs)} kernel specialisations compiled ahead in "
                      f"{self.startup['kernel_compile_s']:.2f} s ({threads} threads; the list {kept.name} kept by "
                      "an earlier run)", flush=True)
                return
            except Exception as err:  # a kept list that no longer compiles: trace as if there were none
                print(f"triton: the kernel list {kept} did not compile ({type(err).__name__}: {err}); tracing "
                      "instead", flush=True)
        t = time.perf_counter()
        r = self.cfg.rollout
        aten = AtenRecorder()
        with recording() as rec:
            if traced["trainer"]:
                # its first pass also lists its ATen ops, for a later run's preload (`monorl.ops.preload`): the
                # trainer's warm-up pays most first launches, and recording slows the ops it sees (a dispatch mode)
                self.trainer.trace_kernels(prompt, r.prompts_per_step * r.group_size, r.max_new_tokens,
                                           r.temperature, first_pass=aten, group_size=r.group_size)
            if traced["generator"]:
                self.generator.trace_kernels(gen_prompts, samplers, n=2)
            torch.cuda.synchronize(self.device)
        self.startup["kernel_trace_s"] = time.perf_counter() - t
        self.startup["kernel_compile_s"] = compile_ahead(rec, self.device, threads, self.triton_key)
        save_specs(kept, rec)
        if self.aten_ops_path is not None and aten.ops:
            save_ops(self.aten_ops_path, aten.ops)
        print(f"triton: {len(rec.specs)} kernel specialisations compiled ahead in "
              f"{self.startup['kernel_compile_s']:.2f} s ({threads} threads; traced in "
              f"{self.startup['kernel_trace_s']:.2f} s, the list kept as {kept})", flush=True)

    def size_kv_cache(self) -> None:
        """Allocate the generator's KV cache (CUDA): what `max_num_seqs x max_model_len` needs, capped by what is
        free once training's needs are set aside -- the transient bytes the trainer's warm-up measured (the plan's
        estimate if it did not run), AdamW's state if not yet allocated, the generator's own transients, and
        slack. Less than a step's rollouts need is an error; less than the full need, a warning."""
        gen, plan = self.generator, self.plan
        if gen.kv is not None:
            return
        if self.cfg.generator.kv_cache_bytes is not None or self.device.type != "cuda":
            gen.allocate_kv_cache()
            return
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the warm-up's freed blocks back to the driver: `free` then counts them
        free, total = torch.cuda.mem_get_info(self.device)
        # with trainer graphs the activations live in the graphs' pool, already taken from `free`
        trainer = self.trainer_transient_bytes
        if self.trainer.graphs is not None:
            trainer = 0
        elif trainer is None:
            trainer = plan.row("trainer activations").bytes
        optimizer = 0 if self.trainer.optimizer.state else plan.row("optimizer state").bytes
        generator = sum(r.bytes for r in plan.rows if r.name in ("generator prefill", "decode graph pool"))
        slack = int(0.03 * total) + GiB // 4
        room = free - trainer - optimizer - generator - slack
        need = gen.kv_bytes_needed()
        r = self.cfg.rollout
        seqs = min(self.cfg.generator.max_num_seqs, r.prompts_per_step * r.group_size)
        step_need = kv_cache_bytes_needed(self.model_config, seqs, self.max_prompt_tokens + r.max_new_tokens,
                                          self.cfg.generator.block_size, gen.dtype)
        if room < step_need:
            raise MemoryError(f"after training's measured needs ({trainer / GiB:.1f} GiB transient, "
                              f"{optimizer / GiB:.1f} GiB optimizer state not yet allocated) {room / GiB:.1f} GiB are "
                              f"left for the KV cache, less than one step's {seqs} rollouts need "
                              f"({step_need / GiB:.1f} GiB): lower trainer.micro_batch_tokens or turn on "
                              "trainer.activation_checkpointing")
        if room < need:
            log.warning("KV cache: %.1f GiB fit, less than the %.1f GiB that generator.max_num_seqs=%d x max_model_len="
                        "%d need; sequences beyond it wait for a free block", room / GiB, need / GiB,
                        self.cfg.generator.max_num_seqs, self.max_len)
        budget = min(need, room)
        gen.allocate_kv_cache(budget)
        kv_row = plan.row("KV cache")
        if gen.kv.kv.numel() * gen.kv.kv.element_size() < kv_row.bytes:  # the plan then shows what was allocated
            kv_row.bytes = gen.kv.kv.numel() * gen.kv.kv.element_size()
            kv_row.note += " (capped by free memory)"

    def sampling(self, step: int, round_: int = 0) -> SamplingParams:
        """The rollout sampler of a step's generation round (dynamic sampling's later rounds get seeds of their
        own, far from any step's)."""
        r = self.cfg.rollout
        return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, ignore_eos=r.ignore_eos,
                              seed=self.cfg.seed * 1_000_003 + step + round_ * 1_000_000_007)

    def validate(self) -> ValidationResult:
        """The held-out prompts, validation.k completions each: greedy for k = 1, else sampled as the rollouts
        are, with one fixed seed, so every validation of the run draws the same noise."""
        v, r = self.cfg.validation, self.cfg.rollout
        if not self.val_prompts:
            return summarize([], self.task.reward_components)
        max_new = v.max_new_tokens or r.max_new_tokens
        how = "greedy" if v.k == 1 else f"{v.k} samples each"
        print(f"validating: {len(self.val_prompts)} held-out prompts, {how}", flush=True)
        if v.k == 1:
            sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=r.ignore_eos)
        else:
            sp = dataclasses.replace(self.sampling(0), max_new_tokens=max_new, seed=self.cfg.seed * 1_000_003 - 1)
        groups = generate_rollouts(self.generator, self.tokenizer, self.task, self.val_prompts, sp, v.k, self.max_len,
                                   self.world, context=self.reward_context())
        return summarize(groups, self.task.reward_components, self.pass_component, v.pass_threshold)

    def sync_weights(self) -> None:
        sync_weights_(self.generator.model, self.policy)  # in place: the generator's CUDA graphs stay valid

    def warm_start(self) -> None:
        """Supervised steps on the task's reference solutions, so RL starts with some signal."""
        ws, steps = self.cfg.warm_start, self.warm_start_steps
        if steps <= 0:
            return
        sft = Trainer(self.policy, TrainerConfig(lr=ws.lr, warmup_steps=max(1, steps // 10), schedule="cosine",
                                                 micro_batch_tokens=self.cfg.trainer.micro_batch_tokens,
                                                 max_grad_norm=1.0),
                      total_steps=steps, attn_backend=self.trainer.attn_backend, world=self.world)
        eos = self.tokenizer.eos_token_id
        bar = tqdm(range(ws.steps), desc="warm start", disable=not self.progress, leave=False)
        every, t0 = max(1, ws.steps // 10), time.perf_counter()  # piped output: a line per tenth instead of a bar
        for i in bar:
            seqs = []
            for p in itertools.islice(self.train_prompts, ws.batch_size):
                ids = self.tokenizer.encode(self.task.render(p, self.tokenizer))
                sol = self.tokenizer.encode(self.task.solution(p)) + [eos]
                seqs.append(TrainSequence(ids, sol, [0.0] * len(sol), 0.0))
            m = sft.sft_step(seqs)
            bar.set_postfix(loss=f"{m['loss']:.3f}")
            if not self.progress and ((i + 1) % every == 0 or i + 1 == ws.steps):
                eta = (time.perf_counter() - t0) / (i + 1) * (ws.steps - i - 1)
                print(f"warm start {i + 1}/{ws.steps} | loss {m['loss']:.4f} | eta {format_duration(eta)}", flush=True)
        self.sync_weights()

    def step(self, step: int) -> dict[str, Any]:
        """One RL step: prompts -> n completions each, scored -> group advantages -> a trainer step -> weight
        sync. Logs the step's metrics and samples; returns its metrics row."""
        cfg, ro = self.cfg, self.cfg.rollout
        self.join_aten_preload()  # a step may capture CUDA graphs; without `warm_up` the thread may still run
        t0 = time.perf_counter()
        context = self.reward_context()  # the rewards' trainer_state, and what they log over the step's rounds
        batch = fill_batch(lambda n, round_: self.rollouts(step, n, round_, context), ro.prompts_per_step,
                           ro.dynamic_sampling, ro.max_sampling_rounds, metric=self.sampling_metric)
        groups = batch.groups
        if ro.dynamic_sampling and len(groups) < ro.prompts_per_step and not self.warned_short_batch:
            self.warned_short_batch = True  # once: the step line says it every step
            log.warning("step %d: dynamic sampling found %d of %d groups with reward variance in %d rounds "
                        "(rollout.max_sampling_rounds); training on those", step + 1, len(groups), ro.prompts_per_step,
                        batch.rounds)
        assign_advantages(groups, normalize_std=ro.advantage_std_norm and cfg.trainer.loss.kind != "dr_grpo",
                          kind=ro.advantage)
        t1 = time.perf_counter()
        rollouts = [r for g in groups for r in g]
        if not rollouts:
            raise ValueError(f"step {step + 1}: every prompt was skipped: none fits generator.max_model_len="
                             f"{self.max_len} with {ro.max_new_tokens} new tokens")
        self.check_rewards(rollouts)
        sync = {}

        def after_update() -> None:  # queued behind the update, before the trainer's host sync (`Trainer.step`)
            t = time.perf_counter()
            self.sync_weights()
            sync["s"] = time.perf_counter() - t
            if step + 1 < cfg.steps:  # the next step's prompts tokenized while the GPU trains (not after it)
                self.encode_ahead(step + 1)

        seqs = [r.train_sequence(ro.mask_truncated, group=gi) for gi, g in enumerate(groups) for r in g]
        tm = self.trainer.step(seqs, temperature=ro.temperature, after_update=after_update)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        # sync_s: the host time of queuing the weight sync, which now runs on the GPU within train_s
        times = {"generate_s": t1 - t0, "train_s": t2 - t1 - sync["s"], "sync_s": sync["s"], "step_s": t2 - t0}
        self.num_tokens += sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts if not
                               (ro.mask_truncated and r.truncated))
        row = step_metrics(step, groups, self.components, tm, times,
                           extra={**context.metric_means(), "num_tokens": self.num_tokens,
                                  **batch.metrics(ro.dynamic_sampling)})
        every = cfg.validation.every
        if every > 0 and self.val_prompts and (step + 1) % every == 0 and step + 1 < cfg.steps:  # last: post
            with self.timed("validation_s"):
                row.update(self.validate().metrics("val/"))
        self.run_dir.log_metrics(row)
        self.run_dir.log_samples(sample_rows(step, rollouts[: cfg.samples_per_step]))
        return row

    def reward_context(self) -> RewardContext:
        """What the task's rewards are told now (TRL's trainer_state: trainer steps done, the run's steps, prompts
        drawn) and where their log_metric / log_extra go."""
        return RewardContext(self.trainer.step_count, self.cfg.steps, self.train_prompts.position)

    def rollouts(self, step: int, n: int, round_: int = 0, context: RewardContext | None = None) -> list[list[Rollout]]:
        """The next `n` training prompts' groups, scored (with the overlong penalty when configured)."""
        ro = self.cfg.rollout
        prompts = list(itertools.islice(self.train_prompts, n))
        sampling = self.sampling(step, round_)
        ahead, self.encoded_ahead = self.encoded_ahead, None
        encoded = None
        if ahead is not None and ahead[0] == sampling.max_new_tokens and len(ahead[1]) == len(prompts) and \
                all(a is b for a, b in zip(ahead[1], prompts, strict=True)):
            encoded = ahead[2]
        groups = generate_rollouts(self.generator, self.tokenizer, self.task, prompts, sampling,
                                   ro.group_size, self.max_len, self.world, encoded=encoded, context=context)
        if ro.overlong_buffer > 0:
            add_overlong_penalty(groups, ro.max_new_tokens, ro.overlong_buffer, ro.overlong_penalty)
        return groups

    def encode_ahead(self, step: int) -> None:
        """Render and tokenize the prompts step `step` will draw first (`PromptStream.peek`: the stream's position
        does not move), for `rollouts` to take instead of encoding them itself. Host work that would otherwise
        run with the GPU idle at the start of that step."""
        ro = self.cfg.rollout
        self.encoded_ahead = None
        try:
            prompts = self.train_prompts.peek(ro.prompts_per_step)
            max_new = self.sampling(step).max_new_tokens
            self.encoded_ahead = (max_new, prompts, encode_prompts(self.task, self.tokenizer, prompts, self.max_len,
                                                                   max_new))
        except Exception:  # noqa: BLE001 - a prompt that fails to render fails where that step draws it, as before
            log.debug("encoding the next step's prompts ahead failed; that step encodes them itself", exc_info=True)

    def check_rewards(self, rollouts: list[Rollout], patience: int = 3) -> None:
        """Stop the run when the reward failed on every completion of `patience` consecutive steps: a reward
        that cannot score anything would otherwise train on all-zero rewards forever."""
        errors = [r.reward_error for r in rollouts if r.reward_error is not None]
        self.reward_failed_steps = self.reward_failed_steps + 1 if len(errors) == len(rollouts) else 0
        if self.reward_failed_steps >= patience:
            raise RewardError(f"task {self.task.name!r}: the reward failed on every completion of {patience} "
                              f"steps in a row; stopping (last error: {errors[-1]})")

    def save_training_checkpoint(self, step: int, pre: ValidationResult) -> Path:
        """Checkpoint after `step` completed steps; pre-validation goes in its meta, as a resume skips it. Several
        ranks write one sharded (DCP) checkpoint together."""
        meta = {"pre_validation": pre.__dict__, "total_steps": self.cfg.steps, "num_tokens": self.num_tokens}
        kw = {"data_position": self.train_prompts.position, "tokenizer": self.tokenizer, "meta": meta,
              "keep_last": self.cfg.checkpoint.keep_last}
        if self.world.size > 1:
            return save_sharded_checkpoint(self.run_dir.checkpoints, step, self.policy, self.trainer, self.world,
                                           config_source=self.generator.model, **kw)
        return save_training_checkpoint(self.run_dir.checkpoints, step, self.policy, self.trainer, **kw)

    def save_final(self) -> None:
        """checkpoints/final: the policy as an HF checkpoint (fp32); a LoRA run's adapter in PEFT's format (loads with
        `PeftModel.from_pretrained(base, dir)`), plus checkpoints/final_merged (base + adapters, the base's dtype)
        with checkpoint.merged."""
        final = self.run_dir.checkpoints / "final"
        policy = self.policy
        if self.world.size > 1:  # gathered into one plain CPU copy on rank 0, which alone writes
            policy = full_policy_on_main(policy, self.world, self.plain_policy)
            if policy is None:
                return
        if not is_lora(policy):
            save_checkpoint(policy, final, dtype=torch.float32, tokenizer=self.tokenizer)
            return
        save_adapter(policy, final, base_model_name_or_path=self.cfg.model.path)
        self.tokenizer.save(final)
        if self.cfg.checkpoint.merged:
            save_merged_checkpoint(policy, self.run_dir.checkpoints / "final_merged", tokenizer=self.tokenizer)

    def plain_policy(self) -> Qwen3ForCausalLM:
        """An unsharded CPU policy of the run's shape (LoRA adapters included), values unset."""
        model = build_model(self.model_config, torch.device("cpu"), torch.float32, seed=None)
        if self.cfg.lora.enabled:
            apply_lora_(model, self.cfg.lora, base_dtype=next(self.generator.model.parameters()).dtype)
        return model

    def restore(self, path: Path) -> tuple[int, ValidationResult, list[dict[str, Any]]]:
        """Continue from a training checkpoint: policy weights (in place, then synced to the generator),
        optimizer, schedule, KL reference, RNG and data position; log rows written after it are dropped, so a
        run killed between a checkpoint and its death has no duplicate steps. Returns (first step, pre, earlier
        rows). A checkpoint without KL reference weights (saved with kl_coef 0) leaves the reference at the
        run's initial weights: the RL starting policy when there was no warm start."""
        if is_sharded_checkpoint(path):  # written by several ranks; loads on any number
            ckpt = load_sharded_checkpoint(path, self.policy, self.trainer)
        elif self.world.size > 1:
            raise ValueError(f"{path} is a single-process checkpoint, which resumes on one process only (runs on "
                             "several ranks write sharded checkpoints, which resume on any number)")
        else:
            ckpt = load_training_checkpoint(path, self.policy, self.trainer)
        self.sync_weights()
        self.train_prompts = PromptStream(self.task, self.cfg.seed, start=ckpt.data_position)
        self.encoded_ahead = None
        earlier = self.run_dir.rewind(ckpt.step)
        self.num_tokens = int(ckpt.meta.get("num_tokens", 0))
        pre = ckpt.meta.get("pre_validation")
        if not isinstance(pre, dict):
            raise ValueError(f"{path / 'meta.json'} has no pre_validation entry")
        return ckpt.step, ValidationResult(**pre), earlier

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the block's seconds to `phase_s[phase]` (time outside the RL steps, reported in summary.json)."""
        t = time.perf_counter()
        yield
        self.phase_s[phase] += time.perf_counter() - t

    def mark_memory(self, where: str) -> None:
        if self.device.type == "cuda":
            self.memory_marks[where] = (torch.cuda.memory_allocated(self.device),
                                        torch.cuda.memory_reserved(self.device))

    def memory_report(self) -> dict[str, Any]:
        """The plan beside what the run measured (CUDA): peak allocated and reserved bytes, and the trainer's
        transient bytes from its warm-up."""
        out: dict[str, Any] = {"plan": self.plan.as_dict()}
        if self.device.type == "cuda":
            out.update(peak_allocated_bytes=torch.cuda.max_memory_allocated(self.device),
                       peak_reserved_bytes=torch.cuda.max_memory_reserved(self.device),
                       trainer_transient_bytes=self.trainer_transient_bytes,
                       marks={k: {"allocated": a, "reserved": r} for k, (a, r) in self.memory_marks.items()})
        return out

    def trainer_graph_stats(self) -> dict[str, float] | None:
        return trainer_graph_stats(self.trainer)

    def run(self) -> RunResult:
        """The run; Ctrl-C ends it with one line saying where it stands and how to continue. During the RL steps,
        SIGTERM or a first Ctrl-C finish the step under way and write a checkpoint first (rl/stopping.py)."""
        self.steps_done = None  # RL steps finished, once the loop has started
        self.stop_signal = ""  # the signal that stopped the run between steps
        try:
            return self._run()
        except KeyboardInterrupt:
            raise KeyboardInterrupt(self.interrupted_line()) from None
        finally:
            self.run_dir.close()

    def interrupted_line(self) -> str:
        found = step_checkpoints(self.run_dir.checkpoints)
        where = ("before the first RL step" if self.steps_done is None
                 else f"after {self.steps_done}/{self.cfg.steps} steps")
        what = f"stopped by {self.stop_signal}" if self.stop_signal else "interrupted"
        if not found:
            return (f"{what} {where}; {self.run_dir.path} has no training checkpoint to resume from "
                    "(--checkpoint.every N / --checkpoint.every_minutes M write them during the run)")
        step, path = found[-1]
        return (f"{what} {where}; the last checkpoint is {path} (step {step}); continue with: "
                f"monorl train --resume {self.run_dir.path}")

    def write_summary(self, result: RunResult, stopped: str | None = None) -> None:
        """summary.json (rank 0); `stopped`: why the run ended before its last step."""
        if self.world.is_main:
            write_summary(self.run_dir.path / "summary.json", result, phases=self.phase_s,
                          wall_s=time.perf_counter() - self.t_start, compile_s=self.compile_s, trainer=self.trainer,
                          device=self.device, memory=self.memory_report(), stopped=stopped)

    def rl_steps(self, start: int, pre: ValidationResult, result: RunResult) -> None:
        """Steps start..cfg.steps, each with its console line (ETA from this session's mean step time); a checkpoint
        every checkpoint.every steps, every checkpoint.every_minutes, at the end (checkpoint.final), and when
        SIGTERM / Ctrl-C asked to stop with steps not yet saved."""
        cfg, ck = self.cfg, self.cfg.checkpoint
        t0 = last_saved_t = time.perf_counter()
        last_saved = start
        with GracefulStop() as stop:
            for step in range(start, cfg.steps):
                try:
                    row = self.step(step)
                except RewardError as e:  # the reward cannot score anything: keep what the run has, then stop
                    if step > last_saved:
                        with self.timed("checkpoint_s"):
                            self.save_training_checkpoint(step, pre)
                    self.write_summary(result, stopped=str(e))
                    raise
                if step == start:
                    self.mark_memory("after the first step")
                self.steps_done = done = step + 1
                result.steps.append(row)
                now = time.perf_counter()
                print(step_line(row, cfg.steps, eta_s=(now - t0) / (done - start) * (cfg.steps - done)), flush=True)
                save = ((done == cfg.steps and ck.final) or (ck.every > 0 and done % ck.every == 0)
                        or (ck.every_minutes > 0 and now - last_saved_t >= 60 * ck.every_minutes)
                        or bool(stop.requested and done > last_saved))
                # all ranks decide together (a checkpoint is collective): any rank's clock or signal counts
                save, stopping = self.world.any_(save, bool(stop.requested))
                if save:
                    with self.timed("checkpoint_s"):
                        self.save_training_checkpoint(done, pre)
                    last_saved, last_saved_t = done, time.perf_counter()
                    die_for_test(self.world.rank, done)
                if stopping:
                    self.stop_signal = stop.requested or "a signal to another rank"
                    raise KeyboardInterrupt

    def _run(self) -> RunResult:
        cfg = self.cfg
        split = ", ".join(f"{k}={v:.2f}" for k, v in self.startup.items())
        print(f"model: {self.model_source}", flush=True)
        print(f"startup: {split} | device={self.device} attn={self.attn_backend} run_dir={self.run_dir.path}",
              flush=True)
        ac = " (activation checkpointing: on)" if self.plan.activation_checkpointing else ""
        print(f"memory plan ({self.device}){ac}:\n{self.plan.table()}", flush=True)
        self.warm_up()
        if self.world.size > 1:  # startup ends when the slowest rank is ready (the others load rank 0's compile)
            t = time.perf_counter()
            self.world.barrier()
            self.startup["rank_wait_s"] = time.perf_counter() - t
        if self.compile_s:
            warm = ", ".join(f"{k}={self.startup[k]:.2f}" for k in
                             ("generator_compile_s", "graph_capture_s", "trainer_compile_s", "trainer_graph_capture_s")
                             if k in self.startup)
            print(f"startup (compile): {warm} | compile counters {compile_counters()}", flush=True)
        if self.resume_from is not None:
            start, pre, earlier = self.restore(self.resume_from)
            print(f"resumed from {self.resume_from} at step {start}/{cfg.steps}", flush=True)
        else:
            start, earlier = 0, []
            with self.timed("warm_start_s"):
                self.warm_start()
            self.trainer.anchor_reference()  # KL reference: the policy RL starts from, after the warm start
            with self.timed("validation_s"):
                pre = self.validate()
            self.run_dir.log_metrics({"validation/pre": pre.__dict__}, step=0)
        print(f"validation (pre): {pre.line()}", flush=True)
        result = RunResult(self.run_dir.path, pre, None, steps=earlier, startup=dict(self.startup))
        self.steps_done = start
        # what startup built lives as long as the steps: out of the garbage collector's way meanwhile, so that a full
        # collection scans only what the steps allocate (~180k objects took ~75 ms a collection on the dev box, and
        # one landed in a step of the reference run: +70 ms, H100); given back after, so a process that runs more
        # than this run can still collect what it leaves
        gc.freeze()
        try:
            self.rl_steps(start, pre, result)
        finally:
            gc.unfreeze()
        with self.timed("validation_s"):
            post = result.post = self.validate()
        if cfg.checkpoint.final:
            with self.timed("checkpoint_s"):
                self.save_final()
        self.write_summary(result)
        self.run_dir.log_metrics({"validation/pre": pre.__dict__, "validation/post": post.__dict__}, step=cfg.steps)
        if self.device.type == "cuda":
            print(f"memory: peak {torch.cuda.max_memory_allocated(self.device) / GiB:.1f} GiB allocated "
                  f"({torch.cuda.max_memory_reserved(self.device) / GiB:.1f} GiB reserved); planned "
                  f"{self.plan.peak_bytes / GiB:.1f} GiB", flush=True)
        if roi := compile_roi(self.compile_s, cfg.compile.eager_step_s, result.steps):
            print(roi, flush=True)
        print("Summary:")
        print(f"  Pre:  {pre.line()}")
        print(f"  Post: {post.line()}", flush=True)
        return result


def train(cfg: RunConfig, progress: bool = True, resume: str | Path | None = None) -> RunResult:
    """Run GRPO; `resume` (a run dir or one of its checkpoints) continues a stopped run. Under torchrun, one
    rank of the run: rank 0 alone prints and writes the run directory, and a job torchrun restarted
    (--max-restarts) continues from the run directory's last complete checkpoint."""
    cfg = with_absolute_paths(cfg)  # config.json must name the same files from any directory (resume, eval)
    world = init_world(cfg.device, cfg.distributed.timeout_s, cfg.distributed.backend)
    quiet_unless_main(world)
    if resume is None:
        resume = restart_resume_path(cfg, world.is_main)
    try:
        with best_effort():  # a closed console (`| head`, a dead `| tee`) never ends the run: console.log keeps it
            return GRPORun(cfg, progress and world.is_main, resume=resume, world=world).run()
    finally:
        close_world(world)
