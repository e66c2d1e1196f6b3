"""Rendering with tools, and the incremental-token property the episode runner relies on:
prompt tokens + the model's sampled tokens + delta tokens == encode(render(whole conversation)), checked after
every inserted delta, for the plain and ChatML fallbacks and for Qwen3's released template (read from TRL's
installed copy; the real Qwen3 tokenizer from ../shared when it is there)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from monorl.agent.calls import format_tool_call
from monorl.agent.render import ChatRenderer, RenderError, template_renders_tools
from monorl.agent.schema import function_schema
from monorl.model.tokenizer import CharTokenizer, HFTokenizer

SHARED_TOKENIZER = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "qwen3-tokenizer"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


TOOLS = [function_schema(add)]
PROMPT = [{"role": "system", "content": "You are a careful assistant."}, {"role": "user", "content": "What is 2+3?"}]
# (what the model writes in a turn, the messages the environment answers with)
TURNS = [
    ("Let me add.\n" + format_tool_call("add", {"a": 2, "b": 3}) + "\n" + format_tool_call("add", {"a": 3, "b": 2}),
     [{"role": "tool", "name": "add", "content": "5"}, {"role": "tool", "name": "add", "content": "5"}]),
    ("The answer is 5.", [{"role": "user", "content": "Are you sure? Check once more."}]),
    ("Checking. " + format_tool_call("add", {"a": 2, "b": 3}), [{"role": "tool", "name": "add", "content": "5"}]),
]
THINKING_TURNS = [("<think>\nI should call the tool.\n</think>\n\n" + text, new) for text, new in TURNS]


def trl_template(name: str) -> str:
    trl = pytest.importorskip("trl")
    path = Path(trl.__file__).parent / "chat_templates" / name
    if not path.is_file():
        pytest.skip(f"this TRL has no {name}")
    return path.read_text()


def char_tokenizer(template: str | None = None) -> CharTokenizer:
    tok = CharTokenizer()
    tok.chat_template = template
    return tok


def check_token_in_token_out(renderer: ChatRenderer, turns: list, closed: bool = True,
                             last_equal: bool = True) -> tuple[list[int], list[int]]:
    """Simulate an episode token by token and compare with whole-conversation encodings after each delta.
    Returns the last (episode ids, whole-render ids) pair."""
    tok = renderer.tokenizer
    messages = list(PROMPT)
    ids = tok.encode(renderer.render(messages, tools=TOOLS))
    full: list[int] = []
    for i, (text, new) in enumerate(turns):
        ids += tok.encode(text + renderer.end_of_turn if closed else text)  # what the model sampled
        ids += renderer.delta_ids(new, tools=TOOLS, closed=closed)  # what the runner inserts
        messages += [{"role": "assistant", "content": text}, *new]
        full = tok.encode(renderer.render(messages, tools=TOOLS))
        if i < len(turns) - 1 or last_equal:
            assert ids == full, f"turn {i}: episode tokens differ from the whole conversation's"
    return ids, full


@pytest.mark.parametrize("closed", [True, False])
def test_plain_fallback(closed):
    renderer = ChatRenderer(CharTokenizer())
    assert renderer.style == "plain" and renderer.end_of_turn == "<eos>"
    check_token_in_token_out(renderer, TURNS, closed=closed)
    text = renderer.render(PROMPT + [{"role": "assistant", "content": "hi"}, TURNS[0][1][0]], tools=TOOLS)
    assert text.startswith("System: You are a careful assistant.\n<tools>\n{")
    assert text.endswith("Assistant: hi<eos>\nTool: 5\nAssistant: ")
    assert renderer.delta([{"role": "tool", "name": "f", "content": "7"}]) == "\nTool: 7\nAssistant: "


def test_plain_fallback_starts_with_bos_when_the_tokenizer_adds_it():
    """A base model's episode (no chat template) starts with BOS as its one-turn prompts do (`Task.render`), once:
    the turns' deltas stay token in / token out."""
    tok = CharTokenizer()
    tok.add_bos_token = True
    renderer = ChatRenderer(tok)
    text = renderer.render(PROMPT, tools=TOOLS)
    assert text.startswith("<bos>System: ") and tok.encode(text)[0] == tok.bos_token_id
    ids, _ = check_token_in_token_out(renderer, TURNS)
    assert ids.count(tok.bos_token_id) == 1
    assert "<bos>" not in renderer.delta([{"role": "tool", "name": "f", "content": "7"}])


