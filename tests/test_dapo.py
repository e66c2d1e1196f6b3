"""DAPO's pieces: dynamic sampling (zero-variance groups dropped, the batch kept full, a cap on rounds), overlong
filtering (rollout.mask_truncated), the soft overlong punishment for any task; the presets and config rules."""

import json
from pathlib import Path

import pytest
import torch

from monorl.cliargs import run_config
from monorl.config import RolloutSection
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.presets import PRESETS, preset
from monorl.rl.rollouts.dynamic_sampling import fill_batch, has_signal, round_size, sampling_metric
from monorl.rl.rollouts.rollout import OVERLONG, Rollout, add_overlong_penalty
from monorl.run.grpo import GRPORun
from monorl.tasks.base import Prompt
from monorl.tasks.rewards import soft_overlong_penalty
from monorl.train.packing import TrainSequence
from monorl.train.trainer import Trainer, TrainerConfig
from tests.conftest import DigitsTask, digits_cfg

# -- dynamic sampling -------------------------------------------------------------------------------------------


def _group(tag, rewards):
    return [Rollout(Prompt(tag, None), [1], [2], [0.0], "stop", "", {"r": x}) for x in rewards]


SIG, FLAT = [1.0, 0.0], [0.5, 0.5]  # a group with signal, one without (all rewards equal)


def _scripted(rounds):
    """draw(n, round) returning the scripted groups of each round (each a list of (tag, rewards)), recording n."""
    calls = []

    def draw(n, round_):
        calls.append((n, round_))
        return [_group(tag, rw) for tag, rw in rounds[round_]]

    return draw, calls


def test_fill_batch_keeps_the_batch_full():
    draw, calls = _scripted([
        [("a", SIG), ("b", FLAT), ("c", FLAT), ("d", SIG)],  # 2 of 4 kept
        [("e", FLAT), ("f", SIG), ("g", SIG), ("h", SIG)],   # 3 more: one surplus
    ])
    b = fill_batch(draw, 4, dynamic=True, max_rounds=4)
    assert [g[0].prompt.text for g in b.groups] == ["a", "d", "f", "g"]  # in order, surplus "h" left out
    assert calls == [(4, 0), (4, 1)]  # deficit 2 at keep rate 2/4: ceil(2 * 4 / 2) = 4 prompts
    assert (b.rounds, b.sampled_groups, b.zero_std_groups) == (2, 8, 3)
    assert b.metrics(True) == {"frac_reward_zero_std": 3 / 8, "dynamic_sampling/rounds": 2,
                               "dynamic_sampling/sampled_groups": 8, "dynamic_sampling/groups": 4,
                               "dynamic_sampling/dropped_groups": 4}


def test_fill_batch_cap_fallback_and_off():
    rounds = [[("a", SIG), ("b", FLAT), ("c", FLAT), ("d", FLAT)], [("e", FLAT)] * 4, [("f", SIG)] * 4]
    draw, calls = _scripted(rounds)
    b = fill_batch(draw, 4, dynamic=True, max_rounds=2)  # the cap: 2 rounds, 1 group with signal
    assert [g[0].prompt.text for g in b.groups] == ["a"] and b.rounds == 2 and calls == [(4, 0), (4, 1)]
    draw, _ = _scripted([[("a", FLAT)] * 4, [("b", FLAT)] * 4])
    b = fill_batch(draw, 4, dynamic=True, max_rounds=2)  # no signal anywhere: the first round, as without the filter
    assert [g[0].prompt.text for g in b.groups] == ["a"] * 4 and b.metrics(True)["dynamic_sampling/dropped_groups"] == 4
    draw, calls = _scripted(rounds)
    b = fill_batch(draw, 4, dynamic=False, max_rounds=4)  # off: one round, every group
    assert len(b.groups) == 4 and calls == [(4, 0)] and b.metrics(False) == {"frac_reward_zero_std": 0.75}
    # prompts per round: deficit / keep rate, between the deficit and prompts_per_step
    assert [round_size(4, 0, 4), round_size(4, 3, 4), round_size(8, 1, 8), round_size(8, 7, 8)] == [4, 2, 8, 2]


