"""--task.name dataset: your own data (JSONL / CSV / Parquet / save_to_disk) and plain TRL-style reward functions."""

import json
import math
from itertools import islice

import pytest
import torch

from monorl.model.tokenizer import CharTokenizer
from monorl.rl.rollouts.rollout import Rollout
from monorl.run.grpo import GRPORun
from monorl.task_registry import load_task
from monorl.tasks import DatasetTask, Prompt, Task, TaskError
from monorl.tasks.base import safe_score_batch
from monorl.tasks.reward_context import RewardContext, RewardFunctionError
from monorl.tasks.rewards import accuracy
from tests.conftest import digits_cfg

datasets = pytest.importorskip("datasets")

ROWS = [{"prompt": f"What is {i} + {i}?", "solution": str(2 * i), "level": i % 3} for i in range(12)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _task(tmp_path, rows=ROWS, **kw):
    kw.setdefault("reward", "format")
    return DatasetTask(path=_jsonl(tmp_path / "data.jsonl", rows), **kw)


# -- loading ----------------------------------------------------------------------------------------------------

def _rows_of(task):
    return sorted((p.text, p.meta["columns"]["solution"]) for p in islice(task.train_prompts(0), len(task._train)))


def test_formats_load_the_same_rows(tmp_path):
    expected = sorted((r["prompt"], r["solution"]) for r in ROWS)
    ds = datasets.Dataset.from_list(ROWS)
    ds.to_csv(str(tmp_path / "data.csv"), index=False)
    ds.to_parquet(str(tmp_path / "data.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    _jsonl(tmp_path / "data.jsonl", ROWS)
    for name in ("data.jsonl", "data.csv", "data.parquet", "saved"):
        task = load_task("dataset", path=str(tmp_path / name), reward="format")
        got = _rows_of(task)
        if name == "data.csv":  # CSV infers types: "2" is read back as the number 2
            got = [(t, str(s)) for t, s in got]
        assert got == expected, name
        assert task.columns == ["solution", "level"]


def test_saved_dataset_dict_uses_its_test_split(tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:8]),
                               "test": datasets.Dataset.from_list(ROWS[8:])})
    dd.save_to_disk(str(tmp_path / "dd"))
    task = DatasetTask(path=tmp_path / "dd", reward="format")
    assert len(task._train) == 8 and [p.text for p in task.val_prompts(4)] == [r["prompt"] for r in ROWS[8:]]


def test_chat_messages_render_through_the_chat_template(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Add {i} and 1"}],
             "solution": str(i + 1)} for i in range(4)]
    task = _task(tmp_path, rows)
    p = next(task.train_prompts(0))
    assert p.meta["messages"][0] == {"role": "system", "content": "Be brief."} and p.text.startswith("Add ")
    tok = CharTokenizer()
    assert task.render(p, tok) == f"System: Be brief.\nUser: {p.text}\nAssistant: "  # no template: plain turns
    tok.chat_template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    assert task.render(p, tok) == f"<|system|>Be brief.\n<|user|>{p.text}\n<|assistant|>"
    # a string prompt is one user turn, as before
    q = next(_task(tmp_path).train_prompts(0))
    assert task.render(q, tok) == f"<|user|>{q.text}\n<|assistant|>"


def test_held_out_split_by_path_and_by_fraction(tmp_path):
    test_file = _jsonl(tmp_path / "test.jsonl", [{"prompt": "held out", "solution": "0", "level": 0}])
    task = _task(tmp_path, test_path=str(test_file))
    assert [p.text for p in task.val_prompts(1)] == ["held out"]
    assert task.val_prompts(0) == []
    with pytest.raises(TaskError, match="has 1 rows"):
        task.val_prompts(2)

    a, b = _task(tmp_path, test_fraction=0.25), _task(tmp_path, test_fraction=0.25)
    val = [p.text for p in a.val_prompts(3)]
    assert val == [p.text for p in b.val_prompts(3)]  # the same rows every time
    train = {p.text for p in islice(a.train_prompts(5), 27)}
    assert len(train) == 9 and not train & set(val) and len(train | set(val)) == 12
    with pytest.raises(TaskError, match="held-out split"):
        _task(tmp_path).val_prompts(1)


