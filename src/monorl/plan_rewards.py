"""What a run's model-graded rewards (docs/guides/model-rewards.md) add to the memory plan (`monorl.plan`): a
generative judge's second engine (`monorl.tasks.judge`: its weights in the generator's dtype, and the KV cache of the
engine `judge_engine` sizes, which the run hands the judge: `size_judges_`), and a sequence-classifier reward model
(`monorl.tasks.reward_model`: its weights, and one packed forward's activations, a transient of the reward phase).
Both are read from the task's arguments (`--task.args.reward ...,judge --task.args.judge_model PATH`), config.json
and tokenizer only, as the distillation teacher is (`monorl.assembly.resolve_teacher`). Each is loaded at its first
call, after the generator's KV cache: the start-up sets their rows aside (`MODEL_REWARD_ROWS`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from monorl.generate.cache import kv_cache_bytes_needed
from monorl.generate.generator import GeneratorConfig
from monorl.model.config import ModelConfig
from monorl.plan_activations import FORWARD_TENSORS_PER_TOKEN_WIDTH, activation_shape, prefill_bytes
from monorl.plan_params import param_counts
from monorl.plan_table import MemoryRow

if TYPE_CHECKING:
    from monorl.config import RunConfig

MODEL_REWARD_ROWS = ("judge weights", "judge KV cache", "judge prefill", "reward model weights", "reward model forward")


@dataclass(frozen=True)
class ModelRewards:
    """The model-graded rewards of a run: each model's architecture, how many of each the reward list names."""

    judge: ModelConfig | None = None
    judge_engine: GeneratorConfig | None = None  # the judge's engine as the run builds it (`judge_engine`)
    judges: int = 0
    reward_model: ModelConfig | None = None  # the classifier's body (no LM head)
    reward_model_labels: int = 0
    reward_models: int = 0


def reward_names(args: dict[str, Any]) -> list[str]:
    """The reward functions a task's arguments name (`--task.args.reward a,b` or a list)."""
    reward = args.get("reward")
    names = reward.split(",") if isinstance(reward, str) else list(reward or ())
    return [n.strip() for n in names if isinstance(n, str)]


def judge_engine(cfg: RunConfig, judge: ModelConfig, template_tokens: int, max_prompt_tokens: int,
                 dtype: torch.dtype) -> GeneratorConfig:
    """The judge's engine: a step's completions (or a validation's, the more) judged at once, up to the generator's
    default slots, each sequence the template's tokens, the longest prompt, the longest completion and the judge's
    answer (within the judge's own context); its KV cache exactly what those need (so the plan's row is what the
    judge allocates, never "half of what is free")."""
    r, v, args = cfg.rollout, cfg.validation, cfg.task.args
    completions = max(r.prompts_per_step * r.group_size, v.num_prompts * v.k)
    seqs = min(GeneratorConfig.max_num_seqs, max(1, completions))
    answer = int(args.get("judge_max_new_tokens") or 16)
    length = min(judge.max_position_embeddings,
                 template_tokens + max_prompt_tokens + max(r.max_new_tokens, v.max_new_tokens or 0) + answer)
    kv = kv_cache_bytes_needed(judge, seqs, length, GeneratorConfig.block_size, dtype)
    return GeneratorConfig(max_num_seqs=seqs, max_model_len=length, kv_cache_bytes=kv)