def test_all_wrong_group_of_different_lengths_is_filtered_on_accuracy():
    """DAPO eq. 11 / verl's recipe: the filter reads accuracy (the pass component), so an all-wrong group whose
    completions differ only in length -- and so in the overlong penalty, and the total reward -- is dropped; with
    dynamic_sampling_metric "reward" it would count as signal."""
    def group(tag, accs, lengths):
        return [Rollout(Prompt(tag, None), [1], [2] * n, [0.0] * n, "stop", "", {"accuracy": a},
                        weights={"accuracy": 1.0}) for a, n in zip(accs, lengths, strict=True)]

    wrong = group("wrong", [0.0, 0.0, 0.0, 0.0], [4, 8, 10, 12])
    mixed = group("mixed", [1.0, 0.0, 0.0, 0.0], [4, 4, 4, 4])
    add_overlong_penalty([wrong, mixed], max_new_tokens=12, buffer=4, factor=1.0)
    assert len({r.reward for r in wrong}) > 1  # the total reward differs: the old filter kept this group
    assert not has_signal(wrong, "accuracy") and has_signal(wrong, "reward") and has_signal(mixed, "accuracy")
    metric = sampling_metric(None, ("accuracy", OVERLONG), pass_component="accuracy")
    assert metric == "accuracy"
    calls = iter([[wrong, mixed], [mixed, mixed]])
    b = fill_batch(lambda n, round_: next(calls), 2, dynamic=True, max_rounds=2, metric=metric)
    assert [g[0].prompt.text for g in b.groups] == ["mixed", "mixed"] and b.rounds == 2
    calls = iter([[wrong, mixed]])
    b = fill_batch(lambda n, round_: next(calls), 2, dynamic=True, max_rounds=2, metric="reward")
    assert [g[0].prompt.text for g in b.groups] == ["wrong", "mixed"] and b.rounds == 1
    # None (not applicable) values are no signal: only the values the component applies to are compared
    assert not has_signal(group("none", [None, 1.0, None, 1.0], [1, 1, 1, 1]), "accuracy")
    # the config key: a component of the run or "reward"; default the pass component, else "reward"
    assert sampling_metric("reward", ("accuracy",), "accuracy") == "reward"
    assert sampling_metric(None, (), None) == "reward" and sampling_metric(OVERLONG, ("a", OVERLONG), "a") == OVERLONG
    with pytest.raises(ValueError, match="dynamic_sampling_metric 'acc' is neither 'reward' nor a reward component"):
        sampling_metric("acc", ("accuracy", OVERLONG), "accuracy")


class HalfFlat(DigitsTask):
    """Prompts with an even number score 0.25 whatever the completion (zero variance: dropped by dynamic
    sampling); odd ones score the share of digits."""

    name = "half_flat"

    def reward(self, prompt, completion):
        return {"digits": 0.25} if int(prompt.text.split()[-1]) % 2 == 0 else super().reward(prompt, completion)

    def train_prompts(self, seed=0, start=0):
        i = start
        while True:
            yield Prompt(text=f"Say numbers {i}", answer=None, meta={"index": i})
            i += 1


