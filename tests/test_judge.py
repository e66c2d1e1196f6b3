"""The generative judge reward (`monorl.tasks.judge`): grades parsed from real answers, and a real tiny judge model
on monorl's engine, batched, its parse failures counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from monorl.generate.sampling import SamplingParams
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.hf_checkpoint import save_checkpoint
from monorl.model.tokenizer import CharTokenizer
from monorl.tasks.dataset import DatasetTask
from monorl.tasks.judge import judge, parse_score
from monorl.tasks.reward_context import RewardFunctionError


@pytest.mark.parametrize("text,score", [
    ("Score: 7/10", 0.7), ("The answer is right. score: 7.5 / 10.", 0.75), ("Score: 10/10\nScore: 2/10", 1.0),
    ("Score: 0/10", 0.0), ("Score: 11/10", None), ("Score: 3/0", None), ("7 out of 10", None), ("", None),
])
def test_parse_score(text: str, score: float | None) -> None:
    assert parse_score(text) == score


def test_grade_reads_the_answer_after_the_templates_closing_score() -> None:
    j = judge("unused")  # nothing is loaded before the first call
    scores, failures = j.grade([" 7/10", " 3 / 4 because", "seven", " 12/10"])
    assert scores == [0.7, 0.75, None, None] and failures == 2
    own = judge("unused", template="Q: {question}\nA: {completion}\nGrade it as Score: N/10.")
    assert own.grade([" 7/10", "Score: 5/10"]) == ([None, 0.5], 1)


def test_a_template_with_a_command_lines_quoting_or_not_text_stops_in_one_line() -> None:
    """A shell keeps "\\n" as two characters: such a template asks the judge nothing it answers with a grade, so
    every completion would go unscored (demo_distill's first H100 run); a template YAML read as a mapping, too."""
    with pytest.raises(ValueError, match=r"^judge_template holds '\\n' \(two characters\) and no line break: "):
        judge("unused", template="Q: {question}\\nA: {completion}\\nScore:")
    with pytest.raises(ValueError, match=r"^judge_template must be text, got dict"):
        judge("unused", template={"Score": {"completion": None}})  # type: ignore[arg-type]
    judge("unused", template="Q: {question}\nA: {completion}\nSay \\n for a line break. Score:")  # both: meant


def test_a_tiny_judge_grades_a_batch_on_the_engine_and_counts_failures(tmp_path: Path, caplog) -> None:
    model = build_model(model_shape("tiny"), "cpu", torch.float32, seed=3)
    save_checkpoint(model, tmp_path / "judge", tokenizer=CharTokenizer())
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+5=", "answer": "7"}\n')
    task = DatasetTask(data, reward="judge", judge_model=str(tmp_path / "judge"), judge_max_new_tokens=6,
                       judge_rubric="the sum is right")
    assert task.reward_components == ("judge",)
    fn = task._fns[0].fn
    logged: dict[str, list[float]] = {}
    prompts, completions = ["1+1=", "2+5=", "3+3="], ["2", "7", "x"]
    with caplog.at_level("WARNING", logger="monorl"):
        scores = fn(prompts, completions, [[0]] * 3, log_metric=lambda k, v: logged.setdefault(k, []).append(v))
        fn(prompts, completions, [[0]] * 3)
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("judge: ")]
    assert len(warned) == 1 and warned[0].startswith("judge: 3 of 3 answers hold no grade ('Score: N/M'; the "
                                                     "first: ")  # once, not each call
    judged = [CharTokenizer().encode(fn.prompt(p, c)) for p, c in zip(prompts, completions, strict=True)]
    answers = fn.generator.generate(judged, SamplingParams(max_new_tokens=6, temperature=0.0))
    expected, failures = fn.grade([a[0].text for a in answers])  # greedy: the same answers again
    assert scores == expected
    assert failures == 3  # a random tiny model's answers hold no grade: each counted, its reward None
    assert scores == [None, None, None]
    assert logged == {"judge/calls": [3.0], "judge/parse_failures": [float(failures)]}
    assert len(answers) == 3 and all(0 < len(a[0].token_ids) <= 6 for a in answers)


def test_a_reference_template_shows_each_rows_answer_and_needs_an_answer_column(tmp_path: Path) -> None:
    """Reference-guided judging: `{reference}` is each completion's `solution`, else `answer`, in the judge's
    prompt; without either column the run stops in one line (a bug in the setup, not a failed completion)."""
    model = build_model(model_shape("tiny"), "cpu", torch.float32, seed=3)
    save_checkpoint(model, tmp_path / "judge", tokenizer=CharTokenizer())
    j = judge(str(tmp_path / "judge"), template="Q: {question} ref {reference} A: {completion} Score:",
              max_new_tokens=2)
    assert j.references({"answer": [7, 9]}, 2) == [7, 9]
    assert j.references({"solution": ["#### 7"], "answer": [3]}, 1) == ["#### 7"]
    assert j.prompt("2+5=", "7", 7) == "Q: 2+5= ref 7 A: 7 Score:"
    assert judge("unused").references({}, 2) == [None, None]  # the default template shows no reference
    assert len(j(["1+1=", "2+5="], ["2", "7"], [[0], [0]], answer=[2, 7])) == 2  # graded on the engine
    with pytest.raises(RewardFunctionError, match=r"^judge_template holds \{reference\}.*has \['row'\]$"):
        j(["1+1="], ["2"], [[0]], row=[0])
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    task = DatasetTask(data, reward="judge", judge_model=str(tmp_path / "judge"), judge_max_new_tokens=2,
                       judge_template="Q: {question} ref {reference} A: {completion} Score:")
    prompt = next(task.train_prompts())
    assert task.score_batch([prompt], ["2"], [[0]])[0][1] is None  # the answer column reached the judge


def test_the_judge_is_asked_as_a_dataset_task_renders_a_string_prompt(tmp_path: Path) -> None:
    """With a chat template (`chat`, the default) the filled template is one user turn, rendered exactly as a dataset
    task renders a row's string prompt: a judge trained by monorl on rows of filled templates is asked as it was
    trained. Without a template, or with chat off, it is plain text."""
    from monorl.model.hf_checkpoint import load_tokenizer
    from tests.test_tokenizer import write_tokenizer_dir

    tok = load_tokenizer(write_tokenizer_dir(tmp_path / "tok"))
    text = judge("unused").prompt("What is 2 + 5?", "Answer: 7")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": text, "answer": "10/10"}) + "\n")
    row = next(DatasetTask(data, reward="accuracy").train_prompts())
    j = judge("unused")
    j.tokenizer = tok
    assert j.render(text) == DatasetTask(data, reward="accuracy").render(row, tok) != text
    assert j.render(text).startswith("<|im_start|>user\n" + text)
    j.chat = False
    assert j.render(text) == text
    j = judge("unused")
    j.tokenizer = CharTokenizer()  # no chat template: plain text
    assert j.render(text) == text
