"""The arith task (held-out split, rewards, prompts), its presets, and the TRL settings bench_vs_trl.py derives."""

import importlib.util
import itertools
import os
from pathlib import Path

import pytest

from monorl.presets import preset
from monorl.run.grpo import GRPORun
from monorl.task_registry import load_task
from monorl.tasks import ArithTask
from monorl.tasks.arith import EXAMPLES


def _key(p):
    return p.meta["op"], p.meta["a"], p.meta["b"]


def test_held_out_split_is_fixed_distinct_and_never_trained_on():
    task = load_task("arith")
    val = task.val_prompts(200)
    assert len({_key(p) for p in val}) == 200 and {p.meta["op"] for p in val} == {"+", "*"}
    assert [_key(p) for p in val] == [_key(p) for p in ArithTask().val_prompts(200)]  # no seed involved
    train = list(itertools.islice(task.train_prompts(seed=0), 20000))
    held_out = {_key(p) for p in val} | set(EXAMPLES[:task.shots])
    assert not held_out & {_key(p) for p in train}
    assert [p.meta["index"] for p in train[:3]] == [0, 1, 2]
    resumed = next(task.train_prompts(seed=0, start=7))
    assert _key(resumed) == _key(train[7]) and resumed.meta["index"] == 7
    for p in val + train[:500]:
        a, b = p.meta["a"], p.meta["b"]
        assert 10 <= a <= 99 and (10 <= b <= 99 if p.meta["op"] == "+" else 1 <= b <= 9)
        assert p.answer == (a + b if p.meta["op"] == "+" else a * b)


def test_prompt_is_a_one_shot_chat_by_default():
    p = ArithTask().val_prompts(1)[0]
    assert p.meta["messages"] == [{"role": "user", "content": "What is 12 + 34?"},
                                  {"role": "assistant", "content": "Answer: 46"},
                                  {"role": "user", "content": f"What is {p.meta['a']} {p.meta['op']} {p.meta['b']}?"}]
    zero_shot = ArithTask(shots=0, ops="*").val_prompts(1)[0]
    assert zero_shot.meta["messages"] == [{"role": "user", "content": f"{zero_shot.text}"}]
    assert zero_shot.text.endswith("? Give only the final answer as: Answer: <number>")
    plain = ArithTask(shots=0, instruction="", ops="+", add_digits=1)
    q = plain.val_prompts(1)[0]
    assert plain.plain_prompt(q) == f"User: What is {q.meta['a']} + {q.meta['b']}?\nAssistant: "
    # a subword tokenizer's words carry their leading space: reply_space=False ends the prompt before it
    few_shot = ArithTask(shots=2, reply_space=False)
    r = few_shot.val_prompts(1)[0]
    assert few_shot.plain_prompt(r) == ("User: What is 12 + 34?\nAssistant: Answer: 46\nUser: What is 23 * 4?\n"
                                        f"Assistant: Answer: 92\nUser: {r.text}\nAssistant:")


@pytest.mark.parametrize(("completion", "expected"), [
    ("Answer: 42", (1.0, 0.2)),
    (" Answer: 42.\n", (1.0, 0.2)),
    ("Answer: 41", (0.0, 0.2)),  # well formatted, wrong
    ("40 + 2 = 42. Answer: 42", (1.0, 0.0)),  # right, but more than the answer line
    ("Answer: 41 Answer: 42", (0.0, 0.0)),  # the first answer counts: hedging does not pay
    ("42", (0.0, 0.0)),  # no answer tag
    ("", (0.0, 0.0)),
])
def test_rewards(completion, expected):
    task = ArithTask()
    prompt = task._prompt(("+", 40, 2))
    r = task.reward(prompt, completion)
    assert (r["correctness"], r["format"]) == expected


def test_solutions_and_bad_arguments():
    task = ArithTask(solution_style="mixed")
    even, odd = itertools.islice(task.train_prompts(seed=1), 2)
    assert task.solution(even) == f"Answer: {even.answer}" and task.solution(odd) == str(odd.answer)
    assert task.reward(even, task.solution(even)) == {"correctness": 1.0, "format": 0.2}
    for kwargs, message in [({"ops": "-"}, "ops must be"), ({"add_digits": 0}, "add_digits"),
                            ({"shots": 3}, "shots"), ({"ops": "+", "add_digits": 1, "val_size": 50}, "val_size"),
                            ({"solution_style": "steps"}, "solution_style")]:
        with pytest.raises(ValueError, match=message):
            ArithTask(**kwargs)
    with pytest.raises(ValueError, match="val_size=200"):
        ArithTask().val_prompts(201)