def test_order_deterministic_per_seed_and_resumable(tmp_path):
    task = _task(tmp_path)
    stream = list(islice(task.train_prompts(seed=1), 30))  # 2.5 epochs
    assert [p.meta["index"] for p in stream] == list(range(30))
    assert [p.text for p in stream] == [p.text for p in islice(task.train_prompts(seed=1), 30)]
    assert [p.text for p in stream] != [p.text for p in islice(task.train_prompts(seed=2), 30)]
    assert sorted(p.text for p in stream[:12]) == sorted(r["prompt"] for r in ROWS)  # an epoch is a permutation
    for k in (0, 5, 12, 17):
        tail = list(islice(task.train_prompts(seed=1, start=k), 30 - k))
        assert [(p.text, p.meta["index"]) for p in tail] == [(p.text, p.meta["index"]) for p in stream[k:]]


# -- rewards ----------------------------------------------------------------------------------------------------

SEEN = {}


def sees_columns(prompts, completions, completion_ids, solution, level, **kwargs):
    SEEN.update(prompts=prompts, completions=completions, completion_ids=completion_ids, solution=solution,
                level=level, kwargs=kwargs)
    return [1.0 if c == s else 0.0 for c, s in zip(completions, solution, strict=True)]


def only_level_zero(completions, level):  # no **kwargs: gets only the arguments it names
    return [0.5 if lv == 0 else None for lv in level]


async def async_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


def raises(completions, **kwargs):
    raise RuntimeError("boom")


def _batch(task, completions):
    prompts = list(islice(task.train_prompts(0), len(completions)))
    return prompts, task.score_batch(prompts, completions, [[7] * len(c) for c in completions])


def test_columns_reach_reward_functions_once_per_batch(tmp_path):
    task = _task(tmp_path, reward=[sees_columns])
    prompts, out = _batch(task, ["2", "x", "y"])
    assert SEEN["prompts"] == [p.text for p in prompts]
    assert SEEN["completions"] == ["2", "x", "y"] and SEEN["completion_ids"] == [[7], [7], [7]]
    assert SEEN["solution"] == [p.meta["columns"]["solution"] for p in prompts]
    assert SEEN["level"] == [p.meta["columns"]["level"] for p in prompts]
    assert set(SEEN["kwargs"]) == {"trainer_state", "log_metric", "log_extra"}  # TRL's extras, nothing else
    assert [vals for vals, _ in out] == [{"sees_columns": float(p.meta["columns"]["solution"] == c)}
                                        for p, c in zip(prompts, ["2", "x", "y"], strict=True)]


def test_chat_prompts_give_trl_conversational_completions(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "Say 3"}], "solution": "3", "level": 0}]
    task = _task(tmp_path, rows, reward=[sees_columns, "accuracy"])
    prompts, out = _batch(task, ["\\boxed{3}"])
    assert SEEN["prompts"] == [[{"role": "user", "content": "Say 3"}]]
    assert SEEN["completions"] == [[{"role": "assistant", "content": "\\boxed{3}"}]]
    assert out == [({"sees_columns": 0.0, "accuracy": 1.0}, None)]  # built-ins read either form


def test_weights_none_and_async(tmp_path):
    task = _task(tmp_path, reward=[only_level_zero, async_len], reward_weights="2.0,0.5")
    assert task.reward_components == ("only_level_zero", "async_len")
    assert task.reward_weights == {"only_level_zero": 2.0, "async_len": 0.5}
    prompts, out = _batch(task, ["abcd", "ab", "a"])
    for p, c, (vals, err) in zip(prompts, ["abcd", "ab", "a"], out, strict=True):
        assert err is None
        lz = 0.5 if p.meta["columns"]["level"] == 0 else None  # None: not applicable
        assert vals == {"only_level_zero": lz, "async_len": float(len(c))}  # as returned: unweighted
        # the reward: the weighted sum of the values that apply
        r = Rollout(p, [1], [2], [0.0], "stop", c, vals, weights=task.reward_weights)
        assert r.reward == (2.0 * lz if lz is not None else 0.0) + 0.5 * len(c)
    assert {p.meta["columns"]["level"] for p in prompts} != {0}  # the None case was exercised


