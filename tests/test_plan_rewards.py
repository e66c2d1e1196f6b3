"""The memory plan counts a run's model-graded rewards (#60): a generative judge's second engine (its weights in the
generator's dtype, and the KV cache its engine is built with, which the run hands the judge) and a sequence-classifier
reward model (its weights, and one packed forward as a transient); `monorl plan` shows their rows, and a run whose
judge does not fit is refused before anything loads, in one line. Sizes computed from the configs alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from monorl.cliargs import run_config
from monorl.generate.cache import kv_cache_bytes_needed
from monorl.model.config import model_shape
from monorl.model.tokenizer import CharTokenizer
from monorl.plan import GiB, MemoryPlanError, plan_memory, run_memory_plan
from monorl.plan_params import param_counts
from monorl.plan_rewards import judge_engine, resolve_model_rewards, size_judges_
from monorl.tasks.judge import DEFAULT_RUBRIC, DEFAULT_TEMPLATE


def _config_dir(path: Path, shape: str, **hf: object) -> Path:
    """A checkpoint directory of config.json and a tokenizer, no weights (all the plan reads)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**model_shape(shape).to_hf("bfloat16"), **hf}))
    CharTokenizer().save(path)
    return path


def _cfg(tmp_path: Path, reward: str, **args: str):
    return run_config("qwen3_0_6b_sum_digits", {"task.name": "dataset", "task.args.path": str(tmp_path / "d.jsonl"),
                                                "task.args.reward": reward,
                                                **{f"task.args.{k}": v for k, v in args.items()}})


def test_plan_counts_the_judge_weights_and_kv_cache(tmp_path: Path) -> None:
    judge_dir = _config_dir(tmp_path / "judge", "qwen3-1.7b")
    cfg = _cfg(tmp_path, "accuracy,judge", judge_model=str(judge_dir), judge_max_new_tokens="8")
    m, judge = model_shape("qwen3-0.6b"), model_shape("qwen3-1.7b")
    rewards = resolve_model_rewards(cfg, 160, torch.bfloat16)
    assert rewards.judge == judge and rewards.judges == 1
    # the engine: the step's completions at once, each template + prompt + completion + answer
    r = cfg.rollout
    template = len(CharTokenizer().encode(DEFAULT_TEMPLATE.format(question="", completion="", reference="",
                                                                  rubric=DEFAULT_RUBRIC)))
    seqs, length = min(64, r.prompts_per_step * r.group_size), template + 160 + r.max_new_tokens + 8
    engine = rewards.judge_engine
    assert (engine.max_num_seqs, engine.max_model_len) == (seqs, length)
    assert engine.kv_cache_bytes == kv_cache_bytes_needed(judge, seqs, length, 16, torch.bfloat16)
    without = plan_memory(cfg, m, 160, 80 * GiB, activation_checkpointing=False)
    plan = plan_memory(cfg, m, 160, 80 * GiB, activation_checkpointing=False, rewards=rewards)
    assert plan.row("judge weights").bytes == 2 * sum(param_counts(judge).values())  # bf16
    assert plan.row("judge KV cache").bytes == engine.kv_cache_bytes
    # its prefill: a transient of the reward phase, one batch of distinct sequences packed up to max_prefill_tokens
    prefill = plan.row("judge prefill")
    assert not prefill.persistent and prefill.note == f"{min(engine.max_prefill_tokens, seqs * length)} tokens"
    assert prefill.bytes > 8 * min(engine.max_prefill_tokens, seqs * length) * (judge.hidden_size
                                                                                   + judge.intermediate_size)
    transients = max(r.bytes for r in without.rows if not r.persistent)
    assert plan.peak_bytes == (without.peak_bytes + plan.row("judge weights").bytes + engine.kv_cache_bytes
                               + max(0, prefill.bytes - transients))
    # a disaggregated run's rewards are the generator ranks' (the producer's)
    assert "judge KV cache" in [row.name for row in plan_memory(cfg, m, 160, None, role="generator",
                                                                rewards=rewards).rows]
    # the run hands the judge that engine
    from monorl.tasks.judge import judge as judge_fn

    class Task:
        reward_functions = (judge_fn(str(judge_dir)), len)

    size_judges_(Task, rewards)
    assert Task.reward_functions[0].engine is engine


