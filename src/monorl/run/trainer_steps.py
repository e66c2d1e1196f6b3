"""The trainer side's run, for the placements whose ranks train (colocated, disaggregated trainer ranks): start-up,
the pre-validation (or a resume), the RL steps -- each: the rollout source's batch for the step, trained on and
published by the consumer, the step's metrics and samples logged -- checkpoints, the post-validation and
summary.json. Where the placements differ is a method a placement's driver defines (`run/colocated.py`,
`run/trainer_ranks.py`); nothing here asks which placement runs it."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from monorl.compile import compile_counters
from monorl.console import record_only
from monorl.generate.sampling import SamplingParams
from monorl.plan import GiB
from monorl.rl.rollouts.metrics import ValidationResult
from monorl.run.elastic import die_for_test
from monorl.run.parts import Parts
from monorl.run.stopping import GracefulStop, NoLearningSignal, interrupted_line
from monorl.run.summary import (
    RunResult,
    compile_roi,
    sample_rows,
    step_line,
    step_metrics,
    trainer_graph_stats,
    write_summary,
)
from monorl.tasks.base import RewardError


class TrainerSteps:
    """Drives a trainer rank's parts; a placement's driver subclasses it and fills in the methods marked so."""

    def __init__(self, parts: Parts, progress: bool = True) -> None:
        self.parts, self.progress = parts, progress
        self.cfg, self.spec, self.world, self.boot = parts.cfg, parts.spec, parts.world, parts.boot
        self.policy, self.trainer, self.consumer, self.generator = (parts.policy, parts.trainer, parts.consumer,
                                                                    parts.generator)
        self.rollouts, self.run_dir, self.checkpoints = parts.rollouts, parts.run_dir, parts.checkpoints
        self.phase_s = {"warm_start_s": 0.0, "validation_s": 0.0, "checkpoint_s": 0.0}
        self.num_tokens = 0  # prompt + completion tokens trained on so far (TRL's num_tokens)
        self.steps_done: int | None = None  # RL steps finished, once the loop has started
        self.stop_signal = ""  # the signal that stopped the run between steps

    # ---- what a placement's driver defines ------------------------------------------------------------------------

    def samplers(self) -> list[SamplingParams]:
        """The samplers the start-up warm-up compiles (this rank's generation)."""
        return []

    def warm_start(self) -> None:
        """Supervised steps before RL, where the placement has them."""

    def begin(self) -> None:
        """Before the pre-validation of a fresh run: start the rollout source."""
        self.rollouts.start(0)

    def after_publish(self, step: int) -> Callable[[], None] | None:
        """Host work to run while the GPU trains step `step` (after its weights are queued for publication)."""
        return None

    def validate_during(self, step: int, row: dict[str, Any]) -> None:
        """Validation between steps, into `row` (validation.every)."""

    def check_signal(self, rows: list[dict[str, Any]]) -> None:
        """Stop (NoLearningSignal) when the steps so far carry no learning signal."""

    # ---- start-up, validation -----------------------------------------------------------------------------------

    def warm_up(self) -> None:
        self.boot.warm_up(self.spec, self.policy, self.trainer, self.generator, self.samplers())

    def size_kv_cache(self) -> None:
        self.boot.size_kv_cache(self.spec, self.trainer, self.generator)

    def validate(self) -> ValidationResult:
        """The held-out prompts' results (the rollout source's: its producer's, or the generator ranks')."""
        return self.rollouts.validation()

    # ---- one step -----------------------------------------------------------------------------------------------

    def step(self, step: int) -> dict[str, Any]:
        """One RL step: the source's scored groups -> the consumer's advantages, trainer step and weight publication
        (the next step's prompts tokenized meanwhile) -> the step's metrics row and samples."""
        cfg = self.cfg
        self.boot.join_aten_preload()  # a step may capture CUDA graphs; without `warm_up` the thread may still run
        t0 = time.perf_counter()
        ahead = self.after_publish(step)
        # the producer's batches up to step + max_staleness (K = 0: this step's, made now), then the trainer's step
        # on this one (with in-flight updates, during the last batch's generation)
        taken = self.rollouts.step(step, lambda b: self.consumer.consume(b, after_publish=ahead))
        batch, (train_metrics, times), staleness = taken.batch, taken.trained, taken.metrics
        times = {"generate_s": taken.generate_s, **times, "step_s": time.perf_counter() - t0}
        rollouts = [r for g in batch.groups for r in g]
        self.num_tokens += sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts
                               if not (cfg.rollout.mask_truncated and r.truncated))
        row = step_metrics(step, batch.groups, self.spec.components, train_metrics, times,
                           extra={**batch.context.metric_means(), **batch.metrics, "num_tokens": self.num_tokens,
                                  **batch.sampled.metrics(cfg.rollout.dynamic_sampling), **staleness})
        self.validate_during(step, row)
        self.run_dir.log_metrics(row)
        self.run_dir.log_samples(sample_rows(step, rollouts[: cfg.samples_per_step]))
        return row

    # ---- checkpoints ----------------------------------------------------------------------------------------------

    def save_training_checkpoint(self, step: int, pre: ValidationResult) -> Path:
        """Checkpoint after `step` completed steps; pre-validation goes in its meta, as a resume skips it."""
        meta = {"pre_validation": pre.__dict__, "total_steps": self.cfg.steps, "num_tokens": self.num_tokens}
        return self.checkpoints.save(step, self.rollouts.consumed_position, meta)

    def restore(self, path: Path) -> tuple[int, ValidationResult, list[dict[str, Any]]]:
        """Continue from a training checkpoint: policy weights (in place, then published), optimizer, schedule, KL
        reference, RNG and data position; log rows written after it are dropped, so a run killed between a checkpoint
        and its death has no duplicate steps. Returns (first step, pre, earlier rows). A checkpoint without KL
        reference weights (saved with kl_coef 0) leaves the reference at the run's initial weights."""
        restored = self.checkpoints.restore(path)
        self.consumer.publish()
        # batches produced ahead before the checkpoint are generated again
        self.rollouts.start(restored.step, restored.data_position)
        self.num_tokens = restored.num_tokens
        return restored.step, restored.pre, self.run_dir.rewind(restored.step)

    # ---- reporting ------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the block's seconds to `phase_s[phase]` (time outside the RL steps, reported in summary.json)."""
        t = time.perf_counter()
        yield
        self.phase_s[phase] += time.perf_counter() - t

    def memory_report(self) -> dict[str, Any]:
        """The plan beside what the run measured (CUDA): peak allocated and reserved bytes, and the trainer's
        transient bytes from its warm-up."""
        device = self.parts.device
        out: dict[str, Any] = {"plan": self.parts.plan.as_dict()}
        if device.type == "cuda":
            out.update(peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
                       peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
                       trainer_transient_bytes=self.boot.trainer_transient_bytes,
                       marks={k: {"allocated": a, "reserved": r} for k, (a, r) in self.boot.memory_marks.items()})
        return out

    def trainer_graph_stats(self) -> dict[str, float] | None:
        return trainer_graph_stats(self.trainer)

    def write_summary(self, result: RunResult, stopped: str | None = None) -> None:
        """summary.json (rank 0); `stopped`: why the run ended before its last step."""
        if self.world.is_main:
            write_summary(self.run_dir.path / "summary.json", result, phases=self.phase_s,
                          wall_s=time.perf_counter() - self.parts.t_start, compile_s=self.boot.compile_s,
                          trainer=self.trainer, device=self.parts.device, memory=self.memory_report(), stopped=stopped)

    # ---- the run ------------------------------------------------------------------------------------------------

    def run(self) -> RunResult:
        """The run; Ctrl-C ends it with one line saying where it stands and how to continue. During the RL steps,
        SIGTERM or a first Ctrl-C finish the step under way and write a checkpoint first (run/stopping.py)."""
        try:
            return self._run()
        except KeyboardInterrupt:
            line = interrupted_line(self.run_dir.path, self.steps_done, self.cfg.steps, self.stop_signal)
            record_only(f"\nmonorl: {line}\n")  # console.log keeps it (`monorl.cli` prints it once the run unwound)
            raise KeyboardInterrupt(line) from None
        finally:
            self.rollouts.close()
            self.run_dir.close()

    def rl_steps(self, start: int, pre: ValidationResult, result: RunResult) -> None:
        """Steps start..cfg.steps, each with its console line (ETA from this session's mean step time); a checkpoint
        every checkpoint.every steps, every checkpoint.every_minutes, at the end (checkpoint.final), and when
        SIGTERM / Ctrl-C asked to stop with steps not yet saved."""
        cfg, ck = self.cfg, self.cfg.checkpoint
        t0 = last_saved_t = time.perf_counter()
        last_saved = start
        with GracefulStop() as stop:
            for step in range(start, cfg.steps):
                row = None
                try:
                    row = self.step(step)
                    self.check_signal([*result.steps, row])
                except (RewardError, NoLearningSignal) as e:  # nothing more to learn: keep what the run has, stop
                    done = step if row is None else step + 1
                    if row is not None:
                        result.steps.append(row)
                        print(step_line(row, cfg.steps), flush=True)
                    if done > last_saved:
                        with self.timed("checkpoint_s"):
                            self.save_training_checkpoint(done, pre)
                    self.write_summary(result, stopped=str(e))
                    raise
                if step == start:
                    self.boot.mark_memory("after the first step")
                self.steps_done = done = step + 1
                result.steps.append(row)
                now = time.perf_counter()
                print(step_line(row, cfg.steps, eta_s=(now - t0) / (done - start) * (cfg.steps - done)), flush=True)
                save = ((done == cfg.steps and ck.final) or (ck.every > 0 and done % ck.every == 0)
                        or (ck.every_minutes > 0 and now - last_saved_t >= 60 * ck.every_minutes)
                        or bool(stop.requested and done > last_saved))
                # all ranks decide together (a checkpoint is collective): any rank's clock or signal counts
                save, stopping = self.parts.train_world.any_(save, bool(stop.requested))  # the ranks that save
                if save:
                    with self.timed("checkpoint_s"):
                        self.save_training_checkpoint(done, pre)
                    last_saved, last_saved_t = done, time.perf_counter()
                    die_for_test(self.world.rank, done)
                if stopping:
                    self.stop_signal = stop.requested or "a signal to another rank"
                    raise KeyboardInterrupt

    def print_startup(self) -> None:
        p, boot = self.parts, self.boot
        split = ", ".join(f"{k}={v:.2f}" for k, v in p.startup.items())
        print(f"model: {self.spec.model_source}", flush=True)
        print(f"startup: {split} | device={p.device} attn={p.attn_backend} run_dir={self.run_dir.path}", flush=True)
        ac = " (activation checkpointing: on)" if p.plan.activation_checkpointing else ""
        print(f"memory plan ({p.device}){ac}:\n{p.plan.table()}", flush=True)
        self.warm_up()
        if self.world.size > 1:  # startup ends when the slowest rank is ready (the others load rank 0's compile)
            with boot.timed("rank_wait_s"):
                self.world.barrier()
        if boot.compile_s:
            warm = ", ".join(f"{k}={p.startup[k]:.2f}" for k in
                             ("generator_compile_s", "graph_capture_s", "trainer_compile_s", "trainer_graph_capture_s")
                             if k in p.startup)
            print(f"startup (compile): {warm} | compile counters {compile_counters()}", flush=True)

    def _run(self) -> RunResult:
        cfg, p = self.cfg, self.parts
        self.print_startup()
        if p.resume_from is not None:
            start, pre, earlier = self.restore(p.resume_from)
            print(f"resumed from {p.resume_from} at step {start}/{cfg.steps}", flush=True)
        else:
            start, earlier = 0, []
            with self.timed("warm_start_s"):
                self.warm_start()
            self.trainer.anchor_reference()  # KL reference: the policy RL starts from, after the warm start
            self.begin()
            with self.timed("validation_s"):
                pre = self.validate()
            self.run_dir.log_metrics({"validation/pre": pre.__dict__}, step=0)
        print(f"validation (pre): {pre.line()}", flush=True)
        result = RunResult(self.run_dir.path, pre, None, steps=earlier, startup=dict(p.startup))
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
                self.checkpoints.save_final(self.spec.model_config, cfg.lora, cfg.model.path, cfg.checkpoint.merged)
        self.write_summary(result)
        self.run_dir.log_metrics({"validation/pre": pre.__dict__, "validation/post": post.__dict__,
                                  **self.rollouts.final_metrics()}, step=cfg.steps)
        if p.device.type == "cuda":
            print(f"memory: peak {torch.cuda.max_memory_allocated(p.device) / GiB:.1f} GiB allocated "
                  f"({torch.cuda.max_memory_reserved(p.device) / GiB:.1f} GiB reserved); planned "
                  f"{p.plan.peak_bytes / GiB:.1f} GiB", flush=True)
        if roi := compile_roi(self.boot.compile_s, cfg.compile.eager_step_s, result.steps):
            print(roi, flush=True)
        print("Summary:")
        print(f"  Pre:  {pre.line()}")
        print(f"  Post: {post.line()}", flush=True)
        return result
