import json
import random
import sys
from itertools import islice
from pathlib import Path

import pytest

from monorl.task_registry import load_task
from monorl.tasks import Gsm8kTask, Prompt, SumDigitsTask, Task, TaskError, safe_reward
from monorl.tasks.answers import extract_boxed, extract_number, find_numbers, numbers_equal, parse_number
from monorl.tasks.gsm8k import gold_answer, load_records
from monorl.tasks.sum_digits import INSTRUCTIONS

GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared/data/gsm8k"
needs_gsm8k = pytest.mark.skipif(not (GSM8K_DIR / "train.jsonl").is_file(),
                                 reason=f"GSM8K data not found at {GSM8K_DIR} (tests never copy it into the repo)")


# -- answer extraction ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,value,source", [
    ("The total is 1,234 apples", 1234, "last_number"),
    ("She paid $1,234.50 in all", 1234.5, "last_number"),
    ("so the answer is 42.", 42, "answer_is"),
    ("The answer is: $18", 18, "answer_is"),
    ("Answer: -7 degrees", -7, "answer_is"),
    ("It went up by 50%", 50, "last_number"),
    ("the temperature is -15 now", -15, "last_number"),
    ("a loss of -$5 today", -5, "last_number"),
    ("3.75 dollars each", 3.75, "last_number"),
    ("10-5 = 5 left", 5, "last_number"),  # subtraction, not a negative number
    ("then 3 - 8 = -5", -5, "last_number"),
    ("#### 1,000", 1000, "hash"),
    ("work 12 + 30 = 42\n#### 42\n", 42, "hash"),
    ("#### 72 clips, 24 in May", 72, "hash"),  # after a marker, the first number
    ("the answer is 3 and then 4", 3, "answer_is"),
    ("x = 3, so \\boxed{12} and later 99", 12, "boxed"),
    ("\\boxed{1,234}", 1234, "boxed"),
    ("\\boxed{\\$18.00}", 18, "boxed"),
    ("\\boxed{\\frac{3}{4}}", 0.75, "boxed"),
    ("\\boxed{x = 12}", 12, "boxed"),
    ("\\boxed{25\\%}", 25, "boxed"),
    ("\\boxed{60 \\text{ minutes}}", 60, "boxed"),
    ("first \\boxed{1} then \\boxed{2}", 2, "boxed"),
    ("\\boxed{5} but #### 6", 5, "boxed"),  # boxed preferred over ####
    ("#### 6\nthe answer is 7", 6, "hash"),  # #### preferred over 'answer is'
    ("\\boxed{} the answer is 7", 7, "answer_is"),  # empty box falls through
    ("\\boxed{3", 3, "last_number"),  # unclosed box is no box
    ("−4 is the result", -4, "last_number"),  # unicode minus
])
def test_extract_number(text, value, source):
    got = extract_number(text)
    assert got is not None
    assert got.value == pytest.approx(value)
    assert got.source == source


@pytest.mark.parametrize("text", ["", "no numbers here", "#### ", "\\boxed{n/a}"])
def test_extract_number_none(text):
    assert extract_number(text) is None


def test_number_helpers():
    assert find_numbers("1,2,3 and 1,234 and 12,3456") == [1, 2, 3, 1234, 12, 3456]
    assert find_numbers("costs .5 or 0.25") == [0.5, 0.25]
    assert parse_number(" 3/4 ") == 0.75
    assert parse_number("1/0") is None
    assert parse_number("none") is None
    assert extract_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed {7}") == "7"
    assert extract_boxed("no box") is None
    assert numbers_equal(0.1 + 0.2, 0.3)
    assert numbers_equal(18, 18.0)
    assert not numbers_equal(18, 18.01)
    assert not numbers_equal(None, 1.0)
    assert not numbers_equal(float("nan"), float("nan"))


# -- sum_digits -------------------------------------------------------------------------------------------------

def _reference_stream(seed: int, k: int) -> list[list[int]]:
    """TorchTitan RL's SumDigitsDataset.__next__, restated: 2-4 numbers in [10, 99] from random.Random(seed)."""
    rng = random.Random(seed)
    out = []
    for _ in range(k):
        n = rng.randint(2, 4)
        out.append([rng.randint(10, 99) for _ in range(n)])
    return out