def resolve_model_rewards(cfg: RunConfig, max_prompt_tokens: int, dtype: torch.dtype) -> ModelRewards:
    """The run's judge and reward model (config.json and tokenizer, no weights), refused in one line when a path
    does not hold one; an empty `ModelRewards` when the rewards name neither (and no judge or reward-model module
    imported: a run without them never loads them)."""
    args, names = cfg.task.args, reward_names(cfg.task.args)
    out: dict[str, Any] = {}
    if (judges := names.count("judge")) and args.get("judge_model"):
        from monorl.model.section import ModelSection
        from monorl.model.source import resolve_model
        from monorl.tasks.judge import DEFAULT_RUBRIC, DEFAULT_TEMPLATE, as_asked

        try:
            judge, tok, _ = resolve_model(ModelSection(path=str(args["judge_model"])))
        except (OSError, ValueError) as e:  # the model.path messages, said of the judge
            raise ValueError(f"task.args.judge_model {args['judge_model']}: {e}") from None
        template = str(args.get("judge_template") or DEFAULT_TEMPLATE)
        filled = template.format(question="", completion="", reference="",
                                 rubric=args.get("judge_rubric") or DEFAULT_RUBRIC)
        asked = as_asked(tok, filled, args.get("judge_chat") is not False)  # its chat template's turn, as asked
        engine = judge_engine(cfg, judge, len(tok.encode(asked)), max_prompt_tokens, dtype)
        out.update(judge=judge, judge_engine=engine, judges=judges)
    if (models := names.count("reward_model")) and args.get("reward_model"):
        from monorl.model.hub import resolve_model_path
        from monorl.model.sequence_classifier import classifier_config

        try:
            body, _, labels = classifier_config(resolve_model_path(str(args["reward_model"]))[0])
        except (OSError, ValueError) as e:
            raise ValueError(f"task.args.reward_model {args['reward_model']}: {e}") from None
        out.update(reward_model=body, reward_model_labels=labels, reward_models=models)
    return ModelRewards(**out)


def model_reward_rows(rewards: ModelRewards | None, cfg: RunConfig, max_prompt_tokens: int,
                      dtype: torch.dtype) -> list[MemoryRow]:
    """The plan's rows of `rewards`: a judge's weights and KV cache (persistent) and its prefill (transient), a
    reward model's weights (persistent: loaded at the first reward, kept) and its forward over a pack of
    `MAX_PACK_TOKENS` at most (transient)."""
    rows: list[MemoryRow] = []
    if rewards is None:
        return rows
    if rewards.judge is not None and rewards.judge_engine is not None:
        n, e = rewards.judges, rewards.judge_engine
        rows.append(MemoryRow("judge weights", n * sum(param_counts(rewards.judge).values()) * dtype.itemsize,
                              "frozen, its own engine" + _each(n)))
        rows.append(MemoryRow("judge KV cache", n * int(e.kv_cache_bytes or 0),
                              f"{e.max_num_seqs} seqs x {e.max_model_len} tokens (template, prompt, completion, "
                              f"answer){_each(n)}"))
        # one prefill of the judge's batch: its sequences are all distinct (no shared prompt), packed up to the
        # engine's max_prefill_tokens (a longer one alone); the judges run one after another
        tokens = max(e.max_model_len, min(e.max_prefill_tokens, e.max_model_len * e.max_num_seqs))
        shape = activation_shape(rewards.judge)
        width = shape.hidden_size + shape.intermediate_size
        rows.append(MemoryRow("judge prefill", prefill_bytes(rewards.judge, tokens, width, e.max_num_seqs),
                              f"{tokens} tokens", persistent=False))
    if (rm := rewards.reward_model) is not None:
        from monorl.tasks.reward_model import MAX_PACK_TOKENS

        n = rewards.reward_models
        params = sum(param_counts(rm).values()) + rewards.reward_model_labels * rm.hidden_size
        rows.append(MemoryRow("reward model weights", n * params * dtype.itemsize, "frozen sequence classifier"
                              + _each(n)))
        r = cfg.rollout
        longest = max_prompt_tokens + r.max_new_tokens
        tokens = max(longest, min(MAX_PACK_TOKENS, r.prompts_per_step * r.group_size * longest))
        act = FORWARD_TENSORS_PER_TOKEN_WIDTH * dtype.itemsize * tokens * (rm.hidden_size + rm.intermediate_size)
        rows.append(MemoryRow("reward model forward", act, f"{tokens} tokens packed, no gradients", persistent=False))
    return rows


def _each(n: int) -> str:
    return f" (x{n}: one per reward that names it)" if n > 1 else ""


def size_judges_(task: Any, rewards: ModelRewards) -> None:
    """Hand each judge among `task`'s reward functions the engine the plan sized (`judge_engine`)."""
    if rewards.judge_engine is None:
        return
    from monorl.tasks.judge import judge

    for fn in getattr(task, "reward_functions", ()):
        if isinstance(fn, judge):
            fn.engine = rewards.judge_engine
