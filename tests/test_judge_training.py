"""The trained judge's grading rows (`benchmarks/judge_training.py`, #60's judge-rewarded demo): labelled by the arith
task's own reward, right and wrong balanced, each row's written answer graded as its label says, and `verdict`
rewarding a grade on its label's side only."""

from __future__ import annotations

import json
import random
import sys
from itertools import islice
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import judge_training  # noqa: E402

from monorl.task_registry import load_task  # noqa: E402
from monorl.tasks.base import Prompt  # noqa: E402
from monorl.tasks.judge import parse_score  # noqa: E402


def test_grading_rows_are_balanced_and_graded_as_the_reward_labels_them(tmp_path: Path) -> None:
    task = load_task("arith")
    rng = random.Random(0)
    samples = tmp_path / "samples.jsonl"
    rows = []
    for p in islice(task.train_prompts(seed=3), 300):  # a run's replies: right, near misses, no answer line
        n = int(p.answer)
        reply = rng.choice([f"Answer: {n}", f"Answer: {n + 1}", f"{n}", f"Answer: {n}0"])
        rows.append(json.dumps({"prompt": p.text, "completion": reply}))
    samples.write_text("\n".join(rows) + "\n")
    graded = judge_training.build_rows(samples, task, 200, seed=1)
    assert len(graded) == 200 and sum(r["label"] for r in graded) == 100
    for r in graded:
        question = r["prompt"].split("\n")[0].removeprefix("Question: ")
        reply = r["prompt"].split("Student's reply: ")[1].split("\n\nThe reply is correct")[0]
        truth = judge_training.truth(question)
        assert (task.reward(Prompt(text=question, answer=truth), reply)["correctness"] > 0) == bool(r["label"])
        assert parse_score(r["completion"]) == float(r["label"])
        assert r["completion"].startswith("Student: ") and f"\nReference: {truth}\n" in r["completion"]
    labels = [r["label"] for r in graded[:4]]
    grades = ["Score: 10/10", "Score: 0/10", "no grade", "Student: 7\nReference: 7\nScore: 10/10"]
    assert judge_training.verdict([None] * 4, grades, [[]] * 4, label=labels) == [
        float(labels[0] == 1), float(labels[1] == 0), 0.0, float(labels[3] == 1)]  # no grade: never rewarded
