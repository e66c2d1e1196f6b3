"""Conversations with tools -> text, and the text to insert after a model's turn (token in / token out).

Three styles, picked once per tokenizer (`ChatRenderer(tokenizer)`, or `style=` to force one):

- ``template``: the tokenizer's chat template, when it renders ``tools=`` and ``tool`` messages (Qwen3's released
  template does, Hermes style). Extra template variables (``enable_thinking=False``) go in `template_kwargs`.
- ``chatml``: our Hermes-style ChatML for ChatML tokenizers whose template has no tool support (a plain ChatML
  template, e.g. the Qwen3 tokenizer under /work/shared): the tools as JSON lines inside ``<tools></tools>`` in the
  system turn, calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the assistant's text,
  results as ``<tool_response>...</tool_response>`` blocks, consecutive ones in one ``user`` turn (Qwen3's layout):

      <|im_start|>system\\n{system}\\n\\n# Tools ... <tools>\\n{schema}\\n</tools> ...<|im_end|>\\n
      <|im_start|>user\\n{question}<|im_end|>\\n
      <|im_start|>assistant\\n{model text with <tool_call>...</tool_call>}<|im_end|>\\n
      <|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response><|im_end|>\\n
      <|im_start|>assistant\\n

- ``plain``: no template at all (the char tokenizer of the ``tiny`` preset): `Task.plain_prompt`'s ``Role: text``
  lines, each assistant turn closed by the end-of-turn token (eos), tools in a ``System:`` line's ``<tools>``
  block, each result a ``Tool: {result}`` line; short, so a tool episode fits the tiny preset's 128 tokens.

`delta(new_messages)` is what the episode runner appends after the tokens the model sampled: the end of its turn
(only if it did not sample the end-of-turn token itself: ``closed=False``), the new tool / user messages, and the
next assistant header. It renders a fixed dummy ``[user, assistant]`` conversation followed by the new messages and
keeps what follows the dummy assistant's text, so the model's own text is never rendered or tokenized again.
``prefix tokens + sampled tokens + encode(delta)`` equals ``encode(render(whole conversation))`` when the
template renders history as the model saw it (the tests check the fallbacks and Qwen3's template). Qwen3's released
template does not: it drops the ``<think>`` block of assistant turns before the last *user* query (and, with
``enable_thinking=False``, the empty block its generation prompt added), so after a user-role environment message
the re-rendered history differs from what the model saw. The trajectory keeps what the model saw (that is what it
was conditioned on); TRL's prefix-preserving training template (``trl/chat_templates/qwen3_training.jinja``) renders
history that way too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from monorl.agent.harmony import TURN_ENDS, harmony_delta, render_harmony
from monorl.tasks.base import plain_text_start
from monorl.tasks.harmony import CALL, CHANNEL, RETURN

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOLS_INSTRUCTIONS = (
    "# Tools\n\nYou can call the functions whose signatures are listed in <tools></tools>:\n<tools>\n{tools}\n"
    "</tools>\n\nTo call a function, write a JSON object with its name and arguments within <tool_call></tool_call>:"
    "\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>\n"
    "Each result comes back within <tool_response></tool_response>.")
STYLES = ("template", "chatml", "plain", "harmony")

_DUMMY_USER, _DUMMY_ASSISTANT = "monorl-dummy-user", "monorl-dummy-assistant"
_PROBE_TOOL, _PROBE_DOC, _PROBE_RESULT = "monorl_probe_tool", "monorl-probe-description", "monorl-probe-result"
_PROBE_SCHEMA = {"type": "function", "function": {"name": _PROBE_TOOL, "description": _PROBE_DOC,
                                                  "parameters": {"type": "object", "properties": {}}}}


class RenderError(ValueError):
    """A conversation or template that cannot be rendered as asked (one line saying why)."""


def template_renders_tools(tokenizer: Any, **template_kwargs: Any) -> bool:
    """Does the tokenizer's chat template render tool schemas and tool results (the Hermes-style contract)?"""
    if not getattr(tokenizer, "has_chat_template", False):
        return False
    probe = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": _PROBE_TOOL, "arguments": {}}}]},
             {"role": "tool", "name": _PROBE_TOOL, "content": _PROBE_RESULT}]
    try:
        text = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tools=[_PROBE_SCHEMA],
                                             **template_kwargs)
    except Exception:  # noqa: BLE001 -- a template that cannot render this has no tool support
        return False
    return isinstance(text, str) and _PROBE_DOC in text and _PROBE_RESULT in text


