"""Your own data and rewards, the way TRL users bring them: ``--task.name dataset --task.args.path FILE``.

- data: a JSONL / JSON, Parquet or CSV file, or a directory written by ``datasets``' ``save_to_disk``, read
  through the ``datasets`` library (``pip install monorl[data]``). The ``prompt`` column (``prompt_column``)
  holds a string (one user turn) or a chat ``messages`` list (``[{"role": ..., "content": ...}, ...]``, sent
  through the tokenizer's chat template). Every other column reaches the reward functions as a keyword
  argument, one value per completion, as TRL passes them.
- held-out split: a second file (``test_path``), a fraction of the rows (``test_fraction``: the same rows
  whatever the seed), or the ``test`` split of a saved ``DatasetDict``; validation takes its first ``n`` rows.
- train stream: the rows, reshuffled every epoch (the permutation depends on seed and epoch only), so a run is
  reproducible per seed and a resume continues at any position without replaying the stream.
- rewards: plain functions ``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``,
  called once per batch of completions, sync or ``async def``; built-ins by name (`monorl.tasks.rewards`:
  ``accuracy``, ``format``, ``length``) or ``module:function`` (a module name or a path to a ``.py`` file).
  ``prompts`` are the dataset's prompt values; ``completions`` are strings, or for chat prompts TRL's
  ``[{"role": "assistant", "content": ...}]``. None means "does not apply to this completion". Each function
  is a reward component named after it, kept and logged as it returned it (``rewards/<name>/mean``: the mean
  of its non-None values, as TRL logs it); the reward is the weighted sum of the non-None values
  (``reward_weights``, default 1.0 each: `Task.reward_weights`). A completion every function returned None
  for is unscorable: advantage 0, left out of its group's baseline (TRL 1.16's rule). A function that raises
  fails the completions it scored, and a NaN / inf value the completion it was returned for: 0.0 on every
  component, with an error naming the function (a reward that fails on everything for 3 steps stops the run).
  A function that returns the wrong number of values, a scalar, or a value that is not a number or None has a
  bug: the run stops at once with one line naming it (`RewardFunctionError`).
- TRL's extras: ``trainer_state`` (``global_step``, ``max_steps``, ``epoch``: `TrainerState`), ``log_metric(name,
  value)`` (the step's metrics row gets ``name``: the mean of the step's values) and ``log_extra(column, values)``
  (one value per completion, in its samples.jsonl row under ``extra``): `monorl.tasks.reward_context`.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from monorl.fsutil import install_hint
from monorl.tasks.base import Prompt, Task
from monorl.tasks.completions import completion_text
from monorl.tasks.images import row_images, with_placeholders
from monorl.tasks.reward_context import RewardContext, RewardFunctionError, TrainerState
from monorl.tasks.reward_failures import report_reward_failure
from monorl.tasks.rewards import BUILTIN_REWARDS, accuracy, builtin_reward
from monorl.tasks.stream import shuffled_rows

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# the reward functions' own arguments, as TRL passes them
_RESERVED = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")


def _task_error(msg: str) -> ValueError:
    from monorl.tasks.spec import TaskError

    return TaskError(msg)


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise _task_error(f"the dataset task reads files with the datasets library: {install_hint('data')}") from None
    return datasets


def _cause(e: BaseException) -> str:
    """The innermost cause of a `datasets` error, on one line (its wrappers say only that generation failed)."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def load_dataset_file(path: str | Path) -> tuple[Any, Any | None]:
    """(rows, test rows or None) of a JSONL / JSON / Parquet / CSV file or a ``save_to_disk`` directory, as
    `datasets.Dataset`s; a saved ``DatasetDict`` gives its ``train`` split and its ``test`` split if any."""
    path = Path(path)
    if not path.exists():
        from monorl.tasks.spec import DatasetNotFound

        raise DatasetNotFound(f"dataset not found: {path}")
    if path.is_file() and path.suffix.lower() not in _BUILDERS:
        raise _task_error(f"{path}: unknown dataset format {path.suffix!r}: use .jsonl, .json, .parquet, .csv or a "
                          "directory saved with datasets' save_to_disk")
    datasets = _datasets()
    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
        else:
            ds = datasets.load_dataset(_BUILDERS[path.suffix.lower()], data_files=str(path), split="train")
    except Exception as e:
        if isinstance(e, StopIteration) or isinstance(e.__cause__ or e.__context__, StopIteration):
            raise _task_error(f"{path}: holds no rows") from None
        raise _task_error(f"cannot read {path}: {_cause(e)}") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise _task_error(f"{path}: a saved DatasetDict without a 'train' split (splits: {sorted(ds)})")
        return ds["train"], ds.get("test")
    return ds, None


