"""Exact GSM8K grading and linear-time answer extraction (monorl.tasks.answers, monorl.tasks.gsm8k).

Grading used to compare floats with a relative tolerance of 1e-6, so ``#### 2,880,001`` graded correct against a
gold of 2880000; numbers are now parsed from their text into exact Fractions and compared exactly. Extraction
used to be quadratic on repeated unclosed ``\\boxed{`` (and cubic on ``\\frac{`` + spaces); the tests below use
inputs large enough that a super-linear implementation would not finish in any reasonable time, and assert
results only (no wall-clock assertions).
"""

from __future__ import annotations

import json
import random
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest

from monorl.tasks import Gsm8kTask, Prompt
from monorl.tasks.answers import extract_boxed, extract_number, find_numbers, numbers_equal, parse_number
from monorl.tasks.gsm8k import gold_answer, load_records

GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared/data/gsm8k"
needs_gsm8k = pytest.mark.skipif(not (GSM8K_DIR / "train.jsonl").is_file(),
                                 reason=f"GSM8K data not found at {GSM8K_DIR} (tests never copy it into the repo)")


@pytest.fixture
def task(tmp_path: Path) -> Gsm8kTask:
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"question": "q", "answer": "work\n#### 1"}) + "\n")
    return Gsm8kTask(train_path=train)


def _grade(task: Gsm8kTask, gold_text: str, completion: str) -> bool:
    gold = gold_answer(f"reasoning\n#### {gold_text}")
    return task.reward(Prompt("q", gold), completion)["correctness"] == 1.0


# -- exact grading ----------------------------------------------------------------------------------------------

def test_large_integers_must_match_exactly(task):
    assert gold_answer("x\n#### 2,880,000") == 2880000
    assert not _grade(task, "2880000", "#### 2,880,001")
    assert not _grade(task, "2880000", "so \\boxed{2880001}")
    assert not _grade(task, "192000000", "the answer is 192000100")
    assert _grade(task, "2880000", "#### 2,880,000")
    assert _grade(task, "2880000", "so \\boxed{2,880,000}")
    assert _grade(task, "2,880,000", "The answer is $2880000.")
    assert not numbers_equal(extract_number("#### 2,880,001").value, gold_answer("#### 2880000"))


def test_decimals_compare_as_decimals(task):
    got = extract_number("\\boxed{3.50}")
    assert isinstance(got.value, Fraction) and got.value == Fraction(7, 2)
    assert _grade(task, "3.5", "#### 3.50")
    assert _grade(task, "3.50", "\\boxed{3.5}")
    assert numbers_equal(parse_number("3.50"), Decimal("3.5"))
    assert not _grade(task, "3.5", "#### 3.5000001")  # within the old 1e-6 tolerance, but a different number
    assert not numbers_equal(parse_number("3.5000001"), Decimal("3.5"))


def test_float_artefacts_do_not_matter():
    # exact values: 0.1 + 0.2 is 0.3 when the numbers are read from text
    assert parse_number("0.1") + parse_number("0.2") == parse_number("0.3") == Fraction(3, 10)
    assert extract_number("#### 0.3").value == Fraction(3, 10)
    assert numbers_equal(parse_number("0.1") + parse_number("0.2"), Decimal("0.30"))
    # floats handed in by callers are read at 15 significant digits, so their artefacts vanish too
    assert numbers_equal(0.1 + 0.2, Fraction(3, 10))
    assert numbers_equal(0.1 + 0.2, parse_number("0.3"))
    assert numbers_equal(2880000.0, 2880000) and not numbers_equal(2880001.0, 2880000)
    # ... but a genuinely different number is not an artefact
    assert not numbers_equal(parse_number("0.3000001"), parse_number("0.3"))


def test_fractions_and_decimals_agree():
    three_quarters = [parse_number(s) for s in ("3/4", " 3 / 4 ", "0.75", "\\frac{3}{4}", "\\dfrac{3}{4}", "75/100")]
    assert all(v == Fraction(3, 4) for v in three_quarters)
    assert numbers_equal(parse_number("\\frac{3}{4}"), Decimal("0.75"))
    assert extract_number("#### 3/4 of the cake").value == Fraction(3, 4)
    assert numbers_equal(parse_number("2/6"), parse_number("\\frac{1}{3}"))
    assert not numbers_equal(parse_number("0.333333333"), parse_number("1/3"))  # old tolerance said equal
    assert not numbers_equal(parse_number("0.7500001"), parse_number("3/4"))
    assert parse_number("1/0") is None and parse_number("\\frac{1}{0}") is None


