"""What a task is: a source of prompts and a reward function over completion text.

The RL loop only needs what is on `Task`: draw training prompts, draw a fixed validation set, render a prompt
for the tokenizer, score a completion. A user task is any `Task` subclass, loaded with `load_task("mod:obj")`.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from monorl.tasks.reward_context import RewardContext, RewardFunctionError
from monorl.tasks.reward_failures import report_reward_failure


@dataclass
class Prompt:
    """One problem. `text` is the user message; `answer` the ground truth in whatever form the task's reward
    uses; `meta` carries the rest (for training prompts, `meta["index"]` is the position in the stream,
    which is what a resume passes back as `train_prompts(seed, start=index + 1)`). A chat prompt carries its
    whole conversation as `meta["messages"]` (a list of ``{"role", "content"}`` dicts; `text` is then its last
    user message, for logs): `Task.render` sends that list through the chat template."""

    text: str
    answer: Any
    meta: dict[str, Any] = field(default_factory=dict)


class ChatTokenizer(Protocol):
    """The slice of monorl's tokenizer wrapper that tasks use."""

    has_chat_template: bool

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str: ...



def plain_text_start(tokenizer: object) -> str:
    """What text without a chat template starts with: the BOS token's text when the tokenizer's `add_bos_token`
    says so (HF's tokenizer adds it to plain text; a base model such as Gemma 3's is trained with it), else ""."""
    bos = (getattr(tokenizer, "special_tokens", None) or {}).get("bos_token")
    return bos if bos and getattr(tokenizer, "add_bos_token", False) else ""


class Task(ABC):
    """Base class for tasks. Subclasses set `name` and `reward_components` and implement the three abstract
    methods; `render` has a sensible default."""

    name: str = "task"
    reward_components: tuple[str, ...] = ()
    # weight of each component in the reward (absent: 1.0); components are logged unweighted
    reward_weights: Mapping[str, float] = MappingProxyType({})
    # the longest prompt the task's data holds, rendered, in tokens (of a Qwen3 tokenizer's chat template): what
    # `monorl plan` sizes a run with when the data is not at hand; None: the config's bound
    # (generator.max_model_len - rollout.max_new_tokens)
    max_prompt_tokens: int | None = None

    @abstractmethod
    def train_prompts(self, seed: int = 0, start: int = 0) -> Iterator[Prompt]:
        """Endless (or epoch-cycling) stream of training prompts, the same for the same `seed`.

        `start` skips to that position in the stream, so a resumed run continues where it stopped: each
        prompt's `meta["index"]` is its position, counting from 0 at the start of the stream."""

    @abstractmethod
    def val_prompts(self, n: int) -> list[Prompt]:
        """The first `n` held-out prompts: fixed (independent of any seed), never produced by `train_prompts`."""

    def has_held_out(self) -> bool:
        """Whether the task has held-out prompts to validate on (a dataset without a test split has none: the run
        then trains without validation, as TRL does without an eval set)."""
        return True

    @abstractmethod
    def reward(self, prompt: Prompt, completion: str) -> dict[str, float | None]:
        """Reward components for one completion, keyed by `reward_components` (None: the component does not
        apply to it); the run's reward is the sum of the components that apply, weighted by `reward_weights`. A
        completion no component applies to is unscorable: advantage 0, left out of its group's baseline and the
        reward metrics (TRL 1.16's rule)."""

    def plain_prompt(self, prompt: Prompt) -> str:
        """The prompt string for tokenizers without a chat template (tiny char-level models): one
        ``Role: content`` line per message, then ``Assistant: ``."""
        turns = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages_of(prompt))
        return f"{turns}Assistant: "

    def render(self, prompt: Prompt, tokenizer: ChatTokenizer) -> str:
        """The text the generator continues: the chat template over the prompt's messages (`meta["messages"]`,
        else one user turn of `text`) + generation prompt when the tokenizer has one, else `plain_prompt`, after
        the BOS token when the tokenizer's `add_bos_token` says plain text starts with it (a base model such as
        Gemma 3's is trained with it; HF's tokenizer adds it to plain text)."""
        if getattr(tokenizer, "has_chat_template", False):
            out = tokenizer.apply_chat_template(messages_of(prompt), add_generation_prompt=True)
            if not isinstance(out, str):
                raise TypeError(f"tokenizer.apply_chat_template returned {type(out).__name__}, expected str")
            return out
        return plain_text_start(tokenizer) + self.plain_prompt(prompt)


    def score_batch(self, prompts: Sequence[Prompt], completions: Sequence[str],
                    completion_ids: Sequence[Sequence[int]],
                    context: RewardContext | None = None) -> list[tuple[dict[str, float | None], str | None]]:
        """Rewards of a whole batch of completions (`prompts[i]` is the prompt of `completions[i]`), called once
        per rollout batch: `(components, error)` per completion, as `safe_reward` returns them. The default
        scores each completion with `safe_reward`; a task whose reward is cheaper batched (one call to a
        verifier, a reward model, TRL-style reward functions) overrides it, keeping those semantics: a failed
        completion scores 0.0 on every component and its error string says why. `context`: the run's position
        and the step's logging sinks (`monorl.tasks.reward_context`; None outside a run: `monorl eval`); an override
        may leave the parameter out, and is then called without it."""
        return [safe_reward(self, p, c) for p, c in zip(prompts, completions, strict=True)]


