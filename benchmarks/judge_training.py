"""A judge trained by monorl, for demo_distill's judge-rewarded run (#60, `--judge-model trained`).

The small models here cannot tell a right arith answer from a wrong one when asked (`probe_judge.py`: SmolLM2-135M
grades right / wrong "Answer: n" 0.91 / 0.49 or 0.94 / 0.91 on average, Gemma-3-270M 0.20 / 0.13), so a run
rewarded by them games them (sessions 13 and 16). A judge is usually a larger general model; none can be fetched
here. So the judge is trained, as reward models are: SmolLM2-135M-Instruct, supervised steps (and optionally RL on
`verdict`) on a grading dataset whose labels come from the task's Python reward, over the replies of a *separate*
run (the preset's RL run, every sample logged) plus written variants (`written_variants`). The judge-rewarded run
that follows never calls the Python reward: it only sees the judge's grades.

- `build_rows`: the grading rows, `{"prompt": the filled TEMPLATE, "completion": the graded answer, "label": 1 | 0}`,
  right and wrong balanced. The judge learns from the `completion` column (supervised steps: `--warm_start.steps`;
  asked as-is, SmolLM2 works the question out instead of grading). The graded answer writes the reply's number and
  the reference before the grade (`graded`): a judge trained on the grade alone (session 21's first run) was right
  on every held-out row, yet the run it rewarded found "Answer: 7." graded 10/10 for 79 and drifted to it.
- `verdict`: the grading rows' reward (TRL's reward signature; `--task.args.reward judge_training.py:verdict`): 1.0
  when the judge's "Score: N/10" falls on the label's side of 5/10, else 0.0 (no grade: 0.0); its held-out
  accuracy (the validation's pass@1) and optional RL steps after the supervised ones.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

from monorl.tasks.arith import _ANSWER_RE as arith_answer_re
from monorl.tasks.base import Prompt
from monorl.tasks.completions import completion_text
from monorl.tasks.judge import parse_score

# the judge's question, as the dataset task renders a string prompt (a user turn of its chat template) and as
# `monorl.tasks.judge` asks it with `chat` on: the same text in training and at grading
TEMPLATE = """Question: {question}
Reference answer: {reference}
Student's reply: {completion}

The reply is correct only if the number N of its first "Answer: N" is the reference answer. Write "Student: N" (or \
"Student: none" without such a line), then "Reference: " and the reference answer, then "Score: 10/10" if the two \
are equal, else "Score: 0/10"."""
# "Student: N\nReference: R\nScore: 10/10": 26 of SmolLM2's tokens (a digit each) for 5-digit numbers; a longer
# student number runs out of tokens before its grade: unscorable, never rewarded
ANSWER_TOKENS = 32
ANSWER_RE = arith_answer_re  # the arith task's own: its reward reads the first match
QUESTION_RE = re.compile(r"What is (\d+) ([+*]) (\d+)\?")


def truth(question: str) -> int | None:
    """The exact result of the last "What is a op b?" in `question`."""
    found = QUESTION_RE.findall(question)
    if not found:
        return None
    a, op, b = found[-1]
    return int(a) + int(b) if op == "+" else int(a) * int(b)


def graded(reply: str, reference: int) -> str:
    """The judge's answer the rubric asks for: the reply's number, the reference, the grade (a generative
    verifier that writes what it compares before its verdict, as GenRM-CoT's)."""
    m = ANSWER_RE.search(reply)
    n = m.group(1) if m else "none"
    right = m is not None and int(n) == int(reference)  # as the reward reads it: "Answer: 00" is 0
    return f"Student: {n}\nReference: {reference}\nScore: {'10' if right else '0'}/10"


def written_variants(question: str, answer: int, rng: random.Random) -> list[str]:
    """Replies a policy writes, right and wrong: the bare answer line (with a full stop, or words after), near misses,
    the answer's digits cut, extended or repeated (a run rewarded by a judge trained without them drifted to
    "Answer: 7." for 79), small and random numbers, a worked line with and without the answer line (the form a run
    rewarded by a weak judge drifted to), the answer line after a wrong one."""
    a, op, b = QUESTION_RE.findall(question)[-1]
    near = answer + rng.choice([-10, -2, -1, 1, 2, 10, answer or 1])
    text = str(answer)
    cut = text[:-1] or "0"
    return [f"Answer: {answer}", f"Answer: {answer}.", f"Answer: {near}", f"Answer: {near}.", f"Answer: {cut}",
            f"Answer: {cut}.", f"Answer: {text[1:] or '1'}", f"Answer: {text}{rng.randrange(10)}",
            f"Answer: {text * 2}", f"Answer: {rng.randrange(10)}.", f"Answer: {rng.randrange(1000)}",
            f"{a} {op} {b} = {answer}", f"{a} {op} {b} = {answer}\nAnswer: {answer}",
            f"Answer: {near}\nAnswer: {answer}", f"The answer is {answer}.",
            f"Answer: {answer}. {a} {op} {b} = {answer}.", f"Answer: -{answer}"]


def build_rows(samples: Path, task: Any, size: int, seed: int = 0, written: float = 0.1) -> list[dict[str, Any]]:
    """`size` grading rows (half right, half wrong by the task's own reward) from a run's samples.jsonl and, for a
    `written` share, `written_variants` of its questions."""
    rng = random.Random(seed)
    pool: dict[int, list[tuple[str, str]]] = {0: [], 1: []}
    questions = []
    for line in samples.read_text().splitlines():
        row = json.loads(line)
        q, n = row["prompt"], truth(row["prompt"])
        if n is None:
            continue
        questions.append(q)
        ok = int((task.reward(Prompt(text=q, answer=n), row["completion"])["correctness"] or 0) > 0)
        pool[ok].append((q, row["completion"]))
        if ("Score: 10/10" in graded(row["completion"], n)) != bool(ok):
            raise SystemExit(f"judge_training: the rubric's grade of {row['completion']!r} is not the reward's {ok}")
    for q in rng.sample(questions, min(len(questions), int(size * written))):
        for reply in written_variants(q, truth(q), rng):
            ok = int((task.reward(Prompt(text=q, answer=truth(q)), reply)["correctness"] or 0) > 0)
            pool[ok].append((q, reply))
    half = min(size // 2, len(pool[0]), len(pool[1]))
    if half == 0:
        raise SystemExit(f"judge_training: {samples} gave {len(pool[1])} right and {len(pool[0])} wrong replies; "
                         "need both")
    rows = [{"prompt": TEMPLATE.format(question=q, reference=truth(q), completion=c),
             "completion": graded(c, truth(q)), "label": label}
            for label in (1, 0) for q, c in rng.sample(pool[label], half)]
    rng.shuffle(rows)
    return rows


def verdict(prompts: list, completions: list, completion_ids: list, label: list, **_: Any) -> list[float]:
    """1.0 where the judge's grade is on its label's side (>= 0.5 for a right reply, < 0.5 for a wrong one)."""
    out = []
    for c, y in zip(completions, label, strict=True):
        score = parse_score(completion_text(c))
        out.append(0.0 if score is None else float((score >= 0.5) == bool(int(y))))
    return out
