"""Start-up: everything between "the parts are built" and "the first RL step", timed, so the startup split says
what each costs and the steps compile nothing. The trainer's warm-up (whose measured peak sizes the generator's KV
cache), the KV cache itself, and the generator's warm-up with each sampler the run uses.

The start-up-speed machinery lives behind one switch, `compile.startup_speedups` (on by default, CUDA + Triton
only): Triton's cache key computed in a child process meanwhile (`TritonKeyPrefetch`), the run's Triton kernels
compiled ahead in threads from a kept list (`speedups/precompile.py`), and the ATen kernels an earlier run launched
replayed in a thread (`speedups/preload.py`). Each relies on private Triton / torch APIs; `tests/test_private_apis.py`
fails when an upgrade removes one. Off, start-up compiles on first launch as torch and Triton normally do.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from monorl.assembly import RunSpec
from monorl.compile import is_compiled
from monorl.compile_auto import mark_compiled, run_aten_key, run_compile_key, run_kernels_key
from monorl.distributed.world import World
from monorl.generate.cache import traceable
from monorl.generate.generator import Generator
from monorl.generate.sampling import SamplingParams
from monorl.model.batch_invariant import is_batch_invariant
from monorl.model.config import ModelConfig
from monorl.ops import HAS_TRITON
from monorl.plan import GiB, step_kv_need
from monorl.plan_rewards import MODEL_REWARD_ROWS
from monorl.speedups.precompile import (
    TritonKeyPrefetch,
    compile_ahead,
    default_threads,
    load_specs,
    recording,
    save_specs,
    specs_path,
)
from monorl.speedups.preload import AtenRecorder, Preload, save_ops, start_preload
from monorl.train.trainer import Trainer

log = logging.getLogger("monorl")

class Startup:
    """The run's start-up: its timings (`timings`, printed and in summary.json), compile seconds, memory marks."""

    def __init__(self, cfg: Any, device: torch.device, world: World) -> None:
        self.cfg, self.device, self.world = cfg, device, world
        self.timings: dict[str, float] = {}
        self.compile_s = 0.0
        self.memory_marks: dict[str, tuple[int, int]] = {}  # (allocated, reserved) bytes at points of the run (CUDA)
        self.trainer_transient_bytes: int | None = None  # measured by the trainer's warm-up (CUDA)
        self.speedups = cfg.compile.startup_speedups and device.type == "cuda" and HAS_TRITON
        self.threads = cfg.compile.kernel_compile_threads or default_threads()
        # Triton's cache key, computed by a child process meanwhile (see `compile_kernels_ahead`)
        self.triton_key = TritonKeyPrefetch() if self.speedups and self.threads != 1 else None
        self.aten_ops_path: Path | None = None
        self.aten_preload: Preload | None = None
        self.compile_cache: Path | None = None  # the persistent compile cache, when compiling (`setup_compile_cache`)

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        yield
        self.timings[name] = time.perf_counter() - t

    def mark_memory(self, where: str) -> None:
        if self.device.type == "cuda":
            self.memory_marks[where] = (torch.cuda.memory_allocated(self.device),
                                        torch.cuda.memory_reserved(self.device))

    # ---- the ATen preload ---------------------------------------------------------------------------------------

    def plan_aten_preload(self, spec: RunSpec) -> None:
        """Where this run's ATen ops list is kept, keyed before anything adjusts the config."""
        if self.speedups:
            self.aten_ops_path = specs_path(run_aten_key(spec.cfg, spec.model_config, self.world.size)).with_suffix(
                ".aten.json")

    def start_aten_preload(self) -> None:
        """The ATen kernels an earlier run's trainer warm-up launched, launched once in a thread while this one
        builds the trainer (AdamW imports torch._dynamo) and loads the Triton kernels (joined in `warm_up`); not
        sooner: the model load's and the generator's own CUDA work contend with it in the driver (model_load_s 0.06
        -> 0.41 s, generator_init_s 0.06 -> 0.33 s started before them, H100)."""
        if self.aten_ops_path is not None:
            self.aten_preload = start_preload(self.aten_ops_path, self.device)

    def join_aten_preload(self) -> None:
        """Wait for the ATen preload thread (before any CUDA graph capture or memory measurement) and say what it
        did; `aten_preload_wait_s` is what the main thread waited for it."""
        pre, self.aten_preload = self.aten_preload, None
        if pre is None:
            return
        pre.join()
        self.timings["aten_preload_wait_s"] = pre.wait_s
        print(f"aten: {pre.ran} kernels launched ahead in a thread ({pre.failed} of the kept list skipped) in "
              f"{pre.run_s:.2f} s; waited {pre.wait_s:.2f} s for it", flush=True)

    # ---- the warm-up ---------------------------------------------------------------------------------------------

    def warm_up(self, spec: RunSpec, policy: torch.nn.Module | None, trainer: Trainer | None,
                generator: Generator | None, samplers: list[SamplingParams]) -> None:
        """Compile and capture before the first step: a trainer forward+backward on two pack sizes (no optimizer
        step: weights untouched), whose peak memory sizes the generator's KV cache (`size_kv_cache`), then a short
        generation with each sampler the run uses (rollouts, greedy validation). A disaggregated run's rank holds
        one side (the other None) and warms up that one."""
        cc, cuda = self.cfg.compile, self.device.type == "cuda"
        trainer_graphs = trainer is not None and trainer.graphs is not None
        text = spec.task.render(spec.val_prompts[0], spec.tokenizer) if spec.val_prompts else "warm up"
        prompt = spec.tokenizer.encode(text)
        # two prompts of different lengths: Dynamo specialises a dimension of size 1 (one prompt), which would cost a
        # recompile at the first real prefill
        gen_prompts = [prompt, prompt[: max(2, len(prompt) - 3)]]
        # the trainer warms up (and captures) the largest pack a step can make: prompts as long as the longest training
        # prompt (the one the memory plan sizes packs with), completions of max_new_tokens. A step's packs can then
        # replay its graph, padded (`trainer.graph_pad_slack`); with the validation prompt's length they captured
        # their own, each capture's eager pass taking memory the KV cache had been given (Qwen3-8B on 4 H100 ran out
        # of memory in one at step 2)
        prompt = (prompt * (spec.max_prompt_tokens // max(1, len(prompt)) + 1))[:max(len(prompt),
                                                                                   spec.max_prompt_tokens)]
        if self.speedups and trainer is not None and generator is not None and policy is not None:
            self.compile_kernels_ahead(spec, policy, trainer, generator, prompt, gen_prompts, samplers)
        self.join_aten_preload()
        t = time.perf_counter()
        if trainer is not None and ((cc.enabled and cc.trainer) or trainer_graphs):
            if cuda:
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
            r = self.cfg.rollout
            trainer.warm_up(prompt, r.prompts_per_step * r.group_size, r.max_new_tokens, r.temperature,
                            group_size=r.group_size)
            if cuda:  # what a step allocates beyond what stays allocated (activations, gradients)
                torch.cuda.synchronize(self.device)
                self.trainer_transient_bytes = (torch.cuda.max_memory_allocated(self.device)
                                                - torch.cuda.memory_allocated(self.device))
        self.mark_memory("after trainer warm-up")
        graphs = trainer.graphs if trainer is not None else None
        capture = graphs.capture_s if graphs is not None else 0.0
        if graphs is not None:
            graphs.log.since_last_read()  # the steps report their own captures (`trainer/graph_captures`), not these
        self.timings["trainer_graph_capture_s"] = capture
        self.timings["trainer_compile_s"] = time.perf_counter() - t - capture
        with self.timed("kv_alloc_s"):  # the cache and the model runner's buffers
            self.size_kv_cache(spec, trainer, generator)
        self.mark_memory("after KV cache")
        if generator is None or not (cc.enabled or generator.use_graphs):
            self.compile_s = self.timings["trainer_compile_s"]
            return
        t = time.perf_counter()
        # the other ranks load what rank 0 compiled (compile.cache_dir); not a tensor-parallel generator, whose
        # ranks meet in every forward's collectives
        first = self.world.main_first() if generator.tp.size == 1 else contextlib.nullcontext()
        with first:
            for sp in samplers:
                generator.generate(gen_prompts, sp, n=2)
        if cuda:
            torch.cuda.synchronize()
        gen_s = time.perf_counter() - t
        self.timings["graph_capture_s"] = generator.runner.timings["graph_capture_s"]
        self.timings["generator_compile_s"] = gen_s - self.timings["graph_capture_s"]
        self.mark_memory("after generator warm-up")
        self.compile_s = self.timings["generator_compile_s"] + self.timings["trainer_compile_s"]
        if cc.enabled and self.compile_cache is not None:  # compile.backend auto: the next run finds a warm cache
            mark_compiled(self.compile_cache, run_compile_key(self.cfg, spec.model_config), self.compile_s)

    def compile_kernels_ahead(self, spec: RunSpec, policy: torch.nn.Module, trainer: Trainer, generator: Generator,
                              prompt: list[int], gen_prompts: list[list[int]], samplers: list[SamplingParams]) -> None:
        """Compile the Triton kernels the warm-ups will launch, in parallel threads, before them
        (`monorl.speedups.precompile`): their launches are traced first, skipped, by the warm-ups' own passes -- the
        trainer's when its model runs monorl's kernels (batch-invariant mode), the generator's -- except where
        torch.compile runs a model (those passes would compile it here). The traced list is kept beside Triton's
        cache; a later run with the same shapes, settings and code loads it instead of tracing. Rank-local (each
        rank traces the same passes; FSDP's collectives in them run on every rank)."""
        traced = trace_passes(policy, generator.model, spec.model_config)
        if self.threads == 1 or not any(traced.values()):
            return
        kept = specs_path(run_kernels_key(self.cfg, spec.model_config, self.world.size, traced))
        rec = load_specs(kept)
        if rec is not None:
            try:
                self.timings["kernel_compile_s"] = compile_ahead(rec, self.device, self.threads, self.triton_key)
                self.timings["kernel_trace_s"] = 0.0
                print(f"triton: {len(rec.specs)} kernel specialisations compiled ahead in "
                      f"{self.timings['kernel_compile_s']:.2f} s ({self.threads} threads; the list {kept.name} kept by "
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
                # its first pass also lists its ATen ops, for a later run's preload (`monorl.speedups.preload`): the
                # trainer's warm-up pays most first launches, and recording slows the ops it sees (a dispatch mode)
                trainer.trace_kernels(prompt, r.prompts_per_step * r.group_size, r.max_new_tokens, r.temperature,
                                      first_pass=aten, group_size=r.group_size)
            if traced["generator"]:
                generator.trace_kernels(gen_prompts, samplers, n=2)
            torch.cuda.synchronize(self.device)
        self.timings["kernel_trace_s"] = time.perf_counter() - t
        self.timings["kernel_compile_s"] = compile_ahead(rec, self.device, self.threads, self.triton_key)
        save_specs(kept, rec)
        if self.aten_ops_path is not None and aten.ops:
            save_ops(self.aten_ops_path, aten.ops)
        print(f"triton: {len(rec.specs)} kernel specialisations compiled ahead in "
              f"{self.timings['kernel_compile_s']:.2f} s ({self.threads} threads; traced in "
              f"{self.timings['kernel_trace_s']:.2f} s, the list kept as {kept})", flush=True)

    # ---- the KV cache --------------------------------------------------------------------------------------------

    def size_kv_cache(self, spec: RunSpec, trainer: Trainer | None, generator: Generator | None) -> None:
        """Allocate the generator's KV cache (CUDA): what `max_num_seqs x max_model_len` needs, capped by what is
        free once training's needs are set aside -- the transient bytes the trainer's warm-up measured (the plan's
        estimate if it did not run), AdamW's state if not yet allocated, the generator's own transients, and
        slack. Less than a step's rollouts need is an error; less than the full need, a warning. A generator rank
        of a disaggregated run (no trainer) sets nothing aside for training."""
        cfg, plan = self.cfg, spec.plan
        if generator is None or generator.cache is not None:
            return
        if cfg.generator.kv_cache_bytes is not None or self.device.type != "cuda" or plan is None:
            generator.allocate_kv_cache()
            return
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the warm-up's freed blocks back to the driver: `free` then counts them
        free, total = torch.cuda.mem_get_info(self.device)
        # with trainer graphs the activations live in the graphs' pool, already taken from `free`
        transient = self.trainer_transient_bytes
        if trainer is None or trainer.graphs is not None:
            transient = 0
        elif transient is None:
            transient = plan.row("trainer activations").bytes
        optimizer = 0 if trainer is None or trainer.optimizer.state else plan.row("optimizer state").bytes
        # the generator's transients (a prefill, the weight sync's gather: one at a time) and its decode graphs' pool
        gen_bytes = max((r.bytes for r in plan.rows if r.name in ("generator prefill", "weight sync")), default=0)
        gen_bytes += sum(r.bytes for r in plan.rows if r.name == "decode graph pool")
        # a judge's and a reward model's (loaded at the first reward, after this cache): their weights, the judge's
        # KV cache and prefill, and the reward model's forward, all set aside
        gen_bytes += sum(r.bytes for r in plan.rows if r.name in MODEL_REWARD_ROWS)
        slack = int(0.03 * total) + GiB // 4
        room = generator.tp.min_int(free - transient - optimizer - gen_bytes - slack)  # a TP group decides alike
        need = generator.kv_bytes_needed()
        # this rank's share of the step (a tensor-parallel group's, in its rank's shard of the heads)
        seqs, _, step_need = step_kv_need(cfg, generator.kv_config, spec.max_prompt_tokens,
                                          self.world.size // generator.tp.size, generator.dtype)
        if room < step_need:
            raise MemoryError(f"after training's measured needs ({transient / GiB:.1f} GiB transient, "
                              f"{optimizer / GiB:.1f} GiB optimizer state not yet allocated) {room / GiB:.1f} GiB are "
                              f"left for the KV cache, less than one step's {seqs} rollouts need "
                              f"({step_need / GiB:.1f} GiB): lower trainer.micro_batch_tokens or turn on "
                              "trainer.activation_checkpointing")
        if room < need:
            log.warning(
                "KV cache: %.1f GiB fit, less than the %.1f GiB that generator.max_num_seqs=%d x max_model_len=%d "
                "need; sequences beyond it wait for a free block", room / GiB, need / GiB, cfg.generator.max_num_seqs,
                spec.max_len)
        generator.allocate_kv_cache(min(need, room))
        kv_row = plan.row("KV cache")
        allocated = generator.cache.allocated_bytes()
        if allocated != kv_row.bytes:  # the plan then shows what was allocated
            kv_row.note += " (capped by free memory)" if allocated < kv_row.bytes else " (sized to free memory)"
            kv_row.bytes = allocated


def trace_passes(policy: torch.nn.Module, generator_model: torch.nn.Module, cfg: ModelConfig) -> dict[str, bool]:
    """Which warm-up passes `Startup.compile_kernels_ahead` traces. A trace pass skips Triton launches and runs its
    PyTorch ops on what they left, so only where no PyTorch op reads a skipped kernel's output as indices: a family
    without the fused q/k-norm kernel rotates with PyTorch ops (`monorl::rope`; a device-side assert on H200,
    SmolLM2), and a hybrid's or a window family's cache maps the step's slots with index ops (`cache.traceable`; a
    device-side assert on H100, Qwen3.5): their kernels compile at first launch instead."""
    return {"trainer": is_batch_invariant(policy) and not is_compiled(policy),
            "generator": not is_compiled(generator_model) and cfg.qk_norm and traceable(cfg)}