def test_reward_specs_by_name_module_and_file(tmp_path):
    (tmp_path / "my_rewards.py").write_text("def shout(completions, **kw):\n    return [1.0 for _ in completions]\n")
    task = _task(tmp_path, reward=f"format,tests.test_dataset_task:only_level_zero,{tmp_path / 'my_rewards.py'}:shout",
                 reward_weights=[1, 1, 3])
    assert task.reward_components == ("format", "only_level_zero", "shout")
    _, out = _batch(task, ["\\boxed{2}", "2"])
    assert out[0][0]["format"] == 1.0 and out[1][0]["format"] == 0.0 and out[0][0]["shout"] == 1.0
    assert _task(tmp_path, reward="format,format").reward_components == ("format", "format_2")
    pat = _task(tmp_path, reward="format", format_pattern=r"^ANSWER: \d+$")
    assert [v["format"] for v, _ in _batch(pat, ["ANSWER: 4", "answer 4"])[1]] == [1.0, 0.0]


def test_length_penalty(tmp_path):
    task = _task(tmp_path, reward="length", length_max=8, length_soft=4)
    prompts = list(islice(task.train_prompts(0), 4))
    out = task.score_batch(prompts, ["a"] * 4, [[1] * 2, [1] * 4, [1] * 6, [1] * 20])
    assert [v["length"] for v, _ in out] == [0.0, 0.0, -0.5, -1.0]
    with pytest.raises(TaskError, match="length_max"):
        _task(tmp_path, reward="length")


def test_failing_reward_names_itself_and_scores_zero(tmp_path):
    task = _task(tmp_path, reward=[async_len, raises])
    _, out = _batch(task, ["ab", "c"])
    for vals, err in out:
        assert vals == {"async_len": 0.0, "raises": 0.0}
        assert err == "reward 'raises' raised RuntimeError: boom"
    bad = _task(tmp_path, reward=[lambda completions, **kw: [1.0, float("nan")]])
    (ok, e0), (zero, e1) = _batch(bad, ["a", "b"])[1]  # NaN: that completion fails (counted), the others score
    assert e0 is None and ok == {"<lambda>": 1.0} and zero == {"<lambda>": 0.0} and "not a finite number" in e1


