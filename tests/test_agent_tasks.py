"""The built-in agent tasks, played by scripted "models": tiny_tools (reward needs the tool), guess_number
(rewards solving in few turns), gsm8k_python (the sandboxed python tool, math-verify grading)."""

from __future__ import annotations

import json

import pytest

from monorl.agent import ChatRenderer, format_tool_call, safe_score_episode
from monorl.agent.envs import AGENT_TASKS, Gsm8kPythonTask, GuessNumberTask, TinyToolsTask
from monorl.agent.envs.guess_number import parse_guess
from monorl.agent.episode import play_episode
from monorl.agent.task import AgentTask
from monorl.model.tokenizer import CharTokenizer
from monorl.task_registry import load_task


def play(task: AgentTask, prompt, turns) -> tuple:
    """Run an episode with scripted assistant turns (a callable gets the last environment messages)."""
    env = task.make_env(prompt)
    first = env.start(prompt)
    new = first.messages
    for turn in turns:
        text = turn(new) if callable(turn) else turn
        result = env.respond(text)
        new = result.messages
        if result.done:
            break
    env.finish()
    return env, safe_score_episode(task, prompt, env)


def test_tiny_tools_reward_needs_the_tool():
    task = TinyToolsTask()
    prompt = task.val_prompts(1)[0]
    a, b, x = prompt.meta["a"], prompt.meta["b"], prompt.meta["x"]
    assert prompt.text == f"f({x})=?" and prompt.answer == a * x + b
    good = [format_tool_call("f", {"x": x}, compact=True), lambda new: new[0]["content"]]
    env, (score, err) = play(task, prompt, good)
    assert err is None and score == {"correctness": 1.0, "tool": 0.2} and env.record.tool_calls == {"f": 1}
    # the right number without calling f, f called with another x, a wrong answer after the call
    for turns, tool in (([str(prompt.answer)], 0.0),
                        ([format_tool_call("f", {"x": (x + 1) % 10}, compact=True), str(prompt.answer)], 0.2),
                        ([format_tool_call("f", {"x": x}, compact=True), str(prompt.answer + 1)], 0.2)):
        assert play(task, prompt, turns)[1] == ({"correctness": 0.0, "tool": tool}, None)
    assert [m["role"] for m in task.solution_messages(prompt)] == ["assistant", "tool", "assistant"]


def test_tiny_tools_episode_fits_a_short_context():
    task = TinyToolsTask()
    renderer = ChatRenderer(CharTokenizer())
    prompt = max(task.val_prompts(64), key=lambda p: len(str(p.answer)))
    env = task.make_env(prompt)
    first = env.start(prompt)
    text = renderer.render(first.messages, tools=task.tool_schemas(env))
    for m in task.solution_messages(prompt):
        if m["role"] == "assistant":
            text += m["content"] + renderer.end_of_turn
        else:
            text += renderer.delta([m])
    assert text.startswith(f"User: f({prompt.meta['x']})=?\nAssistant: <tool_call>")
    assert len(CharTokenizer().encode(text)) <= 128


def test_tiny_tools_streams():
    task = TinyToolsTask()
    train = [p for _, p in zip(range(200), task.train_prompts(seed=1), strict=False)]
    val = {(p.meta["a"], p.meta["b"], p.meta["x"]) for p in task.val_prompts(64)}
    assert not val & {(p.meta["a"], p.meta["b"], p.meta["x"]) for p in train}
    resumed = next(task.train_prompts(seed=1, start=57))
    assert resumed.meta == train[57].meta


def binary_search(low: int, high: int):
    state = {"low": low, "high": high, "guess": None}

    def turn(new):
        if state["guess"] is not None:
            if new[0]["content"] == "Higher.":
                state["low"] = state["guess"] + 1
            else:
                state["high"] = state["guess"] - 1
        state["guess"] = (state["low"] + state["high"]) // 2
        return f"My guess: {state['guess']}"

    return turn


def test_guess_number_rewards_few_turns():
    task = GuessNumberTask(low=1, high=100, max_turns=8)
    prompt = task.val_prompts(1)[0]
    secret = prompt.answer
    env, (score, err) = play(task, prompt, [str(secret)])
    assert err is None and score == {"solved": 1.0, "efficiency": 0.5}
    search = binary_search(1, 100)
    env, (score, _) = play(task, prompt, [search] * 8)
    turns = env.record.turns
    assert score["solved"] == 1.0 and turns <= 7 and score["efficiency"] == pytest.approx(0.5 * (8 - turns) / 7)
    assert env.env_reward == 1.0
    wrong = 1 if secret != 1 else 2
    env, (score, _) = play(task, prompt, ["no idea", f"<think>maybe {secret}</think> {wrong}"] + [str(wrong)] * 6)
    assert score == {"solved": 0.0, "efficiency": 0.0} and env.record.truncation == "max_turns"
    assert env.messages[2]["content"].startswith("Please answer with one integer")
    assert parse_guess("<think>42</think>I say 17.") == 17 and parse_guess("none") is None


