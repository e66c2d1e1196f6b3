"""GSM8K grade-school math, read from local files (JSONL, or Parquet when pyarrow is installed).

Each record has ``question`` and ``answer``; the ground truth is the number after ``####`` in ``answer``
(commas removed), as in the dataset's own format, kept exact (a `decimal.Decimal` of that text).

Decisions:

- prompt: the question, a blank line, then an instruction to reason step by step and put the final answer in
  ``\\boxed{}`` (``answer_format="boxed"``, the default: it is what Qwen-family chat models are trained to
  emit) or on a last line ``#### <number>`` (``answer_format="hash"``, GSM8K's own style, closer to what a
  model fine-tuned on GSM8K solutions writes).
- ``correctness`` (1.0): the number extracted from the completion (see `monorl.tasks.answers`: ``\\boxed{}``,
  then ``####``, then "answer is", then the last number) equals the ground truth exactly (``2,880,001`` is
  not ``2880000``; ``3.50`` is ``3.5``).
- ``format`` (0.1 by default): the completion gives a number in the *requested* format. It is small, so a
  wrong answer in the right format never beats a right answer in the wrong one, but large enough to pull a
  model toward answers the grader reads without guessing.
- train stream: the train file, reshuffled every epoch (the permutation depends on seed and epoch only);
  validation: the first ``n`` records of the test file, in file order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

from monorl.tasks.answers import extract_after_hash, extract_boxed, extract_number, numbers_equal, parse_number
from monorl.tasks.base import Prompt, Task, TaskDataNotFound
from monorl.tasks.stream import shuffled_rows

INSTRUCTIONS = {
    "boxed": "Please reason step by step, and put your final answer within \\boxed{}.",
    "hash": "Please reason step by step, and give your final answer as a number on the last line, "
            "in the form: #### <number>",
}

_GOLD_RE = re.compile(r"^\s*-?\d[\d,]*(?:\.\d+)?\s*$")


def gold_answer(solution: str) -> Decimal:
    """The ground-truth number of a GSM8K reference solution: what follows ``####``, commas removed, as an
    exact Decimal (a float would make large or decimal golds compare inexactly)."""
    raw = extract_after_hash(solution)
    if raw is None:
        raise ValueError("no '####' marker in the reference solution")
    if not _GOLD_RE.match(raw):
        raise ValueError(f"the text after '####' is not a plain number: {raw.strip()!r}")
    return Decimal(raw.replace(",", "").strip())


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Records of a GSM8K-style JSONL or Parquet file, each checked for string `question` and `answer`."""
    path = Path(path)
    if not path.is_file():
        raise TaskDataNotFound(f"GSM8K file not found: {path}")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(f"reading {path} needs pyarrow (pip install pyarrow), or pass a .jsonl file") from e
        rows = pq.read_table(path).to_pylist()
        where = [f"{path}: row {i}" for i in range(len(rows))]
    else:
        rows, where = [], []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
                where.append(f"{path}:{lineno}")
    for row, loc in zip(rows, where, strict=True):
        if not isinstance(row, dict):
            raise ValueError(f"{loc}: expected a JSON object, got {type(row).__name__}")
        for key in ("question", "answer"):
            if not isinstance(row.get(key), str):
                raise ValueError(f"{loc}: missing or non-string field {key!r}")
        row["_where"] = loc
    return rows


class Gsm8kTask(Task):
    """GSM8K from local files: `train_path` (and `test_path` for validation), or a `data_dir` holding
    ``train.jsonl`` / ``test.jsonl`` (or ``.parquet``).

    Args:
        train_path: training records (.jsonl or .parquet with question / answer)
        test_path: held-out records, for validation
        data_dir: a directory holding train.jsonl and test.jsonl (or .parquet)
        answer_format: how the model is asked to give its answer: boxed or hash (#### <number>)
        correctness_reward: reward of a correct answer
        format_reward: reward of an answer in the asked format, right or wrong
    """

    name = "gsm8k"
    reward_components = ("correctness", "format")
    max_prompt_tokens = 256  # the longest of GSM8K's 8792 questions with the instruction: 235 (Qwen3 ChatML)

    def __init__(self, train_path: str | Path | None = None, test_path: str | Path | None = None,
                 data_dir: str | Path | None = None, answer_format: str = "boxed",
                 correctness_reward: float = 1.0, format_reward: float = 0.1) -> None:
        if answer_format not in INSTRUCTIONS:
            raise ValueError(f"answer_format must be one of {sorted(INSTRUCTIONS)}, got {answer_format!r}")
        if data_dir is not None:
            train_path = train_path or _find(Path(data_dir), "train")
            test_path = test_path or _find(Path(data_dir), "test")
        if train_path is None:
            raise ValueError("gsm8k needs train_path=... (a .jsonl or .parquet file) or data_dir=...")
        self.answer_format = answer_format
        self.correctness_reward, self.format_reward = float(correctness_reward), float(format_reward)
        self._train = [self._prompt(r, split="train", index=i) for i, r in enumerate(load_records(train_path))]
        self._test = ([self._prompt(r, split="val", index=i) for i, r in enumerate(load_records(test_path))]
                      if test_path is not None else None)
        if not self._train:
            raise ValueError(f"{train_path} holds no records")

    def _prompt(self, record: dict[str, Any], split: str, index: int) -> Prompt:
        try:
            gold = gold_answer(record["answer"])
        except ValueError as e:
            raise ValueError(f"{record['_where']}: {e}") from e
        text = f"{record['question'].strip()}\n\n{INSTRUCTIONS[self.answer_format]}"
        return Prompt(text=text, answer=gold, meta={"split": split, "row": index, "solution": record["answer"],
                                                    "question": record["question"]})

    def train_prompts(self, seed: int = 0, start: int = 0) -> Iterator[Prompt]:
        for index, epoch, row in shuffled_rows(len(self._train), seed, start):
            p = self._train[row]
            yield Prompt(p.text, p.answer, {**p.meta, "index": index, "epoch": epoch})

    def val_prompts(self, n: int) -> list[Prompt]:
        if self._test is None:
            raise ValueError("gsm8k validation needs test_path=... (or data_dir=... with a test file)")
        if not 0 <= n <= len(self._test):
            raise ValueError(f"asked for {n} validation prompts; the test file has {len(self._test)}")
        return self._test[:n]

    def reward(self, prompt: Prompt, completion: str) -> dict[str, float]:
        got = extract_number(completion)
        correct = got is not None and numbers_equal(got.value, prompt.answer)
        if self.answer_format == "boxed":
            raw = extract_boxed(completion)
        else:
            raw = extract_after_hash(completion)
        formatted = raw is not None and parse_number(raw) is not None
        return {"correctness": self.correctness_reward if correct else 0.0,
                "format": self.format_reward if formatted else 0.0}


def _find(data_dir: Path, split: str) -> Path | None:
    for ext in (".jsonl", ".parquet"):
        if (data_dir / f"{split}{ext}").is_file():
            return data_dir / f"{split}{ext}"
    if split == "train":
        raise TaskDataNotFound(f"no train.jsonl or train.parquet in {data_dir}")
    return None