def short(completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def scalar(completions, **kwargs):
    return 1.0


def text(completions, **kwargs):
    return ["1.0"] + [1.0] * (len(completions) - 1)


def nested(completions, **kwargs):
    return [1.0, [0.5]] + [1.0] * (len(completions) - 2)


def test_wrong_shape_or_type_is_a_bug_raised_at_once(tmp_path):
    """A reward function of the wrong shape or type fails the run at its first batch with one line naming it
    (not a warning per step and scores of 0): RewardFunctionError, a ValueError the CLI prints as one line."""
    cases = [(short, "reward function 'short' returned 2 values for 3 completions"),
             (scalar, "reward function 'scalar' returned float 1.0 for 3 completions; return a list of float or None"),
             (text, "reward function 'text' returned str '1.0' at index 0; return a list of float or None"),
             (nested, "reward function 'nested' returned list [0.5] at index 1"),
             (async_scalar, "reward function 'async_scalar' returned float 2.0 for 3 completions")]
    for fn, msg in cases:
        with pytest.raises(RewardFunctionError) as e:
            _batch(_task(tmp_path, reward=["format", fn]), ["a", "b", "c"])
        assert msg in _one_line(e), str(e.value)
        assert isinstance(e.value, ValueError)
    # safe_score_batch (what the rollouts call) lets it through instead of scoring 0
    task = _task(tmp_path, reward=[text])
    prompts = list(islice(task.train_prompts(0), 2))
    with pytest.raises(RewardFunctionError, match="returned str"):
        safe_score_batch(task, prompts, ["a", "b"], [[1], [1]])
    # numbers of any numeric type are fine: ints, bools, numpy / torch scalars
    np = pytest.importorskip("numpy")
    odd = _task(tmp_path, reward=[lambda completions, **kw: [1, True, np.float32(0.5)]])
    assert [v["<lambda>"] for v, _ in _batch(odd, ["a", "b", "c"])[1]] == [1.0, 1.0, 0.5]
    tensor = _task(tmp_path, reward=[lambda completions, **kw: torch.tensor([0.0, 1.0])])  # a 1-d tensor is a list
    assert [v["<lambda>"] for v, _ in _batch(tensor, ["a", "b"])[1]] == [0.0, 1.0]
    with pytest.raises(RewardFunctionError, match="returned Tensor tensor\\(1.\\) for 2 completions"):
        _batch(_task(tmp_path, reward=[lambda completions, **kw: torch.tensor(1.0)]), ["a", "b"])


async def async_scalar(completions, **kwargs):
    return 2.0


def shaped_by_progress(completions, trainer_state, log_metric, log_extra, **kwargs):
    """A TRL reward that reads the trainer's state and logs: a metric and a column."""
    log_metric("my_metric", float(len(completions)))
    log_extra("why", [f"len {len(c)}" for c in completions])
    return [trainer_state.global_step / max(1, trainer_state.max_steps) + trainer_state.epoch for _ in completions]


def test_trainer_state_log_metric_and_log_extra(tmp_path):
    """TRL's extras: trainer_state (global_step, max_steps, epoch) is accepted at startup and filled from the
    context; log_metric values gather in the context (the step's row gets their mean), log_extra's column comes
    back one value per completion."""
    task = _task(tmp_path, reward=[shaped_by_progress])  # named trainer_state: not refused as "not a column"
    prompts = list(islice(task.train_prompts(0), 3))
    ctx = RewardContext(global_step=2, max_steps=8, data_position=6)  # 6 of the 12 rows drawn: epoch 0.5
    out = task.score_batch(prompts, ["a", "bb", "ccc"], [[1]] * 3, context=ctx)
    assert [v["shaped_by_progress"] for v, _ in out] == [2 / 8 + 0.5] * 3
    task.score_batch(prompts[:1], ["a"], [[1]], context=ctx)
    assert ctx.metrics == {"my_metric": [3.0, 1.0]} and ctx.metric_means() == {"my_metric": 2.0}
    assert ctx.take_columns(1) == [{"why": "len 1"}] and ctx.columns == {}  # the last call's, then cleared
    # a column of the wrong length or a metric that is not a number is a bug in the reward: raised, naming it

    def bad_extra(completions, log_extra, **kw):
        log_extra("x", [1])
        return [0.0] * len(completions)

    def bad_metric(completions, log_metric, **kw):
        log_metric("m", "high")
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError, match="'bad_extra': log_extra\\('x'\\) got 1 values for 2 completions"):
        _task(tmp_path, reward=[bad_extra]).score_batch(prompts[:2], ["a", "b"], [[1], [1]], context=RewardContext())
    with pytest.raises(RewardFunctionError, match="'bad_metric': log_metric\\('m'\\) got str 'high'"):
        _task(tmp_path, reward=[bad_metric]).score_batch(prompts[:1], ["a"], [[1]])
    with pytest.raises(TaskError, match="'trainer_state' shadows a reward function argument"):
        _task(tmp_path, [{"prompt": "p", "trainer_state": 1}])


