"""GPT-OSS's Harmony chat format (`monorl.agent.harmony`, `monorl.tasks.harmony`) against hand-written strings of
OpenAI's Harmony spec (openai-harmony needs its vocabulary from the network, so it cannot be the oracle here):
rendering system / developer / user / assistant messages with the analysis and final channels and tool calls, reading
a completion's final channel and tool calls, and the text inserted after a sampled turn (token in / token out)."""

from __future__ import annotations

from monorl.agent.calls import parse_tool_calls
from monorl.agent.harmony import harmony_delta, render_harmony
from monorl.agent.render import ChatRenderer
from monorl.model.tokenizer import CharTokenizer
from monorl.tasks.completions import completion_text
from monorl.tasks.harmony import final_text, parse_harmony

WEATHER = {"type": "function", "function": {
    "name": "get_current_weather", "description": "Gets the current weather in the provided location.",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
        "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}},
        "required": ["location"]}}}
LOCATION = {"type": "function", "function": {"name": "get_location", "description": "Gets the location of the user.",
                                              "parameters": {"type": "object", "properties": {}}}}

SPEC_HEADER = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
    "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
    "<|start|>developer<|message|># Instructions\n\nAlways respond in riddles\n\n"
    "# Tools\n\n## functions\n\nnamespace functions {\n\n"
    "// Gets the current weather in the provided location.\n"
    "type get_current_weather = (_: {\n"
    "// The city and state, e.g. San Francisco, CA\n"
    "location: string,\n"
    'format?: "celsius" | "fahrenheit", // default: celsius\n'
    "}) => any;\n\n"
    "// Gets the location of the user.\n"
    "type get_location = () => any;\n\n"
    "} // namespace functions<|end|>")
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_current_weather <|constrain|>json'
        '<|message|>{"location": "San Francisco"}<|call|>')
RESULT = ('<|start|>functions.get_current_weather to=assistant<|channel|>commentary'
          '<|message|>{"sunny": true, "temperature": 20}<|end|>')


def conversation():
    return [{"role": "system", "content": "Always respond in riddles"},
            {"role": "user", "content": "What is the weather like in SF?"},
            {"role": "assistant", "content": "", "thinking": "Need to use function get_current_weather.",
             "tool_calls": [{"type": "function", "function": {"name": "get_current_weather",
                                                              "arguments": {"location": "San Francisco"}}}]},
            {"role": "tool", "name": "get_current_weather", "content": '{"sunny": true, "temperature": 20}'},
            {"role": "assistant", "content": "It is sunny and 20 degrees."}]


def test_render_matches_the_spec():
    text = render_harmony(conversation(), tools=[WEATHER, LOCATION])
    assert text == (SPEC_HEADER + "<|start|>user<|message|>What is the weather like in SF?<|end|>"
                    "<|start|>assistant<|channel|>analysis<|message|>Need to use function get_current_weather.<|end|>"
                    + CALL + RESULT +
                    "<|start|>assistant<|channel|>final<|message|>It is sunny and 20 degrees.<|end|>"
                    "<|start|>assistant")


def test_no_tools_no_developer_message():
    text = render_harmony([{"role": "user", "content": "2+2?"}])
    assert text == ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
                    "Knowledge cutoff: 2024-06\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. "
                    "Channel must be included for every message.<|end|>"
                    "<|start|>user<|message|>2+2?<|end|><|start|>assistant")


def test_completion_parses_to_final_text_and_tool_calls():
    answer = ("<|channel|>analysis<|message|>User asks 2+2. Simple.<|end|>"
              "<|start|>assistant<|channel|>final<|message|>The answer is 4.<|return|>")
    assert final_text(answer) == "The answer is 4." == completion_text(answer)
    assert completion_text([{"role": "assistant", "content": answer}]) == "The answer is 4."
    assert parse_tool_calls(answer) == []
    call = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.get_current_weather <|constrain|>json<|message|>{"location": "San Francisco"}')
    (c,) = parse_tool_calls(call)  # (the engine cut the stop token <|call|>)
    assert (c.name, c.arguments, c.error) == ("get_current_weather", {"location": "San Francisco"}, None)
    assert final_text(call) == "" and [m.channel for m in parse_harmony(call)] == ["analysis", "commentary"]
    (bad,) = parse_tool_calls(call[:-3])
    assert bad.error is not None and "JSON" in bad.error
    # the recipient in the role header (the spec's other form) is a call too
    (c2,) = parse_tool_calls('<|start|>assistant to=functions.get_location<|channel|>commentary json<|message|>{}')
    assert c2.name == "get_location" and c2.arguments == {}


def test_sampled_turns_and_deltas_rebuild_the_conversation():
    """prefix + sampled text + delta == the whole conversation rendered with the sampled text as the assistant's."""
    r = ChatRenderer(CharTokenizer(), style="harmony")
    first = conversation()[:2]
    sampled = ("<|channel|>analysis<|message|>Need to use function get_current_weather.<|end|>"
               '<|start|>assistant<|channel|>commentary to=functions.get_current_weather <|constrain|>json'
               '<|message|>{"location": "San Francisco"}<|call|>')
    result = [{"role": "tool", "name": "get_current_weather", "content": '{"sunny": true, "temperature": 20}'}]
    text = r.render(first, tools=[WEATHER, LOCATION]) + sampled + r.delta(result, tools=[WEATHER, LOCATION])
    whole = render_harmony([*first, {"role": "assistant", "content": sampled}, *result], tools=[WEATHER, LOCATION])
    assert text == whole
    assert whole.endswith(CALL + RESULT + "<|start|>assistant")
    assert r.end_of_turn == "<|return|>"
    assert r.closes_turn(r.tokenizer.encode(sampled)) and not r.closes_turn(r.tokenizer.encode(sampled[:-8]))
    # a turn cut by the token budget is closed with <|end|> before the inserted messages
    assert harmony_delta(result, closed=False).startswith("<|end|><|start|>functions.get_current_weather")