def messages_of(prompt: Prompt) -> list[dict[str, str]]:
    """The conversation of a prompt: `meta["messages"]` when it has one, else one user turn of `text`."""
    messages = prompt.meta.get("messages")
    return list(messages) if messages else [{"role": "user", "content": prompt.text}]


class TaskDataNotFound(FileNotFoundError):
    """A task's data file is missing (`monorl plan` then plans from the lengths the task declares)."""


class RewardError(ValueError):
    """A task's reward failed on every completion for several steps: the run stops (a user error, one line).
    A reward of the wrong shape or type stops it at once: `RewardFunctionError` (`monorl.tasks.reward_context`)."""


def _components(task: Task, out: Any, who: str) -> dict[str, float | None]:
    """`out` checked as one completion's components: exactly the task's, each a finite number or None."""
    if not isinstance(out, dict):
        raise TypeError(f"{who} returned {type(out).__name__}, expected dict[str, float]")
    if set(out) != set(task.reward_components):
        raise KeyError(f"{who} returned components {sorted(out)}, expected {sorted(task.reward_components)}")
    vals = {k: None if out[k] is None else float(out[k]) for k in task.reward_components}
    bad = [k for k, v in vals.items() if v is not None and not math.isfinite(v)]
    if bad:
        raise ValueError(f"{who} returned a non-finite reward for {bad}: {[vals[k] for k in bad]}")
    return vals


def safe_reward(task: Task, prompt: Prompt, completion: str) -> tuple[dict[str, float | None], str | None]:
    """`task.reward`, but one broken completion never stops the run: if it raises, returns something that is
    not a dict of finite numbers (or None), or misses / adds components, the completion scores 0.0 on every component
    and the second element says why (None when the reward worked). The caller logs and counts failures, so a
    reward that fails on everything stops the run (`RewardError`) instead of scoring 0 forever."""
    try:
        out = task.reward(prompt, completion)
    except Exception as e:  # noqa: BLE001 -- a user reward can fail in any way; the run goes on
        report_reward_failure(task, task.name, e)
        return {k: 0.0 for k in task.reward_components}, f"{type(e).__name__}: {e}"
    try:
        return _components(task, out, "reward"), None
    except Exception as e:  # noqa: BLE001 -- not a dict of finite numbers: the message says what it was
        return {k: 0.0 for k in task.reward_components}, f"{type(e).__name__}: {e}"


def _takes_context(task: Task) -> bool:
    try:
        params = inspect.signature(task.score_batch).parameters
    except (TypeError, ValueError):
        return False
    return "context" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def safe_score_batch(task: Task, prompts: Sequence[Prompt], completions: Sequence[str],
                     completion_ids: Sequence[Sequence[int]],
                     context: RewardContext | None = None) -> list[tuple[dict[str, float | None], str | None]]:
    """`task.score_batch` (given `context` when it takes one), guarded like `safe_reward`: if the call itself
    raises or returns a pair whose components are not exactly the task's as finite numbers (or None), every
    completion scores 0.0 on every component with that error. A result of the wrong length, or a
    `RewardFunctionError` from the task, is a bug in its code: raised (`RewardFunctionError`), not scored."""
    zeros: dict[str, float | None] = {k: 0.0 for k in task.reward_components}
    try:
        if context is not None and _takes_context(task):
            out = list(task.score_batch(prompts, completions, completion_ids, context=context))
        else:
            out = list(task.score_batch(prompts, completions, completion_ids))
    except RewardFunctionError:
        raise
    except Exception as e:  # noqa: BLE001 -- as safe_reward: a user reward can fail in any way; the run goes on
        report_reward_failure(task, f"{task.name}.score_batch", e)
        return [(zeros.copy(), f"{type(e).__name__}: {e}") for _ in completions]
    if len(out) != len(completions):
        raise RewardFunctionError(f"task {task.name!r}: score_batch returned {len(out)} results for "
                                  f"{len(completions)} completions")
    try:
        checked: list[tuple[dict[str, float | None], str | None]] = []
        for vals, err in out:
            if err is not None:
                if not isinstance(vals, dict) or set(vals) != set(task.reward_components):
                    raise KeyError(f"score_batch returned components {sorted(vals)}, expected "
                                   f"{sorted(task.reward_components)}")
                checked.append((zeros.copy(), str(err)))
            else:
                checked.append((_components(task, vals, "score_batch"), None))
        return checked
    except Exception as e:  # noqa: BLE001 -- not the task's components as finite numbers: the message says so
        return [(zeros.copy(), f"{type(e).__name__}: {e}") for _ in completions]