def test_default_score_batch_is_safe_reward_per_completion():
    class Half(Task):
        name, reward_components = "half", ("x",)

        def train_prompts(self, seed=0, start=0):
            yield from ()

        def val_prompts(self, n):
            return []

        def reward(self, prompt, completion):
            if completion == "bad":
                raise ValueError("no")
            return {"x": 0.5}

    p = Prompt("q", None)
    assert safe_score_batch(Half(), [p, p], ["ok", "bad"], [[1], [2]]) == [({"x": 0.5}, None),
                                                                         ({"x": 0.0}, "ValueError: no")]

    class Batched(Half):
        def score_batch(self, prompts, completions, completion_ids):  # an override without `context`: still called
            return [({"x": 1.0}, None)] * len(completions)

    out = safe_score_batch(Batched(), [p, p], ["a", "b"], [[]] * 2, context=RewardContext())
    assert out == [({"x": 1.0}, None)] * 2

    class Broken(Half):
        def score_batch(self, prompts, completions, completion_ids):
            return [({"x": 1.0}, None)]  # one result for two completions: a bug, raised

    with pytest.raises(RewardFunctionError, match="task 'half': score_batch returned 1 results for 2 completions"):
        safe_score_batch(Broken(), [p, p], ["a", "b"], [[], []], context=RewardContext())


@pytest.mark.parametrize("gold,completion,expected", [
    ("2", "\\boxed{2}", 1.0),
    ("\\boxed{2}", "so it is 2", 1.0),
    ("1/2", "0.5", 1.0),
    ("1/2", "The answer is $\\frac{1}{2}$", 1.0),
    ("2", "\\boxed{3}", 0.0),
    ("no number here", "2", None),  # the gold answer does not parse: not applicable
])
def test_accuracy_math_verify(gold, completion, expected):
    assert accuracy([None], [completion], [[]], solution=[gold]) == [expected]


def test_accuracy_by_name_reads_solution_or_answer(tmp_path):
    task = _task(tmp_path, reward="accuracy,format", reward_weights="1,0.1")
    prompts = list(islice(task.train_prompts(0), 2))
    completions = [f"\\boxed{{{prompts[0].meta['columns']['solution']}}}", "999"]
    out = task.score_batch(prompts, completions, [[1], [1]])
    assert out == [({"accuracy": 1.0, "format": 1.0}, None), ({"accuracy": 0.0, "format": 0.0}, None)]
    rows = [{"prompt": "1+1?", "answer": 2}]
    task = _task(tmp_path, rows, reward="accuracy")
    _, out = _batch(task, ["\\boxed{2}"])
    assert out == [({"accuracy": 1.0}, None)]
    with pytest.raises(TaskError, match="'solution' or 'answer' column"):
        _task(tmp_path, [{"prompt": "x", "gold": "1"}], reward="accuracy")


# -- one-line errors --------------------------------------------------------------------------------------------

def _one_line(excinfo):
    assert "\n" not in str(excinfo.value)
    return str(excinfo.value)


def test_errors_are_one_line(tmp_path):
    cases = [
        (dict(path=tmp_path / "missing.jsonl", reward="format"), "dataset not found"),
        (dict(path=tmp_path / "data.txt", reward="format"), "unknown dataset format"),
        (dict(path=tmp_path / "bad.jsonl", reward="format"), "cannot read"),
        (dict(path=tmp_path / "empty.jsonl", reward="format"), "holds no rows"),
        (dict(path=tmp_path / "data.jsonl", reward="format", prompt_column="question"), "no column 'question'"),
        (dict(path=tmp_path / "data.jsonl"), "needs --task.args.reward"),
        (dict(path=tmp_path / "data.jsonl", reward="nope"), "unknown reward 'nope'"),
        (dict(path=tmp_path / "data.jsonl", reward="nomod_xyz:f"), "cannot import module 'nomod_xyz'"),
        (dict(path=tmp_path / "data.jsonl", reward="tests.test_dataset_task:nofn"), "has no attribute 'nofn'"),
        (dict(path=tmp_path / "data.jsonl", reward="format,format", reward_weights="1"), "2 reward functions but 1"),
        (dict(path=tmp_path / "data.jsonl", reward=[sees_columns], prompt_column="prompt2"), "no column"),
        (dict(path=tmp_path / "data.jsonl", reward="format", test_fraction=0.01), "empty test split"),
        (dict(path=tmp_path / "data.jsonl", reward="format", test_path=tmp_path / "empty.jsonl"), "holds no rows"),
        (dict(path=tmp_path / "data.jsonl", reward="format", format_pattern="("), "not a valid regex"),
        (dict(path=tmp_path / "badprompt.jsonl", reward="format"), "row 1: column 'prompt' must hold"),
        (dict(path=tmp_path / "data.jsonl", reward="tests.test_dataset_task:needs_gold"), "takes gold, which is not"),
    ]
    _jsonl(tmp_path / "data.jsonl", ROWS)
    (tmp_path / "data.txt").write_text("x")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\nnot json\n')
    (tmp_path / "empty.jsonl").write_text("")
    _jsonl(tmp_path / "badprompt.jsonl", [{"prompt": [{"role": "user", "content": "a"}]}, {"prompt": None}])
    for kwargs, msg in cases:
        with pytest.raises(TaskError) as e:
            load_task("dataset", **kwargs)
        assert msg in _one_line(e), (kwargs, str(e.value))