def _is_harmony(tokenizer: Any) -> bool:
    lookup = getattr(tokenizer, "token_to_id", None)
    return lookup is not None and lookup(CHANNEL) is not None and lookup(CALL) is not None


def _is_chatml(tokenizer: Any) -> bool:
    lookup = getattr(tokenizer, "token_to_id", None)
    if lookup is not None and lookup(IM_START) is not None:
        return True
    return IM_START in (getattr(tokenizer, "chat_template", None) or "")


class ChatRenderer:
    """Renders conversations (lists of ``{"role", "content"}`` messages; ``tool`` messages carry ``name``) for
    one tokenizer; see the module docstring for the styles and what `delta` guarantees."""

    def __init__(self, tokenizer: Any, style: str = "auto", template_kwargs: dict[str, Any] | None = None,
                 end_of_turn: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        if style == "auto" and _is_harmony(tokenizer):
            style = "harmony"  # GPT-OSS: its own renderer (`monorl.agent.harmony`), whatever its template does
        if style == "auto":
            if template_renders_tools(tokenizer, **self.template_kwargs):
                style = "template"
            else:
                style = "chatml" if _is_chatml(tokenizer) else "plain"
        if style not in STYLES:
            raise RenderError(f"unknown render style {style!r}: use auto or one of {', '.join(STYLES)}")
        if style == "template" and not getattr(tokenizer, "has_chat_template", False):
            raise RenderError("render style 'template' needs a tokenizer with a chat template")
        self.style = style
        # the text that closes an assistant turn (what a model samples to stop): ChatML's <|im_end|>, else eos
        eos = (getattr(tokenizer, "special_tokens", {}) or {}).get("eos_token")
        chatml = style == "chatml" or (style == "template" and IM_END in (tokenizer.chat_template or ""))
        self.end_of_turn = end_of_turn or (RETURN if style == "harmony" else IM_END if chatml else eos or IM_END)

    def closes_turn(self, sampled_ids: Sequence[int]) -> bool:
        """Did the model's sampled tokens end its turn with the end-of-turn token(s)? (`delta`'s `closed`: False
        when it stopped at a stop string, another eos id, or the token budget.)"""
        ends = TURN_ENDS if self.style == "harmony" else (self.end_of_turn,)  # Harmony: <|call|> or <|return|>
        for end in ends:
            eot = self.tokenizer.encode(end)
            if len(sampled_ids) >= len(eot) and list(sampled_ids[len(sampled_ids) - len(eot):]) == eot:
                return True
        return False

    def stop_ids(self) -> list[int]:
        """The last token of each text that ends a turn (the engine stops on them): Harmony's <|call|> and
        <|return|>, else end_of_turn's."""
        ends = TURN_ENDS if self.style == "harmony" else (self.end_of_turn,)
        return [ids[-1] for ids in map(self.tokenizer.encode, ends) if ids]

    # -- whole conversations ----------------------------------------------------------------------------
    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True) -> str:
        """The text of a conversation (+ the next assistant header), with `tools` (JSON schemas) offered."""
        messages = list(messages)
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RenderError(f"message {i} must be a dict with string 'role' and 'content', got {str(m)[:80]!r}")
        tools = list(tools) if tools else None
        if self.style == "template":
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                     tools=tools, **self.template_kwargs)
            if not isinstance(out, str):
                raise RenderError(f"apply_chat_template returned {type(out).__name__}, expected str")
            return out
        if self.style == "chatml":
            return _render_chatml(messages, tools, add_generation_prompt)
        if self.style == "harmony":
            return render_harmony(messages, tools, add_generation_prompt)
        # after BOS where plain text starts with it, as `Task.render`'s plain prompts (`delta` keeps only a suffix)
        return plain_text_start(self.tokenizer) + _render_plain(messages, tools, add_generation_prompt,
                                                                self.end_of_turn)

    # -- what to append after a model's turn ------------------------------------------------------------
    def delta(self, new_messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
              closed: bool = True) -> str:
        """The text after a sampled assistant turn: its end (unless `closed`: the model sampled the end-of-turn
        token), `new_messages` (tool results, user / environment messages) and the next assistant header."""
        if not new_messages:
            raise RenderError("delta needs at least one new message (an episode with none has ended)")
        if any(m.get("role") == "assistant" for m in new_messages):
            raise RenderError("delta inserts tool / user / system messages; assistant text is what the model samples")
        if self.style == "harmony":
            return harmony_delta(new_messages, closed)
        dummy = [{"role": "user", "content": _DUMMY_USER}, {"role": "assistant", "content": _DUMMY_ASSISTANT}]
        text = self.render(dummy + list(new_messages), tools=tools, add_generation_prompt=True)
        at = text.rfind(_DUMMY_ASSISTANT)
        if at < 0:
            raise RenderError("the chat template dropped the assistant's text; cannot find where its turn ends")
        tail = text[at + len(_DUMMY_ASSISTANT):]
        if closed:
            if not tail.startswith(self.end_of_turn):
                raise RenderError(f"an assistant turn does not end with {self.end_of_turn!r} in this template "
                                  f"(it ends {tail[:40]!r}); pass closed=False")
            tail = tail[len(self.end_of_turn):]
        return tail

    def delta_ids(self, new_messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                  closed: bool = True) -> list[int]:
        """`delta` as token ids (special-token text becomes its ids, as in a whole-conversation encode)."""
        return list(self.tokenizer.encode(self.delta(new_messages, tools=tools, closed=closed)))