class _RewardFn:
    """One reward function: its component name, weight, and which keyword arguments it takes."""

    def __init__(self, fn: Callable[..., Any], name: str, weight: float) -> None:
        self.fn, self.name, self.weight = fn, name, weight
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}
        self.takes_all = not params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        self.accepted = {n for n, p in params.items() if p.kind in kinds}
        self.required = {n for n, p in params.items() if p.kind in kinds and p.default is inspect.Parameter.empty}

    def kwargs(self, all_kwargs: dict[str, Any]) -> dict[str, Any]:
        return all_kwargs if self.takes_all else {k: v for k, v in all_kwargs.items() if k in self.accepted}


def _fn_name(fn: Any) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    return getattr(inner, "__name__", None) or type(inner).__name__


def _split_list(value: Any) -> list[Any]:
    if isinstance(value, str):
        return [s.strip() for s in value.split(",") if s.strip()]
    if isinstance(value, list | tuple):
        return list(value)
    return [value]


def _resolve(spec: Any, options: dict[str, Any]) -> Callable[..., Any]:
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise _task_error(f"reward {spec!r}: expected a name, 'module:function' or a callable")
    if ":" not in spec or spec in BUILTIN_REWARDS:
        return builtin_reward(spec, **options)
    from monorl.tasks.spec import import_object

    obj = import_object(spec, "reward")
    if not callable(obj):
        raise _task_error(f"reward {spec!r} names a {type(obj).__name__}, not a function")
    return obj


def _run_coroutines(coros: list[Any]) -> list[Any]:
    """Await `coros` concurrently; results or the exceptions they raised, in order. In a thread of its own when
    this thread already runs an event loop (a notebook)."""

    async def gather() -> list[Any]:
        return await asyncio.gather(*coros, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, gather()).result()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _checked_values(name: str, out: Any, size: int) -> list[float | None]:
    """A reward function's return as one float (maybe NaN / inf) or None per completion, or `RewardFunctionError`
    naming the function and what it returned (a wrong shape or type is a bug in its code, not a failed
    completion)."""
    try:
        if isinstance(out, str | bytes | Mapping) or not isinstance(out, Iterable):
            raise TypeError
        out = list(out)  # a 0-d tensor or array is Iterable, and raises here
    except TypeError:
        raise RewardFunctionError(f"reward function {name!r} returned {type(out).__name__} {_short(out)} for "
                                  f"{size} completions; return a list of float or None, one per completion") from None
    if len(out) != size:
        raise RewardFunctionError(f"reward function {name!r} returned {len(out)} values for {size} completions")
    values: list[float | None] = []
    for i, v in enumerate(out):
        if v is None:
            values.append(None)
            continue
        try:
            if isinstance(v, str | bytes):
                raise TypeError
            values.append(float(v))
        except (TypeError, ValueError):
            raise RewardFunctionError(f"reward function {name!r} returned {type(v).__name__} {_short(v)} at index "
                                      f"{i}; return a list of float or None") from None
    return values