def needs_gold(completions, gold):
    return [0.0 for _ in completions]


# -- end to end -------------------------------------------------------------------------------------------------

REWARDS_PY = '''
def digits(completions, trainer_state, log_metric, log_extra, **kwargs):  # TRL's extras: state and logging
    log_metric("seen/global_step", trainer_state.global_step)
    log_extra("state", [f"{trainer_state.global_step}/{trainer_state.max_steps}"] * len(completions))
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


async def says_target(completions, target, **kwargs):  # None (not applicable) where the row has no target
    return [None if t is None else 1.0 if t in c else 0.0 for c, t in zip(completions, target)]
'''

# what every step row holds, named as TRL's GRPOTrainer names it (kl: with kl_coef > 0)
TRL_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "rewards/digits/mean", "rewards/digits/std",
               "rewards/says_target/mean", "rewards/says_target/std", "entropy", "kl", "clip_ratio/low_mean",
               "clip_ratio/high_mean", "clip_ratio/region_mean", "completions/mean_length",
               "completions/min_length", "completions/max_length", "completions/mean_terminated_length",
               "completions/min_terminated_length", "completions/max_terminated_length", "completions/clipped_ratio",
               "num_tokens", "learning_rate", "grad_norm", "loss")


def test_short_run_on_a_jsonl_dataset_with_two_reward_functions(tmp_path):
    rows = [{"prompt": f"Say numbers {i}", "target": str(i % 10) if i % 3 else None} for i in range(16)]
    data = _jsonl(tmp_path / "data.jsonl", rows)
    (tmp_path / "rewards.py").write_text(REWARDS_PY)
    cfg = digits_cfg(tmp_path)
    cfg.task.name = "dataset"
    cfg.task.args = {"path": str(data), "test_fraction": 0.25, "reward_weights": "1.0,0.5",
                     "reward": f"{tmp_path / 'rewards.py'}:digits,{tmp_path / 'rewards.py'}:says_target"}
    cfg.samples_per_step = 4 * 6  # every rollout, to recompute the step's metrics from them
    cfg.trainer.loss.kl_coef = 0.01
    cfg.validation.every, cfg.validation.k = 2, 2  # after step 2 of 3, 2 samples per prompt
    run = GRPORun(cfg, progress=False)
    assert run.task.reward_components == ("digits", "says_target") and run.spec.pass_component == "digits"
    result = run.run()
    assert len(result.steps) == 3
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert {s["prompt"] for s in samples} <= {r["prompt"] for r in rows}
    tokens = 0
    for row in result.steps:
        assert set(TRL_METRICS) <= set(row), set(TRL_METRICS) - set(row)
        assert math.isfinite(row["loss"]) and row["entropy"] > 0 and row["kl"] >= 0
        mine = [s for s in samples if s["step"] == row["step"]]
        assert len(mine) == 24 and all(set(s["rewards"]) == {"digits", "says_target"} for s in mine)
        # trainer_state.global_step: the steps trained before this one; log_metric -> the row, log_extra -> samples
        assert row["seen/global_step"] == row["step"]
        assert all(s["extra"] == {"state": f"{row['step']}/3"} for s in mine)
        assert all("<pad>" not in s["completion"] and "<eos>" not in s["completion"] for s in mine)
        # each function's raw mean over the completions it applies to (None left out), as TRL logs it
        for name in ("digits", "says_target"):
            vals = [s["rewards"][name] for s in mine if s["rewards"][name] is not None]
            assert row[f"rewards/{name}/mean"] == (pytest.approx(sum(vals) / len(vals)) if vals else None)
        # the reward: the weighted sum of the values that apply
        reward = [s["rewards"]["digits"] + 0.5 * (s["rewards"]["says_target"] or 0.0) for s in mine]
        assert row["reward"] == pytest.approx(sum(reward) / len(reward))
        tokens += row["train_tokens"]  # no masking here: every prompt + completion token is trained on
        assert row["num_tokens"] == tokens and row["learning_rate"] > 0
        assert row["throughput/tokens_per_s"] > 0 and row["throughput/generate_tokens_per_s"] > 0
    assert any(s["rewards"]["says_target"] is None for s in samples)  # the None case was exercised
    # validation.every 2: after step 2 (index 1) only; the last step's is the post-validation
    assert [("val/pass@2" in r, "val/mean@2" in r) for r in result.steps] == [(False,) * 2, (True,) * 2, (False,) * 2]
    assert 0 <= result.steps[1]["val/mean@2"] <= result.steps[1]["val/pass@2"] <= 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [v["step"] for v in summary["validations"]] == [2] and summary["post"]["k"] == 2
    assert summary["post"]["pass_at_k"] is not None and summary["post"]["pass_component"] == "digits"