def test_sum_digits_default_stream_is_the_reference_stream():
    task = SumDigitsTask()
    ref = [x for x in _reference_stream(42, 300) if tuple(x) not in task._val_keys]
    got = [p.meta["numbers"] for p in islice(task.train_prompts(42), len(ref))]
    assert got == ref
    assert [p.meta["numbers"] for p in task.val_prompts(20)] == _reference_stream(99, 20)  # distinct in practice


def test_sum_digits_prompt_and_answer():
    task = SumDigitsTask(instructions=False)
    p = next(task.train_prompts(1))
    nums = p.meta["numbers"]
    assert p.text == f"What is the total digit sum of {nums}?"
    assert p.text.startswith("What is the total digit sum of [") and p.text.endswith("]?")
    assert p.answer == sum(int(c) for x in nums for c in str(x))
    full = next(SumDigitsTask().train_prompts(1))
    assert full.text == INSTRUCTIONS + "\n\n" + p.text
    assert "[ANSWER] <number>" in full.text


def test_sum_digits_reward():
    task = SumDigitsTask()
    p = Prompt("What is the total digit sum of [12, 345, 67]?", 28, {"numbers": [12, 345, 67]})
    assert task.reward(p, "... = 28\n[ANSWER] 28") == {"correctness": 1.0, "format": 0.3}
    assert task.reward(p, "[ANSWER]28") == {"correctness": 1.0, "format": 0.3}
    assert task.reward(p, "[ANSWER] 27") == {"correctness": 0.0, "format": 0.3}
    assert task.reward(p, "[ANSWER] 27 no wait [ANSWER] 28") == {"correctness": 1.0, "format": 0.3}  # last tag
    assert task.reward(p, "[ANSWER] 28 no wait [ANSWER] 27") == {"correctness": 0.0, "format": 0.3}
    assert task.reward(p, "the answer is 28") == {"correctness": 0.0, "format": 0.0}
    assert task.reward(p, "[ANSWER] twenty-eight") == {"correctness": 0.0, "format": 0.0}
    assert task.reward_components == ("correctness", "format")


def test_sum_digits_solution():
    task = SumDigitsTask()
    p = Prompt("What is the total digit sum of [12, 345, 67]?", 28, {"numbers": [12, 345, 67]})
    assert task.solution(p) == ("Break each number into digits:\n12 -> 1, 2\n345 -> 3, 4, 5\n67 -> 6, 7\n"
                                "Sum all digits: 1 + 2 + 3 + 4 + 5 + 6 + 7 = 28\n[ANSWER] 28")
    assert SumDigitsTask(solution_style="short").solution(p) == "[ANSWER] 28"
    for q in islice(task.train_prompts(3), 200):
        assert task.reward(q, task.solution(q)) == {"correctness": 1.0, "format": 0.3}


def test_sum_digits_deterministic_and_resumable():
    task = SumDigitsTask()
    a = list(islice(task.train_prompts(7), 60))
    b = list(islice(SumDigitsTask().train_prompts(7), 60))
    assert [p.text for p in a] == [p.text for p in b]
    assert [p.meta["index"] for p in a] == list(range(60))
    resumed = list(islice(task.train_prompts(7, start=25), 35))
    assert [(p.text, p.meta["index"]) for p in resumed] == [(p.text, p.meta["index"]) for p in a[25:]]
    assert [p.text for p in islice(task.train_prompts(8), 20)] != [p.text for p in a[:20]]


def test_sum_digits_sizes_and_holdout():
    task = SumDigitsTask(min_numbers=3, max_numbers=5, min_digits=1, max_digits=3, val_size=50)
    for p in islice(task.train_prompts(0), 500):
        nums = p.meta["numbers"]
        assert 3 <= len(nums) <= 5 and all(1 <= x <= 999 for x in nums)
    # tiny: 2 one-digit numbers = 81 problems; default hold-out is a quarter, training never sees them
    tiny = SumDigitsTask(min_numbers=2, max_numbers=2, min_digits=1, max_digits=1)
    assert tiny.val_size == 20
    val = {tuple(p.meta["numbers"]) for p in tiny.val_prompts(20)}
    assert len(val) == 20
    train = {tuple(p.meta["numbers"]) for p in islice(tiny.train_prompts(0), 3000)}
    assert not train & val
    assert len(train) == 81 - 20  # and everything else is reachable
    assert [p.text for p in tiny.val_prompts(5)] == [p.text for p in SumDigitsTask(2, 2, 1, 1).val_prompts(5)]