def test_dynamic_sampling_keeps_the_batch_size_in_the_loop(tmp_path):
    """Half the prompts give zero-variance groups: each step over-samples and still trains prompts_per_step groups,
    all with signal; the stream moves past every prompt drawn. With it: the overlong penalty and mask_truncated."""
    cfg = digits_cfg(tmp_path, steps=2)
    cfg.task.name = "tests.test_dapo:HalfFlat"
    cfg.checkpoint.final, cfg.validation.num_prompts = False, 0
    cfg.samples_per_step = 4 * 6
    r = cfg.rollout
    r.dynamic_sampling, r.max_sampling_rounds, r.overlong_buffer, r.overlong_penalty = True, 6, 4, 0.5
    r.mask_truncated = True
    run = GRPORun(cfg, progress=False)
    assert run.spec.components == ("digits", OVERLONG) and run.producer.metric == "digits"  # the pass component
    trained, sampled = [], []
    train_step, rollouts = run.trainer.step, run.producer.rollouts
    run.trainer.step = lambda seqs, **kw: trained.append(list(seqs)) or train_step(seqs, **kw)

    def recording_rollouts(*args):
        groups = rollouts(*args)
        sampled.extend(groups)
        return groups

    run.producer.rollouts = recording_rollouts
    result = run.run()
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    drawn = 0
    for row, seqs in zip(result.steps, trained, strict=True):
        assert row["dynamic_sampling/groups"] == 4 and len(seqs) == 4 * 6  # the batch is full
        groups = [seqs[i:i + 6] for i in range(0, len(seqs), 6)]
        assert all(any(s.advantage != 0 for s in g) for g in groups)  # each with signal
        drawn += row["dynamic_sampling/sampled_groups"]
        assert len([s for s in samples if s["step"] == row["step"]]) == 24 and row["rewards/overlong/mean"] <= 0
        # truncated completions are masked: they are not trained, and count no tokens
        masked = sum(s.masked for s in seqs)
        assert masked == round(row["completions/clipped_ratio"] * len(seqs))
        assert row["train_tokens"] == sum(len(s) for s in seqs if not s.masked)
    # the even prompts' flat groups were dropped and made up for by further rounds
    assert sum(r["dynamic_sampling/rounds"] for r in result.steps) > len(result.steps)
    assert all(r["frac_reward_zero_std"] > 0 for r in result.steps if r["dynamic_sampling/rounds"] > 1)
    assert run.producer.stream.position == drawn == len(sampled)  # every prompt drawn was consumed
    for r in (r for g in sampled for r in g):  # the soft overlong punishment: max_new_tokens 12, buffer 4
        penalty = soft_overlong_penalty(len(r.completion_ids), 12, 4)
        assert r.rewards[OVERLONG] == penalty and r.reward == pytest.approx(r.rewards["digits"] + 0.5 * penalty)
    assert any(r.rewards[OVERLONG] < 0 for g in sampled for r in g)


# -- overlong -----------------------------------------------------------------------------------------------------

def test_soft_overlong_penalty_by_hand():
    # DAPO eq. 13 with L_max 10, L_cache 4: 0 up to 6 tokens, then (6 - L) / 4, -1 from 10 on
    assert [soft_overlong_penalty(n, 10, 4) for n in (0, 5, 6, 7, 8, 10, 12)] == [0, 0, 0, -0.25, -0.5, -1, -1]
    groups = [[Rollout(None, [1], [2] * n, [0.0] * n, "stop", "", {"acc": 1.0}, weights={"acc": 2.0})
               for n in (6, 8)]]
    add_overlong_penalty(groups, max_new_tokens=10, buffer=4, factor=0.5)
    assert [r.rewards for r in groups[0]] == [{"acc": 1.0, OVERLONG: 0.0}, {"acc": 1.0, OVERLONG: -0.5}]
    assert [r.reward for r in groups[0]] == [2.0, 2.0 - 0.25]  # weighted: 2 * acc + 0.5 * overlong


def test_mask_truncated_gives_zero_loss_weight():
    """A masked (truncated) sequence changes nothing: the step equals the step without it, bit for bit, for a
    token-mean and a sequence-mean loss; a step of only masked sequences has zero loss and leaves the weights."""
    a = TrainSequence([1, 2, 3], [4, 5, 6], [-1.0, -2.0, -1.5], 1.0)
    cut = TrainSequence([7, 8], [9, 10, 11, 12], [-1.0] * 4, -1.0, masked=True)
    for kind in ("dapo", "grpo"):
        models = [build_model(model_shape("tiny"), "cpu", torch.float32, seed=0) for _ in range(2)]
        cfg = TrainerConfig(lr=1e-2, warmup_steps=0)
        cfg.loss.kind = kind
        m1 = Trainer(models[0], cfg, total_steps=3).step([a, cut])
        m2 = Trainer(models[1], cfg, total_steps=3).step([a])
        assert m1["loss"] == m2["loss"] != 0 and m1["train_tokens"] == m2["train_tokens"] == len(a)
        for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
            assert torch.equal(p, q)
    model = build_model(model_shape("tiny"), "cpu", torch.float32, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    m = Trainer(model, TrainerConfig(lr=1e-2, warmup_steps=0), total_steps=3).step([cut])
    assert m["loss"] == 0.0 and m["grad_norm"] == 0.0 and m["micro_batches"] == 0
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters(), strict=True))
    r = Rollout(None, [1], [2], [0.0], "length", "", {})
    assert r.train_sequence(mask_truncated=True).masked and not r.train_sequence().masked
    assert not Rollout(None, [1], [2], [0.0], "stop", "", {}).train_sequence(mask_truncated=True).masked