def _tiny_generator(tok):
    from monorl.generate import Generator, GeneratorConfig
    from monorl.model.config import model_shape
    from monorl.model.decoder import build_model

    model = build_model(model_shape("tiny"), "cpu", torch.float32, seed=0)
    return Generator(model, GeneratorConfig(max_num_seqs=8, max_model_len=128, block_size=4), tokenizer=tok,
                     eos_token_ids=())  # no stop: every token stays in the completion


def test_reward_functions_see_text_without_special_tokens(tmp_path):
    """Completions are decoded with special tokens skipped, as TRL decodes them for its reward functions: a sampled
    <pad> / <bos> is in completion_ids, not in the text (the reward's, and samples.jsonl's)."""
    from monorl.generate import SamplingParams
    from monorl.rl.rollouts.rollout import generate_rollouts

    tok = CharTokenizer()
    task = _task(tmp_path, reward=[sees_columns])
    prompts = list(islice(task.train_prompts(0), 2))
    groups = generate_rollouts(_tiny_generator(tok), tok, task, prompts,
                               SamplingParams(max_new_tokens=40, temperature=1.0, seed=3), 4, 128)
    rollouts = [r for g in groups for r in g]
    assert SEEN["completions"] == [r.text for r in rollouts]
    assert SEEN["completion_ids"] == [r.completion_ids for r in rollouts]  # unchanged: every token
    assert all(r.text == tok.decode(r.completion_ids, skip_special_tokens=True) for r in rollouts)
    special = [r for r in rollouts if {0, 2} & set(r.completion_ids)]
    assert special, "the seed must sample a special token for this test to check anything"
    assert all(tok.decode(r.completion_ids) != r.text and "<pad>" not in r.text for r in special)