def test_sum_digits_errors():
    with pytest.raises(ValueError, match="val_size"):
        SumDigitsTask(min_numbers=2, max_numbers=2, min_digits=1, max_digits=1, val_size=41)
    with pytest.raises(ValueError, match="min_numbers"):
        SumDigitsTask(min_numbers=3, max_numbers=2)
    with pytest.raises(ValueError, match="min_digits"):
        SumDigitsTask(min_digits=0)
    with pytest.raises(ValueError, match="validation seed"):
        next(SumDigitsTask().train_prompts(99))
    with pytest.raises(ValueError, match="val_size"):
        SumDigitsTask(val_size=10).val_prompts(11)


# -- render / safe_reward ---------------------------------------------------------------------------------------

class FakeTokenizer:
    def __init__(self, has_chat_template):
        self.has_chat_template = has_chat_template
        self.calls = []

    def apply_chat_template(self, messages, add_generation_prompt=True):
        self.calls.append((messages, add_generation_prompt))
        return f"<|user|>{messages[0]['content']}<|assistant|>"


def test_render():
    task = SumDigitsTask(instructions=False)
    p = next(task.train_prompts(0))
    chat = FakeTokenizer(True)
    assert task.render(p, chat) == f"<|user|>{p.text}<|assistant|>"
    assert chat.calls == [([{"role": "user", "content": p.text}], True)]
    plain = FakeTokenizer(False)
    assert task.render(p, plain) == f"User: {p.text}\nAssistant: "
    assert plain.calls == []


