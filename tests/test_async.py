"""Bounded staleness (rollout.max_staleness K, #44), colocated: K = 0 is the lock-step loop; with K = 1 the producer
generates step t + 1's batch with the weights of version t before the trainer takes step t's, every sample's lag
(the trainer's version minus the one that generated it) is at most K, and a run killed after a checkpoint resumes
consuming the same prompts; with dynamic sampling, LoRA, multi-turn episodes and on 2 gloo ranks too."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from monorl.agent.env import EpisodeEnv, TurnResult
from monorl.agent.envs.tiny_tools import TinyToolsTask
from monorl.cliargs import run_config
from monorl.config import RolloutSection
from monorl.rl.rollouts.producer import RolloutBatch
from monorl.rl.rollouts.sources import AheadRollouts, RolloutBuffer
from monorl.run.checkpoints.files import read_meta
from monorl.run.grpo import GRPORun
from monorl.tasks.base import Prompt
from tests.conftest import digits_cfg
from tests.test_resume import killed_copy, small_cfg, step_rows

K1 = {"rollout.max_staleness": "1"}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """One thread, as the ranks of tests/test_distributed.py run: two threads on a loaded 2-core machine spin
    against each other (a tiny model's decode step went from milliseconds to tens of them)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def record_batches(run: GRPORun) -> list[dict[str, Any]]:
    """What the trainer consumes, step by step: its version then, and each sample's prompt, tokens, log-probs and
    versions (recorded as the consumer gets them)."""
    seen: list[dict[str, Any]] = []
    consume = run.consumer.consume

    def recording(batch: RolloutBatch, **kw: Any) -> Any:
        rollouts = [r for g in batch.groups for r in g]
        seen.append({"step": batch.step, "trainer_version": run.consumer.policy_version,
                     "prompts": [g[0].prompt.text for g in batch.groups],
                     "completions": [r.completion_ids for r in rollouts], "logprobs": [r.logprobs for r in rollouts],
                     "versions": [r.policy_version for r in rollouts],
                     "token_versions": [r.token_versions for r in rollouts]})
        return consume(batch, **kw)

    run.consumer.consume = recording  # type: ignore[method-assign]
    return seen


def assert_lag_at_most(seen: list[dict[str, Any]], k: int) -> None:
    for b in seen:
        lags = [b["trainer_version"] - v for v in b["versions"]]
        assert all(0 <= lag <= k for lag in lags), (b["step"], lags)


def test_max_staleness_must_be_non_negative() -> None:
    with pytest.raises(ValueError, match="rollout.max_staleness must be >= 0"):
        RolloutSection(max_staleness=-1)


def test_buffer_is_bounded_and_first_in_first_out() -> None:
    buf = RolloutBuffer(2)
    a, b = (RolloutBatch(i, None, None, 0) for i in range(2))  # type: ignore[arg-type]
    buf.put(a)
    buf.put(b)
    with pytest.raises(RuntimeError, match="buffer full"):
        buf.put(a)
    assert [buf.take().step, buf.take().step] == [0, 1]
    with pytest.raises(RuntimeError, match="buffer empty"):
        buf.take()


@pytest.fixture(scope="module")
def on_policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]], GRPORun]:
    run_dir = tmp_path_factory.mktemp("async") / "k0"
    run = GRPORun(small_cfg(run_dir), progress=False)
    seen = record_batches(run)
    run.run()
    return run_dir, seen, run


@pytest.fixture(scope="module")
def one_ahead(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]], GRPORun]:
    run_dir = tmp_path_factory.mktemp("async") / "k1"
    run = GRPORun(small_cfg(run_dir, **K1), progress=False)
    seen = record_batches(run)
    run.run()
    return run_dir, seen, run