def tools_block(tools: Sequence[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


def _render_chatml(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, gen: bool) -> str:
    out = []
    rest = messages
    if tools:
        system = messages[0]["content"] + "\n\n" if messages and messages[0]["role"] == "system" else ""
        out.append(f"{IM_START}system\n{system}{TOOLS_INSTRUCTIONS.format(tools=tools_block(tools))}{IM_END}\n")
        rest = messages[1:] if system else messages
    for i, m in enumerate(rest):
        role, content = m["role"], m["content"]
        if role == "tool":
            if i == 0 or rest[i - 1]["role"] != "tool":
                out.append(f"{IM_START}user")
            out.append(f"\n<tool_response>\n{content}\n</tool_response>")
            if i == len(rest) - 1 or rest[i + 1]["role"] != "tool":
                out.append(f"{IM_END}\n")
        elif role == "assistant":
            out.append(f"{IM_START}assistant\n{content}{_calls_text(m, content)}{IM_END}\n")
        else:
            out.append(f"{IM_START}{role}\n{content}{IM_END}\n")
    if gen:
        out.append(f"{IM_START}assistant\n")
    return "".join(out)


def _calls_text(message: dict[str, Any], content: str) -> str:
    """Structured ``tool_calls`` of an assistant message (OpenAI / HF shape) as Hermes text, as Qwen3 renders them.
    monorl's own episodes keep the calls in the model's text instead."""
    parts = []
    for j, call in enumerate(message.get("tool_calls") or []):
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        sep = "\n" if (j == 0 and content) or j > 0 else ""
        parts.append(f'{sep}<tool_call>\n{{"name": "{fn["name"]}", "arguments": {args_text}}}\n</tool_call>')
    return "".join(parts)


def _render_plain(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, gen: bool, eot: str) -> str:
    out = []
    rest = messages
    if tools:
        system = messages[0]["content"] + "\n" if messages and messages[0]["role"] == "system" else ""
        out.append(f"System: {system}<tools>\n{tools_block(tools)}\n</tools>\n")
        rest = messages[1:] if system else messages
    for m in rest:
        role, content = m["role"], m["content"]
        if role == "assistant":
            out.append(f"Assistant: {content}{_calls_text(m, content)}{eot}\n")
        elif role == "tool":
            out.append(f"Tool: {content}\n")
        else:
            out.append(f"{role.capitalize()}: {content}\n")
    if gen:
        out.append("Assistant: ")
    return "".join(out)