class DatasetTask(Task):
    """Prompts from a local dataset file, rewards from plain (TRL-style) reward functions; see the module
    docstring. Arguments (``--task.args.NAME``): ``path``, ``reward`` (comma-separated names / ``mod:fn``, or
    a list; callables from Python), ``reward_weights``, ``prompt_column``, ``test_path`` or ``test_fraction``,
    ``instruction`` (appended to each prompt's last user message after a blank line, e.g. "put your final
    answer within \\boxed{}") and the built-ins' settings ``format_pattern``, ``length_max``, ``length_soft``."""

    name = "dataset"

    def __init__(self, path: str | Path, reward: Any = None, reward_weights: Any = None,
                 prompt_column: str = "prompt", test_path: str | Path | None = None,
                 test_fraction: float | None = None, format_pattern: str | None = None,
                 length_max: int | None = None, length_soft: int | None = None,
                 instruction: str | None = None, reward_model: str | None = None,
                 reward_model_label: int = 0, judge_model: str | None = None, judge_rubric: str | None = None,
                 judge_template: str | None = None, judge_max_new_tokens: int | None = None,
                 judge_temperature: float | None = None, judge_chat: bool | None = None) -> None:
        """Load the data, resolve the reward functions and check they can be called on its columns.

        Args:
            path: the data: a .jsonl / .json / .parquet / .csv file or a save_to_disk directory
            reward: reward functions, comma-separated: built-ins (accuracy, format, length, reward_model, judge)
                or FILE.py:fn / module:fn (TRL's reward-function signature)
            reward_weights: one weight per reward function (default: 1 each)
            prompt_column: the column holding the prompt (a string, or a list of role/content messages)
            test_path: held-out data for validation (a file as `path`)
            test_fraction: or hold out this share of `path`'s rows (a fixed permutation)
            format_pattern: the regex the `format` reward matches
            length_max: the `length` reward's maximum completion length (tokens)
            length_soft: the `length` reward's soft window before length_max (tokens)
            instruction: text appended to each prompt's last user message (e.g. put your answer in \\boxed{})
            reward_model: the `reward_model` reward's sequence-classifier checkpoint (monorl.tasks.reward_model)
            reward_model_label: the output of its score head that is the reward (0 for a one-label model)
            judge_model: the `judge` reward's model (a path monorl loads: monorl.tasks.judge)
            judge_rubric: what the judge grades the completion on (its prompt's {rubric})
            judge_template: the judge's prompt, with {question}, {completion} and {rubric}
            judge_max_new_tokens: the judge's answer length (tokens)
            judge_temperature: the judge's sampling temperature
            judge_chat: the judge's prompt as a user turn of its chat template (default true, where it has one)
        """
        if reward is None:
            raise _task_error("the dataset task needs --task.args.reward: built-ins "
                              f"{', '.join(BUILTIN_REWARDS)} or 'module:function', comma-separated")
        if test_path is not None and test_fraction is not None:
            raise _task_error("give test_path or test_fraction, not both")
        self.path, self.prompt_column = Path(path), str(prompt_column)
        self.instruction = None if instruction is None else str(instruction)
        train, test = load_dataset_file(self.path)
        self._check(train, self.path)
        if test_path is not None:
            test, _ = load_dataset_file(test_path)
            self._check(test, Path(test_path))
        elif test_fraction is not None:
            train, test = self._split(train, float(test_fraction))
        elif test is not None:
            self._check(test, self.path / "test")
        self._train, self._test = train, test
        self.columns = [c for c in train.column_names if c != self.prompt_column]

        specs = _split_list(reward)
        weights = [1.0] * len(specs) if reward_weights is None else _split_list(reward_weights)
        if len(weights) != len(specs):
            raise _task_error(f"{len(specs)} reward functions but {len(weights)} reward_weights")
        try:
            weights = [float(w) for w in weights]
        except (TypeError, ValueError):
            raise _task_error(f"reward_weights must be numbers, got {reward_weights!r}") from None
        if not all(math.isfinite(w) for w in weights):
            raise _task_error(f"reward_weights must be finite, got {weights}")
        options = {"format_pattern": format_pattern, "length_max": length_max, "length_soft": length_soft,
                   "reward_model": reward_model, "reward_model_label": reward_model_label, "judge_model": judge_model,
                   "judge_rubric": judge_rubric, "judge_template": judge_template,
                   "judge_max_new_tokens": judge_max_new_tokens, "judge_temperature": judge_temperature,
                   "judge_chat": judge_chat}
        self._fns: list[_RewardFn] = []
        for spec, weight in zip(specs, weights, strict=True):
            fn = _resolve(spec, options)
            name, k = _fn_name(fn), 2
            while name in {f.name for f in self._fns}:  # the same function twice: accuracy, accuracy_2
                name, k = f"{_fn_name(fn)}_{k}", k + 1
            self._fns.append(_RewardFn(fn, name, weight))
        self._check_arguments()
        self.reward_components = tuple(f.name for f in self._fns)
        self.reward_weights = {f.name: f.weight for f in self._fns}

    @property
    def reward_functions(self) -> tuple[Any, ...]:
        """The reward functions, in component order (a run hands a judge its planned engine: `plan_rewards`)."""
        return tuple(f.fn for f in self._fns)

    # -- data -----------------------------------------------------------------------------------------------
    def _check(self, ds: Any, where: Path) -> None:
        """The prompt column exists and holds strings or message lists; no column shadows a reward argument."""
        if len(ds) == 0:
            raise _task_error(f"{where}: holds no rows")
        if self.prompt_column not in ds.column_names:
            raise _task_error(f"{where}: no column {self.prompt_column!r} (columns: {', '.join(ds.column_names)}); "
                              "set --task.args.prompt_column")
        if clash := [c for c in ds.column_names if c in _RESERVED]:
            raise _task_error(f"{where}: column {clash[0]!r} shadows a reward function argument; rename it")
        for i, value in enumerate(ds[self.prompt_column]):
            if isinstance(value, str):
                continue
            ok = (isinstance(value, list) and value and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value))
            if not ok:
                raise _task_error(f"{where}: row {i}: column {self.prompt_column!r} must hold a string or a list of "
                                  f"{{'role', 'content'}} messages, got {str(value)[:80]!r}")

    def _split(self, ds: Any, fraction: float) -> tuple[Any, Any]:
        """(train, test): `fraction` of the rows, picked by a fixed permutation (the same for every run)."""
        if not 0.0 < fraction < 1.0:
            raise _task_error(f"test_fraction must be in (0, 1), got {fraction}")
        n = len(ds)
        k = round(n * fraction)
        if not 0 < k < n:
            raise _task_error(f"test_fraction={fraction} of {n} rows leaves an empty "
                              f"{'test' if k == 0 else 'train'} split")
        order = list(range(n))
        random.Random(0).shuffle(order)
        return ds.select(sorted(order[k:])), ds.select(sorted(order[:k]))

    def _check_arguments(self) -> None:
        """Reward functions that need a column the data lacks fail here, not at the first step."""
        have = set(_RESERVED) | set(self.columns)
        for f in self._fns:
            if f.fn is accuracy and not {"solution", "answer"} & set(self.columns):
                raise _task_error(f"reward 'accuracy' reads the gold answer from a 'solution' or 'answer' column; "
                                  f"{self.path} has {self.columns}")
            if missing := sorted(f.required - have):
                raise _task_error(f"reward {f.name!r} takes {', '.join(missing)}, which is not a column of {self.path} "
                                  f"(columns: {', '.join(self.columns) or 'none besides the prompt'})")

    def _prompt(self, record: dict[str, Any], **meta: Any) -> Prompt:
        value = record[self.prompt_column]
        columns = {k: v for k, v in record.items() if k != self.prompt_column}
        answer = columns.get("solution", columns.get("answer"))
        try:  # images (`monorl.tasks.images`): carried with the prompt, a placeholder each in its first user turn
            images = row_images(record, self.path.parent if self.path.is_file() else self.path)
        except ValueError as e:
            raise _task_error(f"{self.path}: row {meta.get('row')}: {e}") from None
        if images:
            meta["images"] = images
        if isinstance(value, str) and not images:
            return Prompt(text=self._instructed(value), answer=answer, meta={**meta, "columns": columns})
        if isinstance(value, str):
            value = [{"role": "user", "content": value}]
        messages = [{"role": m["role"], "content": m["content"]} for m in value]
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages) - 1)
        messages[last_user]["content"] = self._instructed(messages[last_user]["content"])
        users = [m["content"] for m in messages if m["role"] == "user"]
        text = users[-1] if users else messages[-1]["content"]
        messages = with_placeholders(messages, len(images))
        return Prompt(text=text, answer=answer, meta={**meta, "columns": columns, "messages": messages})

    @property
    def has_solutions(self) -> bool:  # a warm start trains on the rows' `completion` column (TRL's prompt-completion)
        return "completion" in self.columns

    def solution(self, prompt: Prompt) -> str:
        return completion_text(prompt.meta["columns"]["completion"])

    def _instructed(self, text: str) -> str:
        return text if not self.instruction else f"{text}\n\n{self.instruction}"

    def train_prompts(self, seed: int = 0, start: int = 0) -> Iterator[Prompt]:
        for index, epoch, row in shuffled_rows(len(self._train), seed, start):
            yield self._prompt(self._train[row], index=index, epoch=epoch, row=row, split="train")

    def has_held_out(self) -> bool:
        return self._test is not None

    def val_prompts(self, n: int) -> list[Prompt]:
        if n == 0:
            return []
        if self._test is None:
            raise _task_error("dataset validation needs a held-out split: --task.args.test_path FILE or "
                              "--task.args.test_fraction F (or --validation.num_prompts 0)")
        if not 0 <= n <= len(self._test):
            raise _task_error(f"asked for {n} validation prompts; the held-out split has {len(self._test)} rows "
                              "(set --validation.num_prompts)")
        return [self._prompt(self._test[i], index=i, row=i, split="val") for i in range(n)]

    # -- rewards --------------------------------------------------------------------------------------------
    def score_batch(self, prompts: Sequence[Prompt], completions: Sequence[str],
                    completion_ids: Sequence[Sequence[int]],
                    context: RewardContext | None = None) -> list[tuple[dict[str, float | None], str | None]]:
        """Each reward function called once on the whole batch (TRL's convention), with TRL's extras built from
        `context` (default: step 0 of an unknown run, its logs dropped); see the module docstring. A function that
        returns the wrong number of values or a value that is not a number or None raises `RewardFunctionError`."""
        size = len(completions)
        ctx = context if context is not None else RewardContext()
        chat = ["messages" in p.meta for p in prompts]
        names = list(dict.fromkeys(k for p in prompts for k in p.meta.get("columns", {})))
        kwargs = {
            "prompts": [p.meta["messages"] if c else p.text for p, c in zip(prompts, chat, strict=True)],
            "completions": [[{"role": "assistant", "content": t}] if c else t
                            for t, c in zip(completions, chat, strict=True)],
            "completion_ids": [list(ids) for ids in completion_ids],
            **{k: [p.meta.get("columns", {}).get(k) for p in prompts] for k in names},
            "trainer_state": TrainerState(ctx.global_step, ctx.max_steps, ctx.data_position / len(self._train)),
            "log_metric": ctx.log_metric,
            "log_extra": lambda column, values: ctx.log_extra(column, values, size=size),
        }
        results: list[Any] = []
        pending: dict[int, Any] = {}
        for j, f in enumerate(self._fns):
            try:
                out = f.fn(**f.kwargs(kwargs))
            except Exception as e:  # noqa: BLE001 -- a user reward can fail in any way; the run goes on
                out = e
            if inspect.isawaitable(out):
                pending[j] = out
            results.append(out)
        if pending:
            for j, out in zip(pending, _run_coroutines(list(pending.values())), strict=True):
                results[j] = out

        values: list[list[float | None]] = [[None] * len(self._fns) for _ in range(size)]
        errors: list[list[str]] = [[] for _ in range(size)]
        for j, (f, out) in enumerate(zip(self._fns, results, strict=True)):
            if isinstance(out, RewardFunctionError):  # from log_extra / log_metric: a bug, as a wrong return
                raise RewardFunctionError(f"reward function {f.name!r}: {out}") from None
            if isinstance(out, BaseException):
                report_reward_failure(self, f.name, out)
                for e in errors:
                    e.append(f"reward {f.name!r} raised {type(out).__name__}: {out}")
                continue
            for i, x in enumerate(_checked_values(f.name, out, size)):
                if x is None:
                    continue
                if not math.isfinite(x):  # a per-completion failure (counted), not a bug in the function's shape
                    errors[i].append(f"reward {f.name!r} returned {x!r}, not a finite number or None")
                    continue
                values[i][j] = x
        scored = []
        for vals, errs in zip(values, errors, strict=True):
            if errs:
                scored.append(({f.name: 0.0 for f in self._fns}, "; ".join(errs)))
            else:
                scored.append(({f.name: v for f, v in zip(self._fns, vals, strict=True)}, None))
        return scored

    def reward(self, prompt: Prompt, completion: str) -> dict[str, float | None]:
        """One completion through `score_batch` (without token ids: the ``length`` reward then sees 0 tokens)."""
        vals, error = self.score_batch([prompt], [completion], [[]])[0]
        if error is not None:
            raise RuntimeError(error)
        return vals
