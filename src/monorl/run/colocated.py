"""The colocated placement: every rank generates and trains (one process, or FSDP ranks that split each step's
prompt groups). The trainer takes its batches from a producer of its own (`AheadRollouts`: in lock-step,
rollout.max_staleness 0, or up to K batches ahead) and publishes each update into the generator's copy in place."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

from monorl.generate.sampling import SamplingParams
from monorl.rl.consumer import CopyInPlace
from monorl.rl.rollouts.episodes import solution_sequence
from monorl.rl.rollouts.rollout import prompt_images
from monorl.rl.rollouts.sources import AheadRollouts
from monorl.run.parts import (
    Parts,
    build_checkpoints,
    build_consumer,
    build_producer,
    build_trainer,
    generator_builder,
    load_policy_part,
    open_run_dir,
    prepare_trainer_policy,
)
from monorl.run.stopping import check_learning_signal
from monorl.run.summary import format_duration
from monorl.run.trainer_steps import TrainerSteps
from monorl.train.packing import TrainSequence
from monorl.train.trainer import Trainer, TrainerConfig


def build(p: Parts) -> None:
    """policy, generator copy, trainer, producer, consumer, the producer as the rollout source, run dir, checkpoints."""
    cfg, boot = p.cfg, p.boot
    load_policy_part(p)
    # FSDP: the generator's copy is built once the policy is sharded, from the shards: each rank then holds the whole
    # policy alone at start-up, not beside the copy (Qwen3-32B LoRA on 4 H100s ran out of memory building it)
    from_shards = p.train_world.size > 1
    with boot.timed("generator_init_s"):
        build_generator = generator_builder(p)
        if not from_shards:
            p.generator = build_generator()
    t = time.perf_counter()
    ref_model = prepare_trainer_policy(p)
    if from_shards:
        with boot.timed("generator_init_s"):
            p.generator = build_generator()
        t += boot.timings["generator_init_s"]  # not the trainer's
    generator = p.generator
    assert generator is not None
    p.producer = build_producer(p, generator, lambda: p.trainer.step_count)
    p.trainer = build_trainer(p, ref_model)
    p.consumer = build_consumer(p, p.trainer, CopyInPlace(generator), routing_model=generator.model)
    ro = cfg.rollout
    p.rollouts = AheadRollouts(p.producer, ro.max_staleness, cfg.steps, lambda: p.trainer.step_count,
                               ro.inflight_updates)
    p.run_dir = open_run_dir(p)
    p.checkpoints = build_checkpoints(p, config_source=generator.model)
    boot.timings["trainer_init_s"] = time.perf_counter() - t  # KL reference, Trainer (AdamW), run dir, loggers


class Colocated(TrainerSteps):
    """The trainer side's run, with the producer's own validation and warm start."""

    def samplers(self) -> list[SamplingParams]:
        return self.parts.producer.warm_up_samplers()

    def after_publish(self, step: int) -> Callable[[], None] | None:
        """The prompts of the batch the producer makes next, tokenized while the GPU trains."""
        nxt = step + 1 + self.cfg.rollout.max_staleness
        producer = self.parts.producer
        return (lambda: producer.encode_ahead(nxt)) if nxt < self.cfg.steps else None

    def validate_during(self, step: int, row: dict[str, Any]) -> None:
        every = self.cfg.validation.every
        if every > 0 and self.spec.val_prompts and (step + 1) % every == 0 and step + 1 < self.cfg.steps:
            with self.timed("validation_s"):
                row.update(self.validate().metrics("val/"))

    def check_signal(self, rows: list[dict[str, Any]]) -> None:
        if warning := check_learning_signal(rows, self.cfg.stop_without_signal):
            print(warning, flush=True)

    def warm_start(self) -> None:
        """Supervised steps on the task's reference solutions, so RL starts with some signal."""
        ws, steps = self.cfg.warm_start, self.spec.warm_start_steps
        if steps <= 0:
            return
        sft = Trainer(self.policy, TrainerConfig(lr=ws.lr, warmup_steps=max(1, steps // 10), schedule="cosine",
                                                 micro_batch_tokens=self.cfg.trainer.micro_batch_tokens,
                                                 max_grad_norm=1.0),
                      total_steps=steps, attn_backend=self.trainer.attn_backend, world=self.world)
        tokenizer, task, producer = self.spec.tokenizer, self.spec.task, self.parts.producer
        eos = tokenizer.eos_token_id
        episodes = producer.episodes  # an agent task's reference episodes: assistant turns train, the rest not
        bar = tqdm(range(steps), desc="warm start", disable=not self.progress, leave=False)
        every, t0 = max(1, steps // 10), time.perf_counter()  # piped output: a line per tenth instead of a bar
        for i in bar:
            seqs = []
            for p in itertools.islice(producer.stream, ws.batch_size):
                if episodes is not None:
                    ids, sol, mask = solution_sequence(episodes.renderer, task, p)
                    seqs.append(TrainSequence(ids, sol, [0.0] * len(sol), 0.0, completion_mask=mask))
                    continue
                # a prompt's images as the rollouts feed them (placeholders expanded by the generator's processor)
                (ids,), (images,) = prompt_images(self.generator, [p], [tokenizer.encode(task.render(p, tokenizer))])
                sol = tokenizer.encode(task.solution(p)) + [eos]
                seqs.append(TrainSequence(ids, sol, [0.0] * len(sol), 0.0, images=images))
            m = sft.sft_step(seqs)
            bar.set_postfix(loss=f"{m['loss']:.3f}")
            if not self.progress and ((i + 1) % every == 0 or i + 1 == steps):
                eta = (time.perf_counter() - t0) / (i + 1) * (steps - i - 1)
                print(f"warm start {i + 1}/{steps} | loss {m['loss']:.4f} | eta {format_duration(eta)}", flush=True)
        self.consumer.publish()