@pytest.fixture()
def gsm8k_file(tmp_path):
    rows = [{"question": "Tom has 3 boxes of 12 pens. How many pens?", "answer": "3 * 12 = 36\n#### 36"},
            {"question": "A shelf holds 1,200 books; 250 are sold. How many remain?", "answer": "#### 950"}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "test.jsonl").write_text(path.read_text())
    return tmp_path


def test_gsm8k_python(gsm8k_file):
    pytest.importorskip("math_verify")
    task = Gsm8kPythonTask(data_dir=gsm8k_file, python_timeout=5.0)
    prompt = task.val_prompts(1)[0]
    assert "python tool" in prompt.text and prompt.text.startswith("Tom has 3 boxes")
    call = format_tool_call("python", {"code": "print(3 * 12)"})
    env, (score, err) = play(task, prompt, [call, lambda new: f"The pens: \\boxed{{{new[0]['content'].strip()}}}"])
    assert err is None and score == {"accuracy": 1.0} and env.messages[-2]["content"] == "36\n"
    assert task.tool_schemas(env)[0]["function"]["name"] == "python"
    assert play(task, prompt, ["\\boxed{35}"])[1] == ({"accuracy": 0.0}, None)
    bad = format_tool_call("python", {"code": "print(1/0)"})
    env, _ = play(task, prompt, [bad, "\\boxed{36}"])
    assert "ZeroDivisionError" in env.messages[-2]["content"]  # the program's traceback is the (failed) call's result
    assert next(task.train_prompts(seed=0)).answer in (36, 950)


def test_agent_tasks_load_by_spec_and_refuse_plain_rewards():
    task = load_task("monorl.agent.envs:TinyToolsTask", max_turns=2)
    assert task.max_turns == 2 and set(AGENT_TASKS) == {"gsm8k_python", "guess_number", "tiny_tools", "agent_dataset"}
    with pytest.raises(TypeError, match="scores whole episodes"):
        task.reward(task.val_prompts(1)[0], "7")


def test_safe_score_episode_guards_a_failing_score():
    class Broken(TinyToolsTask):
        def score_episode(self, prompt, episode):
            return {"correctness": float("nan"), "tool": 0.0}

    task = Broken()
    prompt = task.val_prompts(1)[0]
    _, (score, err) = play(task, prompt, ["7"])
    assert score == {"correctness": 0.0, "tool": 0.0} and "non-finite" in err


def scripted_model(tok, turns):
    """A "model" that samples fixed turns, each closed by the end-of-turn token (eos)."""
    pending = list(turns)

    def sample_turn(context_ids):
        text = pending.pop(0)
        return tok.encode(text(tok.decode(context_ids)) if callable(text) else text) + [tok.eos_token_id]

    return sample_turn


def test_play_episode_token_in_token_out():
    tok = CharTokenizer()
    task = TinyToolsTask()
    renderer = ChatRenderer(tok)
    prompt = task.val_prompts(1)[0]
    call = format_tool_call("f", {"x": prompt.meta["x"]}, compact=True)
    answer = lambda context: context.rsplit("Tool: ", 1)[1].split("\n")[0]  # noqa: E731 -- reads the tool's reply
    traj, env = play_episode(task, prompt, renderer, scripted_model(tok, [call, answer]), max_new_tokens=100)
    assert safe_score_episode(task, prompt, env) == ({"correctness": 1.0, "tool": 0.2}, None)
    whole = renderer.render(env.messages[:-1], tools=None) + env.messages[-1]["content"] + "<eos>"
    assert traj.ids == tok.encode(whole)  # the tokens the model saw are the whole conversation's
    sampled = [t for t, m in zip(traj.completion_ids, traj.mask, strict=True) if m]
    assert tok.decode(sampled) == f"{call}<eos>{prompt.answer}<eos>"
    inserted = [t for t, m in zip(traj.completion_ids, traj.mask, strict=True) if not m]
    assert tok.decode(inserted) == f"\nTool: {prompt.answer}\nAssistant: "
    # a budget too small for the tool's reply ends the episode without it
    traj, env = play_episode(task, prompt, renderer, scripted_model(tok, [call, answer]), max_new_tokens=60)
    assert env.record.truncation == "length" and sum(traj.mask) == len(traj.completion_ids) == len(call) + 1
    # no answer: correctness 0; the call itself was made (the environment ran f), so `tool` pays
    assert safe_score_episode(task, prompt, env)[0] == {"correctness": 0.0, "tool": 0.2}
    # a budget that ends inside the first turn
    traj, env = play_episode(task, prompt, renderer, scripted_model(tok, [call, answer]), max_new_tokens=30)
    assert env.record.truncation == "length" and traj.mask == [1] * 30 and env.record.turns == 0