def test_smollm2_preset_settings():
    cfg = preset("smollm2_135m_arith")
    assert cfg.task.name == "arith" and cfg.validation.num_prompts == 200 and cfg.validation.k == 1
    assert cfg.rollout.group_size == 8 and cfg.trainer.loss.kl_coef == 0.0 and cfg.batch_invariant == "auto"
    assert load_task(cfg.task.name, **cfg.task.args).val_size >= cfg.validation.num_prompts


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_vs_trl", Path(__file__).resolve().parents[1] / "benchmarks" / "bench_vs_trl.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_trl_settings_match_the_preset():
    pytest.importorskip("trl")
    bench = _bench()
    cfg = preset("smollm2_135m_arith")
    trl = bench.trl_config(cfg, load_task(cfg.task.name, **cfg.task.args), "/tmp/unused", cuda=False)
    ro, tr = cfg.rollout, cfg.trainer
    assert trl.per_device_train_batch_size == ro.prompts_per_step * ro.group_size
    assert trl.num_generations == ro.group_size and trl.gradient_accumulation_steps == 1
    assert (trl.learning_rate, trl.temperature, trl.top_p, trl.max_completion_length, trl.max_steps) == (
        tr.lr, ro.temperature, ro.top_p, ro.max_new_tokens, cfg.steps)
    assert (trl.loss_type, trl.epsilon, trl.epsilon_high, trl.beta) == ("dapo", 0.2, 0.28, 0.0)
    assert trl.shuffle_dataset is False and trl.reward_weights == [1.0, 1.0]
    assert bench.wilson(0, 10)[0] == 0.0 and bench.wilson(10, 10)[1] == pytest.approx(1.0)
    lo, hi = bench.wilson(50, 200)  # 0.25 of 200: the interval a reader checks against a table
    assert lo == pytest.approx(0.1951, abs=1e-4) and hi == pytest.approx(0.3143, abs=1e-4)
    reward = bench.trl_reward_funcs(ArithTask())
    assert [f.__name__ for f in reward] == ["correctness", "format"]
    completions = [[{"role": "assistant", "content": "Answer: 7"}], [{"role": "assistant", "content": "7"}]]
    assert reward[0](completions, answer=[7, 7]) == [1.0, 0.0] and reward[1](completions, answer=[7, 7]) == [0.2, 0.0]


GEMMA3 = Path(os.environ.get("MONORL_GEMMA3_GGUF", "/work/models/gemma3/gemma-3-270m-q4_k_m.gguf"))


@pytest.mark.slow  # ~1 min: two tokenizers of a 262k vocabulary
@pytest.mark.skipif(not GEMMA3.is_file(), reason=f"no Gemma 3 GGUF at {GEMMA3} (set MONORL_GEMMA3_GGUF)")
def test_trl_gets_the_base_model_prompts_monorl_feeds():
    """gemma3_270m_arith (no chat template): TRL's dataset gets plain text without the BOS text, which transformers'
    tokenizer adds, so both sides feed the same ids; a monorl tokenizer that would not write BOS is refused."""
    transformers = pytest.importorskip("transformers")
    from monorl.model.hf_checkpoint import load_tokenizer

    bench = _bench()
    cfg = preset("gemma3_270m_arith")
    task = load_task(cfg.task.name, **cfg.task.args)
    theirs = transformers.AutoTokenizer.from_pretrained(GEMMA3.parent, gguf_file=GEMMA3.name)
    ours = load_tokenizer(GEMMA3)
    prompts = task.val_prompts(3) + list(itertools.islice(task.train_prompts(seed=cfg.seed), 3))
    rows, ids = bench.trl_prompts(task, prompts, theirs, ours)
    assert rows == [task.plain_prompt(p) for p in prompts] and rows[0].endswith("\nAssistant:")
    assert all(x[0] == ours.bos_token_id and x.count(ours.bos_token_id) == 1 for x in ids)
    ours.add_bos_token = False
    with pytest.raises(SystemExit, match="other tokens"):
        bench.trl_prompts(task, prompts, theirs, ours)


@pytest.mark.slow  # ~30 s on 2 idle cores; minutes on a shared box
def test_tiny_arith_reward_rises(tmp_path):
    """The CI-sized preset as shipped, seeded: GRPO raises the training reward (the last 4 steps' mean over the
    first 2 steps'), by moving the warm-started model to the rewarded answer format within a few steps (measured:
    0.45 -> 0.52 here, 0.36 -> 0.50 with seed 1)."""
    cfg = preset("tiny_arith")
    cfg.run_dir, cfg.checkpoint.final = str(tmp_path / "run"), False
    result = GRPORun(cfg, progress=False).run()
    rewards = [row["reward"] for row in result.steps]
    assert len(rewards) == cfg.steps
    assert sum(rewards[-4:]) / 4 > sum(rewards[:2]) / 2 + 0.03, rewards
