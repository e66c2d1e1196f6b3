"""The GRPO loop: sample prompts -> n completions each -> rewards -> group-normalised advantages ->
train -> weight sync, with greedy validation before the first and after the last step."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import logging
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from monorl.compile import compile_blocks, compile_counters, setup_compile_cache
from monorl.config import RunConfig
from monorl.fsutil import json_safe
from monorl.generate.engine import Generator
from monorl.generate.sampling import SamplingParams
from monorl.model.attention import resolve_backend
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.checkpoint import load_checkpoint, load_config, save_checkpoint
from monorl.model.config import MODEL_SHAPES, model_shape
from monorl.model.hub import resolve_model_path
from monorl.model.qwen3 import Qwen3ForCausalLM, build_model
from monorl.model.tokenizer import TOKENIZER_FILE, CharTokenizer, eos_ids, load_tokenizer
from monorl.rl.checkpointing import (
    find_checkpoint,
    load_training_checkpoint,
    save_training_checkpoint,
    step_checkpoints,
)
from monorl.rl.loggers import check_loggers, open_loggers
from monorl.rl.rollouts import Rollout, assign_advantages, generate_rollouts
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
from monorl.tasks.stream import PromptStream
from monorl.train.packing import TrainSequence
from monorl.train.trainer import Trainer, TrainerConfig

log = logging.getLogger("monorl")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return dev


def load_policy(cfg: RunConfig, device: torch.device) -> tuple[Qwen3ForCausalLM, Any, str]:
    """The trainer's fp32 policy, its tokenizer, and a line saying where the weights came from: a checkpoint's
    weights (`model.path`), random weights of its config.json (`model.path` + `model.random_init`), or random
    weights of a named shape (`model.shape`, no path). A path always means "load these weights" unless
    random_init is set: a preset's shape never overrides it."""
    m = cfg.model
    if m.path:
        path, origin = resolve_model_path(m.path)  # a local directory, or a Hub name through its cache
        mcfg = load_config(path)  # names a missing directory or config.json first
        if not (path / TOKENIZER_FILE).is_file():  # the char tokenizer would silently mis-tokenize a real vocab
            raise FileNotFoundError(f"model.path {path} has no {TOKENIZER_FILE}: copy the model's tokenizer files "
                                    "there (tokenizer.json, tokenizer_config.json)")
        if m.random_init:
            model = build_model(mcfg, device, torch.float32, seed=m.init_seed)
            source = f"random init (seed {m.init_seed}) of {path / 'config.json'} (model.random_init=true)"
        else:
            model = load_checkpoint(path, device=device, dtype=torch.float32)
            source = f"weights of {path}{origin}"
        tok = load_tokenizer(path)
    else:
        if m.shape is None:
            raise ValueError("model.path is not set: give --model.path <HF checkpoint dir>, or --model.shape NAME for "
                             f"random weights of a named shape ({', '.join(MODEL_SHAPES)})")
        model = build_model(model_shape(m.shape), device, torch.float32, seed=m.init_seed)
        tok = CharTokenizer()
        source = f"random init (seed {m.init_seed}) of shape {m.shape!r}"
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(f"tokenizer has {tok.vocab_size} tokens but the model's vocab_size is "
                         f"{model.config.vocab_size}")
    return model, tok, source


