"""Continuous batches (`rl.rollouts.continuous`): a generator rank with in-flight updates makes its batches back to
back on one engine. Here in one process: two batches admitted together come out as the batch-by-batch producer
makes them (same prompts, tokens, log-probs, rewards, stream positions) while their samples share the engine; the
whole loop (1 and 2 generators over gloo, a kill and resume) runs in tests/test_disaggregated.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from monorl.rl.rollouts.continuous import ContinuousBatches, runs_continuous
from monorl.run.grpo import GRPORun
from tests.conftest import digits_cfg


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _run(tmp_path: Path, name: str) -> GRPORun:
    cfg = digits_cfg(tmp_path / name)
    cfg.batch_invariant = True  # generate() and the engine batch samples differently: bitwise only in the mode
    cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 3, 4, 10
    cfg.validation.num_prompts = 0
    cfg.generator.max_num_seqs = 5  # fewer slots than one batch's samples: later samples take freed ones
    return GRPORun(cfg, progress=False)


def _view(batch) -> dict[str, Any]:
    rollouts = [r for g in batch.groups for r in g]
    return {"step": batch.step, "prompts": [g[0].prompt.text for g in batch.groups],
            "prompt_ids": [r.prompt_ids for r in rollouts], "tokens": [r.completion_ids for r in rollouts],
            "logprobs": [r.logprobs for r in rollouts], "finish": [r.finish_reason for r in rollouts],
            "rewards": [r.rewards for r in rollouts], "version": batch.policy_version,
            "stream_end": batch.stream_end}


def test_two_batches_on_one_engine_equal_the_batch_by_batch_producer(tmp_path: Path) -> None:
    ref = _run(tmp_path, "ref")
    expected = [_view(ref.producer.produce(step)) for step in (0, 1)]
    run = _run(tmp_path, "cont")
    assert runs_continuous(run.producer)
    batches = ContinuousBatches(run.producer)
    batches.admit(0)
    batches.admit(1)  # queued behind batch 0: its samples take the slots batch 0's free
    overlapped = False  # some decode chunk ran samples of both batches
    while batches.finished_upto() < 2:
        batches.step()
        overlapped |= {ep.id[2] for ep in batches.engine.running} == {0, 1}
    got = [_view(batches.take()) for _ in range(2)]
    assert got == expected
    assert not batches.engine.has_work() and not batches.open
    gen = run.producer.generator
    assert gen.cache.blocks.num_free() == gen.cache.blocks.usable_blocks
    assert overlapped


def test_not_continuous_where_batches_are_made_otherwise(tmp_path: Path) -> None:
    run = _run(tmp_path, "dyn")
    run.producer.cfg.rollout.dynamic_sampling = True
    assert not runs_continuous(run.producer)