@pytest.mark.parametrize("add_bos", [True, False])
def test_render_without_template_starts_with_bos_when_the_tokenizer_adds_it(add_bos):
    """A base model's plain prompt starts with BOS when its tokenizer config says so (add_bos_token: Gemma's,
    transformers adds it to plain text), as one token; never twice, and never for a tokenizer that does not."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from monorl.model.tokenizer import HFTokenizer

    words = ["<pad>", "<eos>", "<bos>", "[UNK]", "User:", "Assistant:", "What", "is", "1", "+", "2?"]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.add_special_tokens(["<pad>", "<eos>", "<bos>"])
    tok = HFTokenizer(raw, {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                            "add_bos_token": add_bos})
    task = SumDigitsTask(instructions=False)
    p = Prompt(text="What is 1 + 2?", answer=3)
    text = task.render(p, tok)
    assert text == ("<bos>" if add_bos else "") + "User: What is 1 + 2?\nAssistant: "
    ids = tok.encode(text)
    assert ids[:2] == ([2, 4] if add_bos else [4, 6]) and ids.count(2) == int(add_bos)


class Flaky(Task):
    name = "flaky"
    reward_components = ("a", "b")

    def __init__(self, out):
        self.out = out

    def train_prompts(self, seed=0, start=0):
        yield Prompt("q", 1)

    def val_prompts(self, n):
        return []

    def reward(self, prompt, completion):
        if isinstance(self.out, Exception):
            raise self.out
        return self.out


@pytest.mark.parametrize("out,why", [
    (RuntimeError("boom"), "boom"),
    ([1.0, 2.0], "expected dict"),
    ({"a": float("nan"), "b": 0.0}, "non-finite"),
    ({"a": 1.0}, "components"),
    ({"a": 1.0, "b": "x"}, "could not convert"),
])
def test_safe_reward_bad(out, why):
    scores, error = safe_reward(Flaky(out), Prompt("q", 1), "c")
    assert scores == {"a": 0.0, "b": 0.0} and why in error


def test_a_raising_reward_logs_its_traceback_once_per_task(caplog):
    """The first failure shows where the reward raised (file and line); later ones go to console.log only."""
    task = Flaky(RuntimeError("boom"))
    for _ in range(3):
        assert safe_reward(task, Prompt("q", 1), "c")[1] == "RuntimeError: boom"
    assert caplog.text.count("Traceback") == 1 and f'File "{__file__}", line' in caplog.text
    safe_reward(Flaky(RuntimeError("boom")), Prompt("q", 1), "c")  # another task (another run): shown again
    assert caplog.text.count("Traceback") == 2


def test_safe_reward_good():
    assert safe_reward(Flaky({"a": 1, "b": 0.5}), Prompt("q", 1), "c") == ({"a": 1.0, "b": 0.5}, None)


# -- load_task --------------------------------------------------------------------------------------------------

USER_TASKS = '''
from monorl.tasks import SumDigitsTask
from monorl.tasks.sum_digits import SumDigitsTask as Cls
instance = SumDigitsTask(instructions=False)
def factory(**kw):
    return SumDigitsTask(**kw)
def bad_factory():
    return 42
not_a_task = 3
class NotATask:
    pass
class Holder:
    inner = instance
'''


def test_load_task(tmp_path, monkeypatch):
    assert isinstance(load_task("sum_digits", min_numbers=2, max_numbers=2), SumDigitsTask)
    (tmp_path / "my_user_tasks.py").write_text(USER_TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_user_tasks", raising=False)
    assert load_task("my_user_tasks:instance").instructions is False
    assert load_task("my_user_tasks:Cls", val_size=7).val_size == 7
    assert load_task("my_user_tasks:factory", val_size=5).val_size == 5
    assert load_task("my_user_tasks:Holder.inner").instructions is False
    assert load_task(f"{tmp_path / 'my_user_tasks.py'}:factory").name == "sum_digits"
    with pytest.raises(ValueError, match="unknown task 'sum_digit'.*gsm8k"):
        load_task("sum_digit")
    with pytest.raises(TaskError, match="no_such_module_xyz"):
        load_task("no_such_module_xyz:Task")
    with pytest.raises(TaskError, match="missing"):
        load_task("my_user_tasks:missing")
    with pytest.raises(TaskError, match="not a monorl.tasks.Task subclass"):
        load_task("my_user_tasks:NotATask")
    with pytest.raises(TaskError, match="returned int"):
        load_task("my_user_tasks:bad_factory")
    with pytest.raises(TaskError, match="expected a Task"):
        load_task("my_user_tasks:not_a_task")
    with pytest.raises(TaskError, match="takes no arguments"):
        load_task("my_user_tasks:instance", val_size=3)
    with pytest.raises(TaskError, match="no such file"):
        load_task(f"{tmp_path / 'nope.py'}:x")
    (tmp_path / "broken_tasks.py").write_text("raise RuntimeError('broken on import')\n")
    with pytest.raises(TaskError, match="broken on import"):
        load_task("broken_tasks:x")
    (tmp_path / "syntax_tasks.py").write_text("def f(:\n")
    with pytest.raises(TaskError, match="SyntaxError"):
        load_task("syntax_tasks:f")
    with pytest.raises(TaskError, match=r"no argument 'max_digit'.*its arguments: .*max_digits"):
        load_task("sum_digits", max_digit=3)
    with pytest.raises(TaskError, match="no argument 'nope'"):
        load_task("my_user_tasks:Cls", nope=1)


# -- gsm8k: file handling on small synthetic files ----------------------------------------------------------------

def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = <<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i:,}"}
        for i in range(0, 1500, 100)]


def test_gsm8k_file_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_records(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n" + "{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        load_records(bad)
    miss = _write_jsonl(tmp_path / "miss.jsonl", [ROWS[0], {"question": "q"}])
    with pytest.raises(ValueError, match=r"miss\.jsonl:2: missing or non-string field 'answer'"):
        load_records(miss)
    nohash = _write_jsonl(tmp_path / "nohash.jsonl", [{"question": "q", "answer": "42"}])
    with pytest.raises(ValueError, match=r"nohash\.jsonl:1: no '####'"):
        Gsm8kTask(train_path=nohash)
    notnum = _write_jsonl(tmp_path / "notnum.jsonl", [{"question": "q", "answer": "x\n#### forty"}])
    with pytest.raises(ValueError, match="not a plain number"):
        Gsm8kTask(train_path=notnum)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if pyarrow were not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    pq = tmp_path / "train.parquet"
    pq.write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="pyarrow"):
        load_records(pq)
    with pytest.raises(ValueError, match="train_path"):
        Gsm8kTask()
    with pytest.raises(ValueError, match="answer_format"):
        Gsm8kTask(train_path=miss, answer_format="latex")


def test_gsm8k_stream_and_val(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", ROWS)
    task = Gsm8kTask(train_path=train)
    assert gold_answer(ROWS[-1]["answer"]) == 2800  # "#### 2,800"
    n = len(ROWS)
    stream = list(islice(task.train_prompts(seed=5), 3 * n))
    assert [p.meta["index"] for p in stream] == list(range(3 * n))
    for e in range(3):  # each epoch is a permutation of the file
        assert sorted(p.meta["row"] for p in stream[e * n:(e + 1) * n]) == list(range(n))
    assert [p.meta["row"] for p in stream[:n]] != [p.meta["row"] for p in stream[n:2 * n]]  # reshuffled
    again = list(islice(Gsm8kTask(train_path=train).train_prompts(seed=5), 3 * n))
    assert [p.text for p in again] == [p.text for p in stream]
    resumed = list(islice(task.train_prompts(seed=5, start=n + 3), n))
    assert [(p.text, p.meta["index"]) for p in resumed] == [(p.text, p.meta["index"]) for p in stream[n + 3:2 * n + 3]]
    with pytest.raises(ValueError, match="test_path"):
        task.val_prompts(1)
    _write_jsonl(tmp_path / "test.jsonl", ROWS[:4])
    by_dir = Gsm8kTask(data_dir=tmp_path)
    assert [p.answer for p in by_dir.val_prompts(4)] == [0, 200, 400, 600]
    with pytest.raises(ValueError, match="has 4"):
        by_dir.val_prompts(5)


def test_gsm8k_prompt_and_reward(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", ROWS)
    boxed = Gsm8kTask(train_path=train)
    p = next(boxed.train_prompts(0))
    assert p.text.startswith(p.meta["question"]) and p.text.endswith("\\boxed{}.")
    gold = p.answer
    assert boxed.reward(p, f"so \\boxed{{{gold:,.0f}}}") == {"correctness": 1.0, "format": 0.1}
    assert boxed.reward(p, f"#### {gold:.0f}") == {"correctness": 1.0, "format": 0.0}
    assert boxed.reward(p, f"\\boxed{{{gold + 1:.0f}}}") == {"correctness": 0.0, "format": 0.1}
    assert boxed.reward(p, "I don't know") == {"correctness": 0.0, "format": 0.0}
    hashed = Gsm8kTask(train_path=train, answer_format="hash", format_reward=0.2)
    q = next(hashed.train_prompts(0))
    assert "#### <number>" in q.text
    assert hashed.reward(q, f"work\n#### {q.answer:.0f}") == {"correctness": 1.0, "format": 0.2}
    assert hashed.reward(q, f"\\boxed{{{q.answer:.0f}}}") == {"correctness": 1.0, "format": 0.0}


# -- gsm8k: the real data -----------------------------------------------------------------------------------------

@needs_gsm8k
def test_gsm8k_real_train_file_every_line_parses():
    lines = [ln for ln in (GSM8K_DIR / "train.jsonl").read_text(encoding="utf-8").splitlines() if ln.strip()]
    records = load_records(GSM8K_DIR / "train.jsonl")
    assert len(records) == len(lines) > 7000
    for r in records:
        gold = gold_answer(r["answer"])
        raw = r["answer"].rsplit("####", 1)[1].strip()
        assert gold == float(raw.replace(",", "")), r["_where"]


@needs_gsm8k
def test_gsm8k_real_reference_solutions_get_full_correctness():
    task = Gsm8kTask(data_dir=GSM8K_DIR)
    val = task.val_prompts(500)
    train = list(islice(task.train_prompts(0), 2000))
    for p in val + train:
        r = task.reward(p, p.meta["solution"])
        assert r["correctness"] == 1.0, (p.meta["row"], p.meta["solution"])
    # and the same answer as a boxed final line earns the format bonus too
    for p in val[:100]:
        assert p.answer == int(p.answer)
        done = f"Reasoning...\nThe answer is \\boxed{{{int(p.answer):,}}}."
        assert task.reward(p, done) == {"correctness": 1.0, "format": 0.1}