def test_numbers_equal_edge_cases():
    assert not numbers_equal(None, 1) and not numbers_equal(1, None) and not numbers_equal(None, None)
    assert not numbers_equal(float("nan"), float("nan"))
    assert not numbers_equal(float("inf"), float("inf"))
    assert not numbers_equal(Decimal("Infinity"), Decimal("Infinity"))
    assert not numbers_equal(Decimal("NaN"), 0)
    assert numbers_equal(18, 18.0) and numbers_equal(Decimal("-7"), Fraction(-14, 2))
    with pytest.raises(TypeError, match="got str"):
        numbers_equal("3", 3)
    assert find_numbers("1,234 and -5.50") == [1234, Fraction(-11, 2)]
    assert all(isinstance(v, Fraction) for v in find_numbers("1,234 and -5.50 and .5"))


# -- linear-time extraction -------------------------------------------------------------------------------------

def _boxed_reference(text: str) -> str | None:
    """The original (quadratic) definition of extract_boxed, for small inputs."""
    start = text.rfind("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i].isspace():
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1:j]
        start = text.rfind("\\boxed", 0, start)
    return None


def test_extract_boxed_semantics():
    assert extract_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed {7}") == "7"
    assert extract_boxed("\\boxed{1} then \\boxed{2}") == "2"
    assert extract_boxed("\\boxed{1} then \\boxed{2") == "1"  # unclosed later box: the earlier closed one
    assert extract_boxed("\\boxed{\\boxed{5}}") == "5"
    assert extract_boxed("\\boxed{a\\boxed{b}") == "b"
    assert extract_boxed("\\boxed 5 and \\boxedx{6}") is None
    assert extract_boxed("}} \\boxed{3}} {") == "3"
    assert extract_boxed("\\boxed{") is None and extract_boxed("") is None
    rng = random.Random(0)
    pieces = ["\\boxed", "\\boxed ", "{", "}", "{", "}", "1", " ", "x", "\\boxedy", "\n"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 16)))
        assert extract_boxed(text) == _boxed_reference(text), text


def test_extract_boxed_is_linear_on_unclosed_boxes():
    # 200k unclosed boxes after a closed one: ~1.4M characters. The old implementation rescanned to the end of
    # the text from every unclosed box (~1e12 steps here); a linear one takes a fraction of a second.
    n = 200_000
    text = "Work... \\boxed{42} and then " + "\\boxed{" * n
    assert extract_boxed(text) == "42"
    got = extract_number(text)
    assert (got.value, got.source) == (42, "boxed")
    assert extract_boxed("\\boxed{" * n) is None
    assert extract_number("\\boxed{" * n + " so 7").source == "last_number"


def test_frac_parsing_is_linear_on_spaces():
    # `\{\s*([^{}]+?)\s*\}` backtracked cubically on "\frac{" + spaces + "}" (800 spaces: ~0.4 s; this: hours).
    spaces = " " * 20_000
    assert parse_number("\\frac{" + spaces + "} is 7") == 7
    assert extract_number("#### \\frac{" + spaces + "}") is None
    got = extract_number("\\boxed{\\frac{" + spaces + "}} the answer is 7")
    assert (got.value, got.source) == (7, "answer_is")
    assert parse_number("\\frac{ 3 }{ 4 }") == Fraction(3, 4)


# -- the real data ----------------------------------------------------------------------------------------------

@needs_gsm8k
def test_real_gsm8k_million_scale_golds(task):
    big = []
    for split in ("train", "test"):
        if not (GSM8K_DIR / f"{split}.jsonl").is_file():
            continue
        big += [gold_answer(r["answer"]) for r in load_records(GSM8K_DIR / f"{split}.jsonl")]
    big = [g for g in big if abs(g) >= 1_000_000]
    assert big, "expected golds of 1e6 scale in GSM8K (16 in train, 2 in test)"
    for gold in big:
        p = Prompt("q", gold)
        assert task.reward(p, f"\\boxed{{{gold:,}}}")["correctness"] == 1.0, gold
        assert task.reward(p, f"#### {gold}")["correctness"] == 1.0, gold
        assert task.reward(p, f"#### {gold + 1:,}")["correctness"] == 0.0, gold
        assert task.reward(p, f"\\boxed{{{gold - 1}}}")["correctness"] == 0.0, gold


@needs_gsm8k
def test_real_gsm8k_every_gold_grades_against_itself(task):
    n = 0
    for split in ("train", "test"):
        path = GSM8K_DIR / f"{split}.jsonl"
        if not path.is_file():
            continue
        for r in load_records(path):
            gold = gold_answer(r["answer"])
            raw = r["answer"].rsplit("####", 1)[1].strip()
            assert gold == Decimal(raw.replace(",", "")), r["_where"]
            got = extract_number(r["answer"])
            assert got is not None and got.source == "hash" and got.value == gold, r["_where"]
            p = Prompt("q", gold)
            assert task.reward(p, r["answer"])["correctness"] == 1.0, r["_where"]
            assert task.reward(p, f"\\boxed{{{raw}}}")["correctness"] == 1.0, r["_where"]
            assert task.reward(p, f"#### {gold + 1}")["correctness"] == 0.0, r["_where"]
            n += 1
    assert n > 7000