def test_logged_metrics_and_columns_through_the_rollouts_of_every_rank(tmp_path):
    """generate_rollouts hands the step's context to the rewards: log_extra's column lands in each rollout's extra,
    and log_metric's values of every rank (here rank 0 of 2, the other rank's part scripted) join the context."""
    from monorl.distributed.world import World
    from monorl.generate import SamplingParams
    from monorl.rl.rollouts.rollout import generate_rollouts

    class RankZeroOfTwo(World):
        def gather_lists(self, items):
            return items + [([], {"my_metric": [100.0]})]  # rank 1: no groups here, one logged value

    tok = CharTokenizer()
    task = _task(tmp_path, reward=[shaped_by_progress])
    prompts = list(islice(task.train_prompts(0), 4))
    ctx = RewardContext(global_step=1, max_steps=4, data_position=3)
    groups = generate_rollouts(_tiny_generator(tok), tok, task, prompts, SamplingParams(max_new_tokens=6, seed=1),
                               2, 128, world=RankZeroOfTwo(rank=0, size=2), context=ctx)
    assert len(groups) == 2  # rank 0's share of the 4 prompts
    assert ctx.metrics == {"my_metric": [4.0, 100.0]} and ctx.metric_means() == {"my_metric": 52.0}
    assert [r.extra for g in groups for r in g] == [{"why": f"len {len(r.text)}"} for g in groups for r in g]
    assert all(r.rewards["shaped_by_progress"] == 1 / 4 + 3 / 12 for g in groups for r in g)


def grades_nothing(completions, log_metric, **kwargs):
    """A judge whose every answer failed to parse: None for each completion, its failures logged."""
    log_metric("mine/parse_failures", float(len(completions)))
    return [None] * len(completions)


def test_a_batch_no_reward_applied_to_is_warned_about_with_what_the_rewards_logged(tmp_path, caplog):
    """Every component None (a judge that graded nothing): every advantage is 0 and the batch trains on nothing;
    the run says so in one line naming what the rewards logged, rather than training on nothing silently."""
    from monorl.generate import SamplingParams
    from monorl.rl.rollouts.rollout import generate_rollouts

    tok = CharTokenizer()
    task = _task(tmp_path, reward=[grades_nothing])
    prompts = list(islice(task.train_prompts(0), 2))
    with caplog.at_level("WARNING", logger="monorl"):
        groups = generate_rollouts(_tiny_generator(tok), tok, task, prompts, SamplingParams(max_new_tokens=4, seed=1),
                                   2, 128, context=RewardContext())
    assert not any(r.scorable for g in groups for r in g) and all(r.reward == 0.0 for g in groups for r in g)
    lines = [r.getMessage() for r in caplog.records if "no reward component applied" in r.getMessage()]
    assert lines == [f"task {task.name!r}: no reward component applied to any of the 4 completions (each returned "
                     "None; the rewards logged mine/parse_failures 4): every advantage is 0, nothing of this batch "
                     "trains"]


def test_a_completion_column_is_what_the_warm_start_trains_on(tmp_path, capsys):
    """TRL's prompt-completion rows: `completion` (a string, or assistant messages) is the warm start's reference
    solution; without that column the warm start is skipped, saying so."""
    from monorl.cli import main

    for form in (str, lambda c: [{"role": "assistant", "content": c}]):
        task = _task(tmp_path, rows=[{"prompt": f"say {i}", "completion": form(str(i))} for i in range(8)],
                     reward="tests/test_dataset_task.py:_digits")
        assert task.has_solutions
        assert sorted(task.solution(p) for p in islice(task.train_prompts(), 8)) == [str(i) for i in range(8)]
    assert not _task(tmp_path, rows=[{"prompt": "say 1", "solution": "1"}], reward="accuracy").has_solutions
    _jsonl(tmp_path / "d.jsonl", [{"prompt": f"say {i}", "completion": str(i)} for i in range(8)])
    args = ["--device", "cpu", "--steps", "1", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
            "--rollout.max_new_tokens", "4", "--task.name", "dataset", "--task.args.path", str(tmp_path / "d.jsonl"),
            "--task.args.reward", "tests/test_dataset_task.py:_digits", "--warm_start.steps", "2",
            "--warm_start.batch_size", "4", "--validation.num_prompts", "0", "--checkpoint.final", "false",
            "--run_dir", str(tmp_path / "run")]
    assert main(["train", *args]) == 0
    out = capsys.readouterr().out
    assert "warm start 2/2 | loss" in out and "warm start: skipped" not in out


def _digits(completions, **kw):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]