def test_plan_counts_the_reward_models_weights_and_forward(tmp_path: Path) -> None:
    rm_dir = _config_dir(tmp_path / "rm", "qwen3-0.6b", architectures=["Qwen3ForSequenceClassification"],
                         num_labels=3)
    cfg = _cfg(tmp_path, "reward_model", reward_model=str(rm_dir))
    m = model_shape("qwen3-0.6b")
    rewards = resolve_model_rewards(cfg, 160, torch.bfloat16)
    body = rewards.reward_model
    assert body is not None and rewards.reward_model_labels == 3 and param_counts(body)["lm_head"] == 0
    plan = plan_memory(cfg, m, 160, 80 * GiB, activation_checkpointing=False, rewards=rewards)
    assert plan.row("reward model weights").bytes == 2 * (sum(param_counts(body).values()) + 3 * body.hidden_size)
    r = cfg.rollout
    tokens = min(16384, r.prompts_per_step * r.group_size * (160 + r.max_new_tokens))
    forward = plan.row("reward model forward")
    assert not forward.persistent and forward.bytes == 4 * 2 * tokens * (body.hidden_size + body.intermediate_size)
    # a directory that is not a sequence classifier: one line naming the argument
    with pytest.raises(ValueError, match=r"task.args.reward_model .*: .*is not a \*ForSequenceClassification") as e:
        resolve_model_rewards(_cfg(tmp_path, "reward_model", reward_model=str(_config_dir(tmp_path / "lm", "tiny"))),
                              160, torch.bfloat16)
    assert "\n" not in str(e.value)


def test_monorl_plan_shows_the_judge_and_a_judge_that_does_not_fit_is_refused(tmp_path: Path, monkeypatch) -> None:
    from monorl.plan_report import plan_report

    judge_dir = _config_dir(tmp_path / "judge", "qwen3-8b")
    cfg = _cfg(tmp_path, "judge", judge_model=str(judge_dir))
    cfg.model.shape = "qwen3-0.6b"
    text, fits = plan_report(cfg, int(80 * GiB))
    assert "judge weights" in text and "judge KV cache" in text and fits
    text, fits = plan_report(cfg, int(24 * GiB))  # the 0.6B run fits 24 GiB; its 8B judge does not
    assert not fits and "judge weights" in text
    # the run itself: refused before any weights load, in one line (the GPU's size is the only thing made up)
    monkeypatch.setattr("monorl.plan.device_memory_bytes", lambda device: int(24 * GiB))
    m = model_shape("qwen3-0.6b")
    rewards = resolve_model_rewards(cfg, 160, torch.bfloat16)
    run_memory_plan(cfg, m, 160, torch.device("cuda"))  # fits without the judge
    with pytest.raises(MemoryPlanError, match="the run does not fit cuda") as e:
        run_memory_plan(cfg, m, 160, torch.device("cuda"), rewards=rewards)
    assert "\n" not in str(e.value)


def test_judge_engine_stays_within_the_judges_context() -> None:
    cfg = run_config("qwen3_0_6b_sum_digits", {})
    judge = model_shape("tiny")
    engine = judge_engine(cfg, judge, 30, 10_000, torch.float32)
    assert engine.max_model_len == judge.max_position_embeddings


def test_the_judges_context_counts_its_chat_templates_turn(tmp_path: Path) -> None:
    """A judge whose tokenizer has a chat template is asked through it (`judge_chat`, default on): its engine's
    sequences hold the template's turn, and with judge_chat false the plain template."""
    from monorl.model.hf_checkpoint import load_tokenizer
    from monorl.tasks.judge import as_asked
    from tests.test_tokenizer import write_tokenizer_dir

    judge_dir = write_tokenizer_dir(tmp_path / "judge")
    (judge_dir / "config.json").write_text(json.dumps(model_shape("qwen3-1.7b").to_hf("bfloat16")))
    tok = load_tokenizer(judge_dir)
    filled = DEFAULT_TEMPLATE.format(question="", completion="", reference="", rubric=DEFAULT_RUBRIC)
    lengths = {}
    for chat in ("true", "false"):
        cfg = _cfg(tmp_path, "judge", judge_model=str(judge_dir), judge_max_new_tokens="8", judge_chat=chat)
        lengths[chat] = resolve_model_rewards(cfg, 160, torch.bfloat16).judge_engine.max_model_len
    rest = 160 + cfg.rollout.max_new_tokens + 8
    assert lengths == {"true": len(tok.encode(as_asked(tok, filled))) + rest, "false": len(tok.encode(filled)) + rest}
    assert lengths["true"] > lengths["false"]
