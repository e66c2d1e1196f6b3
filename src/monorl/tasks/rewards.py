"""Built-in reward functions for `DatasetTask` (``--task.args.reward accuracy,format``), in TRL's calling
convention: ``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``, one value per
completion (None: not applicable to that completion). A completion is a string, or for a chat prompt TRL's
``[{"role": "assistant", "content": ...}]``; `completion_text` reads either.

- ``accuracy``: 1.0 when the completion's answer equals the gold answer (the ``solution`` column, else
  ``answer``) by math-verify (``pip install monorl[math]``), which TRL's ``accuracy_reward`` uses: ``\\boxed{2}``
  matches ``2``, ``0.5`` matches ``1/2``. A gold solution with a ``####`` line (GSM8K's format) is graded by
  what follows the last ``####``. None when the gold answer does not parse.
- ``format``: 1.0 when the completion matches a regex (``re.search``, DOTALL), ``--task.args.format_pattern``;
  by default a ``\\boxed{...}`` answer.
- ``length``: DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13; TRL's
  ``get_soft_overlong_punishment``) over completion tokens: 0 up to ``length_max - length_soft``, then linear
  down to -1 at ``length_max`` and beyond (``--task.args.length_max N``, typically ``rollout.max_new_tokens``;
  ``length_soft`` defaults to a quarter of it). For any task, ``--rollout.overlong_buffer`` adds the same
  penalty as a reward component of its own (`monorl.rl.rollouts.rollout.add_overlong_penalty`).
- ``reward_model``: a sequence-classifier checkpoint's score (``--task.args.reward_model PATH``;
  `monorl.tasks.reward_model`).
- ``judge``: a generative judge's grade (``--task.args.judge_model PATH``; `monorl.tasks.judge`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

from monorl.fsutil import install_hint
from monorl.tasks.completions import completion_text  # (the rewards' public helper)

DEFAULT_FORMAT_PATTERN = r"\\boxed\{.+?\}"


def _task_error(msg: str) -> ValueError:
    from monorl.tasks.spec import TaskError

    return TaskError(msg)


def _math_verify() -> tuple[Callable, Callable]:
    try:
        from math_verify import parse, verify
    except ImportError:
        raise _task_error(f"the 'accuracy' reward needs math-verify: {install_hint('math')}") from None
    return parse, verify


def accuracy(prompts: list, completions: list, completion_ids: list, solution: list | None = None,
             answer: list | None = None, **columns: Any) -> list[float | None]:
    """1.0 / 0.0: does the completion's answer equal the gold answer (math-verify)? None where the gold answer
    does not parse."""
    gold = solution if solution is not None else answer
    if gold is None:
        raise KeyError("the accuracy reward reads the gold answer from a 'solution' or 'answer' column; the "
                       f"dataset has {sorted(columns) or 'no other columns'}")
    parse, verify = _math_verify()
    # math-verify times out with signal.alarm, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    golds: dict[str, Any] = {}  # a group's completions share one gold answer: parse it once
    out: list[float | None] = []
    for completion, g in zip(completions, gold, strict=True):
        if str(g) not in golds:
            text = str(g)
            if "####" in text:  # a GSM8K reference solution: its answer is what follows the last marker
                text = text.rsplit("####", 1)[1].strip().replace(",", "")
            golds[str(g)] = parse(text, parsing_timeout=timeout)
        gold_parsed = golds[str(g)]
        if not gold_parsed:
            out.append(None)
            continue
        pred = parse(completion_text(completion), parsing_timeout=timeout)
        out.append(float(verify(gold_parsed, pred, timeout_seconds=timeout)))
    return out


def format_reward(pattern: str = DEFAULT_FORMAT_PATTERN) -> Callable[..., list[float | None]]:
    """A reward of 1.0 for completions that match `pattern` (``re.search``, DOTALL), else 0.0."""
    try:
        regex = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise _task_error(f"format_pattern {pattern!r} is not a valid regex: {e}") from None

    def format(prompts: list, completions: list, completion_ids: list, **columns: Any) -> list[float | None]:
        return [1.0 if regex.search(completion_text(c)) else 0.0 for c in completions]

    return format


OVERLONG = "overlong"  # the reward component rollout.overlong_buffer adds (DAPO's soft overlong punishment)


def soft_overlong_penalty(length: int, length_max: int, soft: int) -> float:
    """DAPO's R_length: 0 for length <= length_max - soft, (length_max - soft - length) / soft up to
    length_max, -1 beyond."""
    return max(-1.0, min(0.0, (length_max - soft - length) / soft))


def length_penalty(length_max: int | None, length_soft: int | None = None) -> Callable[..., list[float | None]]:
    """TRL's soft overlong punishment: 0 up to ``length_max - length_soft`` completion tokens, then linear
    down to -1 at ``length_max``, -1 beyond."""
    if length_max is None:
        raise _task_error("the 'length' reward needs --task.args.length_max N (completion tokens, typically "
                          "rollout.max_new_tokens)")
    length_max = int(length_max)
    soft = max(1, length_max // 4) if length_soft is None else int(length_soft)
    if not 0 < soft <= length_max:
        raise _task_error(f"need 0 < length_soft <= length_max, got length_soft={soft}, length_max={length_max}")

    def length(prompts: list, completions: list, completion_ids: list, **columns: Any) -> list[float | None]:
        return [soft_overlong_penalty(len(ids), length_max, soft) for ids in completion_ids]

    return length


BUILTIN_REWARDS = ("accuracy", "format", "length", "reward_model", "judge")


def builtin_reward(name: str, format_pattern: str | None = None, length_max: int | None = None,
                   length_soft: int | None = None, reward_model: str | None = None,
                   reward_model_label: int = 0, **judge: Any) -> Callable[..., list[float | None]]:
    """The built-in reward `name` (one of `BUILTIN_REWARDS`), configured by the task's arguments (`judge`: the
    judge_* ones, `monorl.tasks.judge`)."""
    if name == "accuracy":
        _math_verify()  # a missing extra is reported when the task is built, not at the first reward
        return accuracy
    if name == "format":
        return format_reward(DEFAULT_FORMAT_PATTERN if format_pattern is None else format_pattern)
    if name == "length":
        return length_penalty(length_max, length_soft)
    if name == "reward_model":  # a sequence-classifier checkpoint (monorl.tasks.reward_model)
        if reward_model is None:
            raise _task_error("the reward_model reward needs --task.args.reward_model PATH (a "
                              "*ForSequenceClassification checkpoint)")
        from monorl.tasks.reward_model import reward_model as classifier_reward

        return classifier_reward(reward_model, reward_model_label)
    if name == "judge":  # a generative judge (monorl.tasks.judge)
        if judge.get("judge_model") is None:
            raise _task_error("the judge reward needs --task.args.judge_model PATH (a model monorl loads)")
        from monorl.tasks.judge import judge as generative_judge

        return generative_judge(**{k.removeprefix("judge_").replace("model", "path"): v for k, v in judge.items()
                                   if v is not None})
    raise _task_error(f"unknown reward {name!r}: use one of {list(BUILTIN_REWARDS)} or 'module:function' "
                      "(a module name or a path to a .py file)")