@pytest.mark.parametrize("closed", [True, False])
def test_chatml_fallback(closed):
    renderer = ChatRenderer(CharTokenizer(), style="chatml")
    check_token_in_token_out(renderer, TURNS, closed=closed)
    delta = renderer.delta([{"role": "tool", "name": "add", "content": "5"}], closed=closed)
    assert delta == ("<|im_end|>" if not closed else "") + \
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    text = renderer.render(PROMPT, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nYou are a careful assistant.\n\n# Tools") and '"name": "add"' in text


def test_chatml_fallback_renders_structured_tool_calls_like_qwen3():
    """An assistant message with OpenAI-style tool_calls (not text) renders as Qwen3's template renders it."""
    qwen3 = ChatRenderer(char_tokenizer(trl_template("qwen3.jinja")))
    ours = ChatRenderer(CharTokenizer(), style="chatml")
    messages = [{"role": "user", "content": "Add 2 and 3."},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                {"role": "tool", "name": "add", "content": "5"}]
    assert ours.render(messages) == qwen3.render(messages)


def test_qwen3_template_tool_turns_are_exact():
    renderer = ChatRenderer(char_tokenizer(trl_template("qwen3.jinja")))
    assert renderer.style == "template" and renderer.end_of_turn == "<|im_end|>"
    tool_only = [THINKING_TURNS[0], THINKING_TURNS[2]]
    check_token_in_token_out(renderer, tool_only)
    check_token_in_token_out(renderer, tool_only, closed=False)


def test_qwen3_template_drops_earlier_thinking_after_a_user_message():
    """Documented limit: after a user-role environment message, Qwen3's released template re-renders earlier
    assistant turns without their <think> block; the episode keeps what the model saw. TRL's prefix-preserving
    training template renders history as the model saw it, so there the property is exact."""
    renderer = ChatRenderer(char_tokenizer(trl_template("qwen3.jinja")))
    ids, full = check_token_in_token_out(renderer, THINKING_TURNS[:2], last_equal=False)
    decode = renderer.tokenizer.decode
    assert ids != full
    strip = re.compile(r"<think>\n.*?\n</think>\n\n", re.DOTALL)
    assert strip.sub("", decode(ids)) == strip.sub("", decode(full))
    training = ChatRenderer(char_tokenizer(trl_template("qwen3_training.jinja")))
    check_token_in_token_out(training, THINKING_TURNS)


def test_qwen3_template_without_thinking_keeps_the_empty_think_block_in_the_delta():
    renderer = ChatRenderer(char_tokenizer(trl_template("qwen3.jinja")), template_kwargs={"enable_thinking": False})
    delta = renderer.delta([{"role": "tool", "name": "add", "content": "5"}])
    assert delta.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.skipif(not SHARED_TOKENIZER.is_dir(), reason="no ../shared Qwen3 tokenizer")
@pytest.mark.parametrize("template", [None, "qwen3.jinja"])
def test_real_qwen3_tokenizer(template):
    tok = HFTokenizer.from_dir(SHARED_TOKENIZER)
    assert not template_renders_tools(tok)  # the shared tokenizer's template is plain ChatML
    if template is not None:
        tok.chat_template = trl_template(template)
    renderer = ChatRenderer(tok)
    assert renderer.style == ("chatml" if template is None else "template")
    turns = TURNS if template is None else [THINKING_TURNS[0], THINKING_TURNS[2]]
    check_token_in_token_out(renderer, turns)
    delta = renderer.delta_ids([{"role": "tool", "name": "add", "content": "5"}])
    assert tok.token_to_id("<tool_response>") in delta and tok.token_to_id("<|im_start|>") in delta


def test_bad_input_is_one_line():
    renderer = ChatRenderer(CharTokenizer())
    with pytest.raises(RenderError, match="at least one new message"):
        renderer.delta([])
    with pytest.raises(RenderError, match="assistant text is what the model samples"):
        renderer.delta([{"role": "assistant", "content": "x"}])
    with pytest.raises(RenderError, match="message 0 must be a dict"):
        renderer.render([{"role": "user"}])
    with pytest.raises(RenderError, match="unknown render style"):
        ChatRenderer(CharTokenizer(), style="xml")
    with pytest.raises(RenderError, match="needs a tokenizer with a chat template"):
        ChatRenderer(CharTokenizer(), style="template")


@pytest.mark.skipif(not SHARED_TOKENIZER.is_dir(), reason="no ../shared Qwen3 tokenizer")
def test_template_rendering_equals_transformers():
    """Our render (schemas from our converter) == transformers' apply_chat_template given the function itself."""
    transformers = pytest.importorskip("transformers")
    template = trl_template("qwen3.jinja")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(SHARED_TOKENIZER))
    ours = HFTokenizer.from_dir(SHARED_TOKENIZER)
    ours.chat_template = template
    messages = PROMPT + [{"role": "assistant", "content": THINKING_TURNS[0][0]}, *THINKING_TURNS[0][1]]
    expected = hf.apply_chat_template(messages, tools=[add], chat_template=template, tokenize=False,
                                      add_generation_prompt=True)
    assert ChatRenderer(ours).render(messages, tools=TOOLS) == expected