class GRPORun:
    """Holds the pieces of one run; `run()` executes it."""

    def __init__(self, cfg: RunConfig, progress: bool = True, resume: str | Path | None = None) -> None:
        self.cfg, self.progress = cfg, progress
        self.t_start = time.perf_counter()
        self.phase_s = {"warm_start_s": 0.0, "validation_s": 0.0, "checkpoint_s": 0.0}
        # a run dir or checkpoint dir to continue from; resolved first so a bad path fails before any work
        self.resume_from = find_checkpoint(resume) if resume is not None else None
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.device = resolve_device(cfg.device)
        check_loggers(cfg.logging)  # a missing optional extra fails before any work
        self.startup: dict[str, float] = {}
        self.compile_s = 0.0

        t = time.perf_counter()
        self.policy, self.tokenizer, self.model_source = load_policy(cfg, self.device)
        self.task: Task = load_task(cfg.task.name, **cfg.task.args)
        if cfg.warm_start.steps > 0 and not hasattr(self.task, "solution"):
            raise ValueError(f"warm_start.steps={cfg.warm_start.steps} needs a task with solution(); "
                             f"{self.task.name} has none")
        self.startup["model_load_s"] = time.perf_counter() - t

        cc = cfg.compile
        self.compile_cache = setup_compile_cache(cc)
        gen_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.attn_backend = resolve_backend(cfg.model.attn_backend, self.device, gen_dtype)
        t = time.perf_counter()
        # the generator builds its own copy of the policy (in gen_dtype, fused projections) under the run's compile
        # policy; batch-invariant runs keep the trainer's unfused GEMM shapes, which the bitwise guarantee is for
        self.generator = Generator(self.policy, cfg.generator, tokenizer=self.tokenizer,
                                   eos_token_ids=eos_ids(self.tokenizer, self.policy.config), compile=cc,
                                   fused=not cfg.batch_invariant)
        if cfg.batch_invariant:  # both sides converted once, here (the reference copy below inherits the policy's)
            make_batch_invariant_(self.policy)
            make_batch_invariant_(self.generator.model)
        self.startup["generator_init_s"] = time.perf_counter() - t

        if cfg.trainer.loss.kind == "dr_grpo" and cfg.trainer.loss.dr_grpo_norm is None:
            cfg.trainer.loss.dr_grpo_norm = float(cfg.rollout.max_new_tokens)  # Dr.GRPO's constant normaliser
        ref_model = None
        if cfg.trainer.loss.kl_coef > 0:  # the KL reference; `run` sets it to the policy RL starts from
            ref_model = copy.deepcopy(self.policy).to(gen_dtype).eval().requires_grad_(False)
        trainer_cfg = cfg.trainer
        if cfg.batch_invariant:  # the trainer computes in the generator's dtype (its autocast dtype: see Trainer)
            trainer_cfg = dataclasses.replace(trainer_cfg, compute_dtype=str(gen_dtype).removeprefix("torch."))
        self.trainer = Trainer(self.policy, trainer_cfg, total_steps=cfg.steps,
                               attn_backend="flash" if self.attn_backend == "flash" else "sdpa",
                               ref_model=ref_model, cuda_graphs=cc.trainer_cuda_graphs)
        if cc.enabled and cc.trainer:
            compile_blocks(self.policy, cc)
        self.max_len = self.generator.max_model_len  # prompt + completion must fit the generator's context
        self.train_prompts = PromptStream(self.task, cfg.seed)  # knows its position, for checkpoints
        self.val_prompts = self.task.val_prompts(cfg.validation.num_prompts)
        self.check_prompts_fit()
        self.reward_failed_steps = 0  # consecutive steps whose reward failed on every completion
        # created last, so a bad config, checkpoint or data file leaves no empty run directory behind
        self.run_dir = RunDir(cfg.run_dir or RunDir.default_path(cfg.preset))
        self.run_dir.write_config(cfg.to_dict())
        self.run_dir.loggers = open_loggers(cfg.logging, self.run_dir.path, json_safe(cfg.to_dict()))

    def check_prompts_fit(self, sample: int = 32) -> None:
        """Refuse, before any work, a context that fits none of the prompts with room for max_new_tokens
        (every step would skip everything); warn when only some fit. Reads the first `sample` training prompts
        of the seed's stream (which also surfaces a task's refusal of the seed) and the validation prompts."""
        r, v = self.cfg.rollout, self.cfg.validation
        train = list(itertools.islice(self.task.train_prompts(seed=self.cfg.seed), sample))
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

    def warm_up(self) -> None:
        """Compile and capture before the first step, so the startup split says what they cost and steady
        state compiles nothing: a short generation with each sampler the run uses (rollouts, greedy
        validation), and a trainer forward+backward on two pack sizes (no optimizer step: weights untouched)."""
        cc = self.cfg.compile
        trainer_graphs = self.trainer.graphs is not None
        if not (cc.enabled or self.generator.runner.use_graphs or trainer_graphs):
            return
        t = time.perf_counter()
        text = self.task.render(self.val_prompts[0], self.tokenizer) if self.val_prompts else "warm up"
        prompt = self.tokenizer.encode(text)
        # two prompts of different lengths: Dynamo specialises a dimension of size 1 (one prompt), which
        # would cost a recompile at the first real prefill
        prompts = [prompt, prompt[: max(2, len(prompt) - 3)]]
        for sp in (self.sampling(0), SamplingParams(max_new_tokens=4, temperature=0.0)):
            self.generator.generate(prompts, dataclasses.replace(sp, max_new_tokens=4), n=2)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        gen_s = time.perf_counter() - t
        self.startup["graph_capture_s"] = self.generator.runner.timings["graph_capture_s"]
        self.startup["generator_compile_s"] = gen_s - self.startup["graph_capture_s"]
        t = time.perf_counter()
        if (cc.enabled and cc.trainer) or trainer_graphs:
            r = self.cfg.rollout
            self.trainer.warm_up(prompt, r.prompts_per_step * r.group_size, r.max_new_tokens, r.temperature)
        capture = self.trainer.graphs.capture_s if trainer_graphs else 0.0
        self.startup["trainer_graph_capture_s"] = capture
        self.startup["trainer_compile_s"] = time.perf_counter() - t - capture
        self.compile_s = self.startup["generator_compile_s"] + self.startup["trainer_compile_s"]

    def sampling(self, step: int) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, ignore_eos=r.ignore_eos, seed=self.cfg.seed * 1_000_003 + step)

    def validate(self) -> ValidationResult:
        v = self.cfg.validation
        print(f"validating: {len(self.val_prompts)} held-out prompts, greedy", flush=True)
        sp = SamplingParams(max_new_tokens=v.max_new_tokens or self.cfg.rollout.max_new_tokens, temperature=0.0,
                            ignore_eos=self.cfg.rollout.ignore_eos)
        groups = generate_rollouts(self.generator, self.tokenizer, self.task, self.val_prompts, sp, 1, self.max_len)
        return summarize(groups, self.task.reward_components)

    def sync_weights(self) -> None:
        sync_weights_(self.generator.model, self.policy)  # in place: the generator's CUDA graphs stay valid

    def warm_start(self) -> None:
        """Supervised steps on the task's reference solutions, so RL starts with some signal."""
        ws = self.cfg.warm_start
        if ws.steps <= 0:
            return
        sft = Trainer(self.policy, TrainerConfig(lr=ws.lr, warmup_steps=max(1, ws.steps // 10), schedule="cosine",
                                                 micro_batch_tokens=self.cfg.trainer.micro_batch_tokens,
                                                 max_grad_norm=1.0),
                      total_steps=ws.steps, attn_backend=self.trainer.attn_backend)
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
        cfg = self.cfg
        t0 = time.perf_counter()
        prompts = list(itertools.islice(self.train_prompts, cfg.rollout.prompts_per_step))
        groups = generate_rollouts(self.generator, self.tokenizer, self.task, prompts, self.sampling(step),
                                   cfg.rollout.group_size, self.max_len)
        assign_advantages(groups, normalize_std=cfg.rollout.advantage_std_norm and cfg.trainer.loss.kind != "dr_grpo",
                          kind=cfg.rollout.advantage)
        t1 = time.perf_counter()
        rollouts = [r for g in groups for r in g]
        if not rollouts:
            raise ValueError(f"step {step + 1}: every prompt was skipped: none fits generator.max_model_len="
                             f"{self.max_len} with {cfg.rollout.max_new_tokens} new tokens")
        self.check_rewards(rollouts)
        tm = self.trainer.step([r.train_sequence() for r in rollouts], temperature=cfg.rollout.temperature)
        t2 = time.perf_counter()
        self.sync_weights()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        times = {"generate_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2, "step_s": t3 - t0}
        row = step_metrics(step, groups, self.task.reward_components, tm, times)
        self.run_dir.log_metrics(row)
        self.run_dir.log_samples(sample_rows(step, rollouts[: cfg.samples_per_step]))
        return row

    def check_rewards(self, rollouts: list[Rollout], patience: int = 3) -> None:
        """Stop the run when the reward failed on every completion of `patience` consecutive steps: a reward
        that cannot score anything would otherwise train on all-zero rewards forever."""
        errors = [r.reward_error for r in rollouts if r.reward_error is not None]
        self.reward_failed_steps = self.reward_failed_steps + 1 if len(errors) == len(rollouts) else 0
        if self.reward_failed_steps >= patience:
            raise RewardError(f"task {self.task.name!r}: the reward failed on every completion of {patience} "
                              f"steps in a row; stopping (last error: {errors[-1]})")

    def save_training_checkpoint(self, step: int, pre: ValidationResult) -> Path:
        """Checkpoint after `step` completed steps; pre-validation goes in its meta, as a resume skips it."""
        return save_training_checkpoint(self.run_dir.checkpoints, step, self.policy, self.trainer,
                                        data_position=self.train_prompts.position, tokenizer=self.tokenizer,
                                        meta={"pre_validation": pre.__dict__, "total_steps": self.cfg.steps},
                                        keep_last=self.cfg.checkpoint.keep_last)

    def restore(self, path: Path) -> tuple[int, ValidationResult, list[dict[str, Any]]]:
        """Continue from a training checkpoint: policy weights (in place, then synced to the generator),
        optimizer, schedule, KL reference, RNG and data position; log rows written after it are dropped, so a
        run killed between a checkpoint and its death has no duplicate steps. Returns (first step, pre, earlier
        rows). A checkpoint without KL reference weights (saved with kl_coef 0) leaves the reference at the
        run's initial weights: the RL starting policy when there was no warm start."""
        ckpt = load_training_checkpoint(path, self.policy, self.trainer)
        self.sync_weights()
        self.train_prompts = PromptStream(self.task, self.cfg.seed, start=ckpt.data_position)
        earlier = self.run_dir.rewind(ckpt.step)
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
            self.run_dir.close_loggers()

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

    def rl_steps(self, start: int, pre: ValidationResult, result: RunResult) -> None:
        """Steps start..cfg.steps, each with its console line (ETA from this session's mean step time); a checkpoint
        every checkpoint.every steps, every checkpoint.every_minutes, at the end (checkpoint.final), and when
        SIGTERM / Ctrl-C asked to stop with steps not yet saved."""
        cfg, ck = self.cfg, self.cfg.checkpoint
        t0 = last_saved_t = time.perf_counter()
        last_saved = start
        with GracefulStop() as stop:
            for step in range(start, cfg.steps):
                row = self.step(step)
                self.steps_done = done = step + 1
                result.steps.append(row)
                now = time.perf_counter()
                print(step_line(row, cfg.steps, eta_s=(now - t0) / (done - start) * (cfg.steps - done)), flush=True)
                if ((done == cfg.steps and ck.final) or (ck.every > 0 and done % ck.every == 0)
                        or (ck.every_minutes > 0 and now - last_saved_t >= 60 * ck.every_minutes)
                        or (stop.requested and done > last_saved)):
                    with self.timed("checkpoint_s"):
                        self.save_training_checkpoint(done, pre)
                    last_saved, last_saved_t = done, time.perf_counter()
                if stop.requested:
                    self.stop_signal = stop.requested
                    raise KeyboardInterrupt

    def _run(self) -> RunResult:
        cfg = self.cfg
        split = ", ".join(f"{k}={v:.2f}" for k, v in self.startup.items())
        print(f"model: {self.model_source}", flush=True)
        print(f"startup: {split} | device={self.device} attn={self.attn_backend} run_dir={self.run_dir.path}",
              flush=True)
        self.warm_up()
        if self.compile_s:
            warm = ", ".join(f"{k}={self.startup[k]:.2f}" for k in
                             ("generator_compile_s", "graph_capture_s", "trainer_compile_s", "trainer_graph_capture_s"))
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
        self.rl_steps(start, pre, result)
        with self.timed("validation_s"):
            post = result.post = self.validate()
        if cfg.checkpoint.final:
            with self.timed("checkpoint_s"):
                save_checkpoint(self.policy, self.run_dir.checkpoints / "final", dtype=torch.float32,
                                tokenizer=self.tokenizer)
        write_summary(self.run_dir.path / "summary.json", result, phases=self.phase_s,
                      wall_s=time.perf_counter() - self.t_start, compile_s=self.compile_s, trainer=self.trainer,
                      device=self.device)
        self.run_dir.log_metrics({"validation/pre": pre.__dict__, "validation/post": post.__dict__}, step=cfg.steps)
        if roi := compile_roi(self.compile_s, cfg.compile.eager_step_s, result.steps):
            print(roi, flush=True)
        print("Summary:")
        print(f"  Pre:  {pre.line()}")
        print(f"  Post: {post.line()}", flush=True)
        return result


def train(cfg: RunConfig, progress: bool = True, resume: str | Path | None = None) -> RunResult:
    """Run GRPO; `resume` (a run dir or one of its checkpoints) continues a stopped run."""
    return GRPORun(cfg, progress, resume=resume).run()