def test_k0_is_the_lock_step_loop(on_policy: tuple[Path, list[dict[str, Any]], GRPORun], tmp_path: Path) -> None:
    """K = 0 is today's loop: each step's batch produced right before it is trained on, by the weights of the step
    before. A hand-written lock-step loop over the same parts (produce(t), consume) reaches the same weights bit
    for bit, and the metrics rows carry no staleness keys."""
    run_dir, seen, run = on_policy
    ref = GRPORun(small_cfg(tmp_path / "ref", **{"checkpoint.every": "0"}), progress=False)
    ref.warm_start()
    for step in range(ref.cfg.steps):
        batch = ref.producer.produce(step)
        assert [g[0].prompt.text for g in batch.groups] == seen[step]["prompts"]
        assert [r.logprobs for g in batch.groups for r in g] == seen[step]["logprobs"]
        ref.consumer.consume(batch)
    for (name, a), b in zip(run.policy.state_dict().items(), ref.policy.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert all(b["versions"] == [b["trainer_version"]] * len(b["versions"]) for b in seen)  # lag 0
    rows = step_rows(run_dir)
    assert not any(k.startswith(("staleness/", "async/")) for r in rows for k in r)


def test_k1_trains_on_batches_one_version_old(one_ahead: tuple[Path, list[dict[str, Any]], GRPORun],
                                              on_policy: tuple[Path, list[dict[str, Any]], GRPORun],
                                              tmp_path: Path) -> None:
    """K = 1: steps 0 and 1 train on batches both generated by the starting weights (version 0) -- exactly the
    batches an untrained producer makes -- and every later step on the batch generated one version before it;
    the prompts consumed, in order, are the on-policy run's; the metrics say lag and buffer depth."""
    run_dir, seen, _ = one_ahead
    assert [b["trainer_version"] for b in seen] == [0, 1, 2, 3]
    assert [sorted(set(b["versions"])) for b in seen] == [[0], [0], [1], [2]]
    assert_lag_at_most(seen, 1)
    fresh = GRPORun(small_cfg(tmp_path / "fresh", **K1), progress=False)
    fresh.warm_start()
    for step in (0, 1):  # no trainer step in between: both from version 0's weights
        batch = fresh.producer.produce(step)
        assert [r.completion_ids for g in batch.groups for r in g] == seen[step]["completions"]
        assert [r.logprobs for g in batch.groups for r in g] == seen[step]["logprobs"]
    # step 0 is the on-policy run's step 0; from step 1 on the rollouts differ (older weights), the prompts do not
    assert seen[0]["logprobs"] == on_policy[1][0]["logprobs"]
    assert seen[1]["logprobs"] != on_policy[1][1]["logprobs"]
    assert [b["prompts"] for b in seen] == [b["prompts"] for b in on_policy[1]]
    rows = step_rows(run_dir)
    assert [r["staleness/max"] for r in rows] == [0, 1, 1, 1]
    assert [r["staleness/mean"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert [r["staleness/token_mean"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert [r["async/buffer_depth"] for r in rows] == [1, 1, 1, 0]  # nothing is produced past the last step
    timed = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[1])
    assert timed["time/consumer_idle_s"] >= 0 and timed["time/producer_idle_s"] >= 0
    assert any(r["loss"] != 0.0 for r in rows)


def test_k1_resume_consumes_the_same_prompts(one_ahead: tuple[Path, list[dict[str, Any]], GRPORun],
                                            tmp_path: Path) -> None:
    """Killed after step 2's checkpoint (batch 3 already produced ahead), a K = 1 run resumes at the first prompt
    the trainer had not consumed: every step consumes the uninterrupted run's prompts, none twice, none lost. The
    buffered batch is generated again, by the resumed weights (version 2, lag 0 at step 2)."""
    full, seen, _ = one_ahead
    meta = read_meta(full / "checkpoints" / "step_000002")
    assert meta["data_position"] == 4 + 2 * 2  # warm start's 4 prompts + 2 steps of 2, not batch 3's
    run_dir = tmp_path / "resumed"
    killed_copy(full, run_dir, 2)
    run = GRPORun(small_cfg(run_dir, **K1), progress=False, resume=run_dir / "checkpoints" / "step_000002")
    resumed = record_batches(run)
    run.run()
    assert [b["prompts"] for b in resumed] == [b["prompts"] for b in seen[2:]]
    assert [b["trainer_version"] for b in resumed] == [2, 3]
    assert [sorted(set(b["versions"])) for b in resumed] == [[2], [2]]
    rows = step_rows(run_dir)
    assert rows[:2] == step_rows(full)[:2]
    assert [r["staleness/max"] for r in rows] == [0, 1, 0, 1]


def _prompts(run_dir: Path) -> list[list[str]]:
    """Each step's prompts (one per group), from samples.jsonl (every sample logged)."""
    out: dict[int, list[str]] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        s = json.loads(line)
        texts = out.setdefault(s["step"], [])
        if not texts or texts[-1] != s["prompt"]:
            texts.append(s["prompt"])
    return [out[k] for k in sorted(out)]


def test_k1_with_dynamic_sampling(tmp_path: Path) -> None:
    """Filtering happens in the producer: each batch ahead draws as many rounds as it needs; the trainer still
    takes one full batch per step, no sample older than one version, and a checkpoint stores the end of the
    consumed batch's prompts (rounds included)."""
    cfg = small_cfg(tmp_path / "run", **K1, **{"rollout.dynamic_sampling": "true", "rollout.max_sampling_rounds": "3",
                                              "rollout.dynamic_sampling_metric": "reward", "steps": "3"})
    run = GRPORun(cfg, progress=False)
    seen = record_batches(run)
    ends: list[int] = []  # each consumed batch's stream end, as the trainer takes it
    take = run.rollouts.buffer.take

    def taking() -> RolloutBatch:
        batch = take()
        ends.append(batch.stream_end)
        return batch

    run.rollouts.buffer.take = taking  # type: ignore[method-assign]
    run.run()
    assert_lag_at_most(seen, 1)
    rows = step_rows(tmp_path / "run")
    assert [r["staleness/max"] for r in rows] == [0, 1, 1]
    assert all(r["dynamic_sampling/rounds"] >= 1 for r in rows)
    assert ends == sorted(ends) and ends[0] >= 4 + 2
    for step, end in zip((1, 2, 3), ends, strict=True):
        assert read_meta(tmp_path / "run" / "checkpoints" / f"step_{step:06d}")["data_position"] == end


def test_k1_with_lora(tmp_path: Path) -> None:
    lora = {"lora.rank": "8", "lora.alpha": "16", "trainer.lr": "3e-2", "warm_start.steps": "0", "steps": "3",
            "checkpoint.every": "0"}
    run = GRPORun(small_cfg(tmp_path / "run", **K1, **lora), progress=False)
    seen = record_batches(run)
    run.run()
    assert [sorted(set(b["versions"])) for b in seen] == [[0], [0], [1]]
    assert_lag_at_most(seen, 1)
    assert any(r["loss"] != 0.0 for r in step_rows(tmp_path / "run"))


class ChattyEnv(EpisodeEnv):
    """Answers every turn with a user message, up to 3 turns: an untrained model's episodes then have several
    turns (each ended by the end-of-turn token) and inserted tokens between them."""

    def _start(self, prompt: Prompt) -> list[dict[str, Any]]:
        return [{"role": "user", "content": prompt.text}]

    def _respond(self, assistant_text: str, last_turn: bool) -> TurnResult:
        return TurnResult([{"role": "user", "content": "and?"}])


class ChattyTask(TinyToolsTask):
    def make_env(self, prompt: Prompt) -> EpisodeEnv:
        return ChattyEnv(max_turns=3)


EPISODES = {"task.name": f"{__file__}:ChattyTask", "steps": "3", "device": "cpu", "warm_start.steps": "0",
            "validation.num_prompts": "1", "rollout.prompts_per_step": "2", "rollout.group_size": "4",
            "rollout.max_new_tokens": "48", "checkpoint.every": "0", "samples_per_step": "0", **K1}


def test_k1_with_multi_turn_episodes(tmp_path: Path) -> None:
    """Multi-turn episodes (the tiny_tools preset's engine and renderer): each sampled token records the version
    that sampled it (inserted tokens -1); a batch played ahead is trained one version later."""
    run = GRPORun(run_config("tiny_tools", {**EPISODES, "run_dir": str(tmp_path / "run")}), progress=False)
    seen = record_batches(run)
    run.run()
    assert [sorted(set(b["versions"])) for b in seen] == [[0], [0], [1]]
    assert_lag_at_most(seen, 1)
    for b in seen:
        for v, tv in zip(b["versions"], b["token_versions"], strict=True):
            assert tv is not None and set(tv) <= {v, -1} and v in tv
    assert any(-1 in tv for b in seen for tv in b["token_versions"])  # tool results were inserted
    assert [r["staleness/max"] for r in step_rows(tmp_path / "run")] == [0, 1, 1]


def test_k1_on_two_gloo_ranks(tmp_path: Path) -> None:
    """--nproc 2: each rank generates its share of every batch ahead and gathers; both take the same batches in
    the same order: prompts, rollouts and lags equal the one-rank K = 1 run's (trainer metrics to fp32 reduction
    order)."""
    from tests.test_distributed import assert_rows_close, run
    from tests.test_resume import OVERRIDES

    # no warm start: its update's last bits differ with the rank count, and the rollouts are compared exactly
    over = {**OVERRIDES, **K1, "steps": "3", "warm_start.steps": "0", "checkpoint.every": "0"}
    GRPORun(run_config("tiny", {**over, "run_dir": str(tmp_path / "one")}), progress=False).run()
    args = [a for k, v in {**over, "run_dir": str(tmp_path / "two")}.items() for a in (f"--{k}", v)]
    r = run([sys.executable, "-m", "monorl.cli", "train", "--nproc", "2", *args], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    two, one = step_rows(tmp_path / "two"), step_rows(tmp_path / "one")
    assert [row["staleness/max"] for row in two] == [0, 1, 1]
    assert_rows_close(_drop_micro(two), _drop_micro(one))
    assert _prompts(tmp_path / "two") == _prompts(tmp_path / "one")


def _drop_micro(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith("micro_batches")} for r in rows]


INFLIGHT = {**K1, "rollout.inflight_updates": "true"}


def test_inflight_updates_need_staleness_and_one_process() -> None:
    with pytest.raises(ValueError, match="inflight_updates needs rollout.max_staleness >= 1"):
        RolloutSection(inflight_updates=True)
    two_ranks = SimpleNamespace(world=SimpleNamespace(size=2))
    with pytest.raises(ValueError, match="inflight_updates runs on one process"):
        AheadRollouts(two_ranks, 1, 4, lambda: 0, inflight_updates=True)  # type: ignore[arg-type]


def test_inflight_update_swaps_weights_between_decode_chunks(
        one_ahead: tuple[Path, list[dict[str, Any]], GRPORun], tmp_path: Path) -> None:
    """K = 1 with in-flight updates: batch t + 1 starts on version t's weights and the trainer's step t runs after
    its first decode chunk; the sequences go on with version t + 1's weights, keeping their KV. Against the K = 1
    run without them, in batches 1 and 2 (whose version-t weights both runs share: trained on the same batch 0):
    the tokens recorded at version t are that run's tokens, log-probs included (same weights, same noise by
    position); after the swap the log-probs are the new weights'. Every sample's oldest token is at most 1
    version behind; the token-level lag drops below it."""
    _, plain, _ = one_ahead
    run = GRPORun(small_cfg(tmp_path / "run", **INFLIGHT), progress=False)
    seen = record_batches(run)
    run.run()
    assert_lag_at_most(seen, 1)
    assert [b["prompts"] for b in seen] == [b["prompts"] for b in plain]
    assert seen[0]["logprobs"] == plain[0]["logprobs"]  # batch 0 is made before any trainer step
    for b in seen[1:]:  # one swap, between chunks
        for tv in b["token_versions"]:
            assert tv == [b["step"] - 1] * tv.count(b["step"] - 1) + [b["step"]] * tv.count(b["step"])
    for step in (1, 2):
        got, want, old = seen[step], plain[step], step - 1
        swapped = 0
        for toks, lps, tv, toks0, lps0 in zip(got["completions"], got["logprobs"], got["token_versions"],
                                              want["completions"], want["logprobs"], strict=True):
            before = tv.count(old)
            assert toks[:before] == toks0[:before] and lps[:before] == lps0[:before]
            if before < min(len(toks), len(toks0)) and toks[before] == toks0[before]:
                swapped += lps[before] != lps0[before]
        assert swapped > 0, step  # the first token after the swap is scored by other weights
    rows = step_rows(tmp_path / "run")
    assert [r["staleness/max"] for r in rows] == [0, 1, 1, 1]
    assert all(r["staleness/token_mean"] < r["staleness/mean"] == 1.0 for r in rows[1:])


def test_inflight_update_in_multi_turn_episodes(tmp_path: Path) -> None:
    """Episodes in flight take the new weights between engine steps: along each episode the sampled tokens'
    versions never go back, and some episodes hold tokens of both versions."""
    run = GRPORun(run_config("tiny_tools", {**EPISODES, **INFLIGHT, "run_dir": str(tmp_path / "run")}),
                  progress=False)
    seen = record_batches(run)
    run.run()
    assert_lag_at_most(seen, 1)
    mixed = 0
    for b in seen[1:]:
        for tv in b["token_versions"]:
            sampled = [v for v in tv if v >= 0]
            assert sampled == sorted(sampled) and set(sampled) <= {b["step"] - 1, b["step"]}
            mixed += len(set(sampled)) == 2
    assert mixed > 0


@pytest.mark.parametrize("inflight", [False, True])
def test_reward_failing_ahead_saves_what_was_trained(tmp_path: Path, inflight: bool) -> None:
    """The reward fails on every completion: the third batch produced stops the run. Without in-flight updates it is
    made before step 1 trains: 1 step kept. With them it is made during step 1's trainer step: that step
    completes and is saved (2 steps), and the run stops at the next. Either way the checkpoint's data position is
    the end of the last batch trained on."""
    from monorl.config import CheckpointSection
    from monorl.tasks.base import RewardError

    cfg = digits_cfg(tmp_path, steps=6)
    cfg.task.name = "tests.test_cli_errors:AlwaysFails"
    cfg.validation.num_prompts = 0
    cfg.rollout.max_staleness, cfg.rollout.inflight_updates = 1, inflight
    cfg.checkpoint = CheckpointSection(every=0, final=False)
    run = GRPORun(cfg, progress=False)
    with pytest.raises(RewardError, match="failed on every completion of 3 steps in a row"):
        run.run()
    done = 2 if inflight else 1
    assert len(step_rows(tmp_path / "run")) == done
    meta = read_meta(tmp_path / "run" / "checkpoints" / f"step_{done:06d}")
    assert meta["data_position"] == done * cfg.rollout.prompts_per_step
    assert run.trainer.step_count == done


@pytest.mark.parametrize("stops", [False, True])
def test_generator_swaps_weights_between_chunks(stops: bool) -> None:
    """`Generator.generate(between_chunks=)`: new weights loaded between decode chunks take over the sequences in
    flight, which keep their KV cache. Tokens record the version of the weights that sampled them, also when a
    chunk's tokens are read after the next chunk was queued (no stops: 256-token chunks, read deferred). Against
    the same generation without the update, the tokens before it are equal, log-probs included; the first one
    after it is scored by the new weights."""
    from monorl.generate.generator import Generator, GeneratorConfig
    from monorl.generate.sampling import SamplingParams
    from monorl.model.config import model_shape
    from monorl.model.decoder import build_model

    model = build_model(model_shape("tiny"), "cpu", torch.float32, seed=0)
    moved = build_model(model_shape("tiny"), "cpu", torch.float32, seed=1)  # "the trainer's next weights"
    chunk = 4 if stops else 256
    sampling = SamplingParams(max_new_tokens=chunk + 8, temperature=1.0, seed=3, ignore_eos=not stops)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]

    def generate(update: bool) -> list[Any]:
        g = Generator(model, GeneratorConfig(max_num_seqs=8, max_model_len=chunk + 24, stop_check_interval=chunk),
                      eos_token_ids=(1,) if stops else ())

        def load() -> None:
            if g.policy_version == 0:
                g.load_weights_(moved)
                g.policy_version = 1

        outs = g.generate(prompts, sampling, n=2, between_chunks=load if update else None)
        return [c for cs in outs for c in cs]

    plain, swapped = generate(False), generate(True)
    assert all(c.versions == [0] * len(c.token_ids) for c in plain)
    first = 1 + chunk  # the prefill's token, then one chunk
    assert any(len(c.token_ids) > first for c in swapped)
    rescored = 0
    for a, b in zip(plain, swapped, strict=True):
        n = min(first, len(b.token_ids))
        assert b.versions == [0] * n + [1] * (len(b.token_ids) - n)
        assert (a.token_ids[:n], a.logprobs[:n]) == (b.token_ids[:n], b.logprobs[:n])
        if len(b.token_ids) > first and a.token_ids[first] == b.token_ids[first]:
            assert a.logprobs[first] != b.logprobs[first]
            rescored += 1
    assert rescored > 0