# -- config and presets -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, match", [
    (["--trainer.loss.kl_in_loss", "false"], "kl_in_loss=False reports the KL .* set kl_coef > 0"),
    (["--rollout.dynamic_sampling", "true", "--rollout.group_size", "1", "--rollout.advantage", "reinforce_pp"],
     "dynamic_sampling drops groups .*rollout.group_size >= 2"),
    (["--rollout.overlong_buffer", "30"], r"overlong_buffer must be in \[0, max_new_tokens=20\]"),
    (["--rollout.max_sampling_rounds", "0"], "max_sampling_rounds must be >= 1"),
    (["--validation.k", "0"], "validation.k must be >= 1"),
    (["--validation.every", "-1"], "validation.every must be >= 0"),
])
def test_config_errors_are_one_line(args, match):
    with pytest.raises(ValueError, match=match) as e:
        run_config("tiny", args)
    assert "\n" not in str(e.value)


def test_kl_as_metric_only_with_kl_coef():
    cfg = run_config("tiny", ["--trainer.loss.kl_in_loss", "false", "--trainer.loss.kl_coef", "0.1"])
    assert cfg.trainer.loss.kl_in_loss is False and cfg.trainer.loss.kl_coef == 0.1
    assert RolloutSection().dynamic_sampling is False and RolloutSection().overlong_buffer == 0


def test_unknown_pass_component_and_overlong_name_clash(tmp_path):
    cfg = digits_cfg(tmp_path)
    cfg.validation.pass_component = "nope"
    with pytest.raises(ValueError, match="validation.pass_component 'nope' is not a reward component"):
        GRPORun(cfg, progress=False)
    cfg.validation.pass_component, cfg.rollout.dynamic_sampling_metric = None, "nope"
    with pytest.raises(ValueError, match="dynamic_sampling_metric 'nope' is neither 'reward' nor a reward component"):
        GRPORun(cfg, progress=False)
    assert not (tmp_path / "run").exists()  # refused before the run directory


GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def test_presets():
    dapo = preset("qwen3_0_6b_gsm8k_dapo")
    assert dapo.trainer.loss.kind == "dapo" and (dapo.trainer.loss.floor, dapo.trainer.loss.ceiling) == (0.2, 0.28)
    assert dapo.rollout.dynamic_sampling and dapo.rollout.overlong_buffer > 0 and dapo.trainer.loss.kl_coef == 0
    assert dapo.task.name == "dataset" and dapo.task.args["reward"] == "accuracy"
    # the filter reads accuracy, DAPO's eq. 11 (the default: the pass component), not the overlong-penalised total
    assert dapo.rollout.dynamic_sampling_metric is None and dapo.validation.pass_component == "accuracy"
    gsm = preset("qwen3_0_6b_gsm8k_dataset")
    assert gsm.task.name == "dataset" and gsm.task.args["path"] == "../shared/data/gsm8k/train.jsonl"
    assert gsm.task.args["prompt_column"] == "question" and gsm.validation.pass_component == "accuracy"
    assert {"qwen3_0_6b_gsm8k_dataset", "qwen3_0_6b_gsm8k_dapo"} <= set(PRESETS)


@pytest.mark.skipif(not (GSM8K / "test.jsonl").is_file(), reason="needs ../shared/data/gsm8k")
def test_gsm8k_dataset_preset_grades_with_math_verify():
    pytest.importorskip("datasets")
    pytest.importorskip("math_verify")
    from monorl.task_registry import load_task

    cfg = preset("qwen3_0_6b_gsm8k_dataset")
    args = {**cfg.task.args, "path": str(GSM8K / "train.jsonl"), "test_path": str(GSM8K / "test.jsonl")}
    task = load_task(cfg.task.name, **args)
    p = task.val_prompts(1)[0]
    gold = p.answer.rsplit("####", 1)[1].strip()
    assert p.text.endswith("put your final answer within \\boxed{}.") and "####" in p.answer
    out = task.score_batch([p, p], [f"so the answer is \\boxed{{{gold}}}", "\\boxed{-1}"], [[1], [1]])
    assert out == [({"accuracy": 1.0, "format": 1.0}, None), ({"accuracy": 0.0, "format": 1.0}, None)]
    assert task.reward_weights == {"accuracy": 1.0, "format": 0.1}
