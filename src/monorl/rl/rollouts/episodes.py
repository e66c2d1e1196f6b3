"""Multi-turn rollouts: a step's prompts played as episodes of an `AgentTask`, token in / token out.

Every episode runs on the generator's request-level engine (`generate.engine.Engine`): its first turn
decodes from the rendered prompt; when a turn ends (end-of-turn token, a `</tool_call>` close, the turn budget) the
episode pauses holding its KV, its environment answers in a worker thread (`agent.executor.AgentExecutor`: a slow
tool stalls only its own episode, the others keep decoding), and the answer's tokens (`ChatRenderer.delta_ids`:
the tool / environment messages and the next assistant header, never a re-rendering of the model's text) are
appended and prefilled over the cached prefix. The trajectory is the exact token sequence the model saw: sampled
tokens (mask 1, with their log-probs) and inserted ones (mask 0: context only, never trained). The completion
budget (rollout.max_new_tokens) counts inserted tokens too, as TRL's max_completion_length does.

Images (a vision-language policy): a prompt's images go in with its first turn's prefill, and an image a tool or
environment returns (`agent.content`: TRL's content parts) with the inserted tokens of the turn after it: its
placeholder expanded to the image's token count, the tower run on it at that turn's prefill, M-RoPE positions going
on from the conversation's (`vision_prompt.append_images`). The rollout carries the episode's images in order
(`Rollout.images`), so the trainer's pack places each at its placeholders.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from monorl.agent.content import message_images, without_images
from monorl.agent.env import EpisodeEnv, TurnResult
from monorl.agent.executor import AgentExecutor
from monorl.agent.metrics import EpisodeRecord
from monorl.agent.render import ChatRenderer
from monorl.agent.task import AgentTask, safe_score_episodes
from monorl.distributed.world import SINGLE, World
from monorl.generate.engine import Engine
from monorl.generate.generator import Generator
from monorl.generate.requests import ContextOverflowError, TurnEvent
from monorl.generate.sampling import SamplingParams
from monorl.generate.tensor_parallel import gathered_once, generation_world
from monorl.model.image_processing import ImageProcessor
from monorl.model.vision_prompt import ImageInputs, append_images, encode_with_images
from monorl.rl.rollouts.rollout import Rollout, drain_updates
from monorl.tasks.base import Prompt

log = logging.getLogger("monorl")
TOOL_CALL_CLOSE = "</tool_call>"  # a Hermes tool call's close tag ends the turn: the tool runs at once


@dataclass
class _Live:
    """One episode in flight: its prompt, environment, tool schemas and the environment call it waits for."""

    prompt: Prompt
    env: EpisodeEnv
    tools: list[dict[str, Any]] | None
    prompt_len: int
    waiting: cf.Future | None = None
    closed: bool = True  # its last turn ended with the end-of-turn token
    finish_reason: str = "stop"
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per completion token: the policy version that sampled it, or -1
    cut_text: str = ""  # a last turn cut by the budget: its text, which the environment never saw
    images: ImageInputs | None = None  # its images so far (the prompt's, then tools'), laid out over `tokens`
    tool_images: int = 0  # of them, those its tools and environment returned

    def messages(self) -> list[dict[str, Any]]:
        """The conversation after the prompt as messages (TRL's conversational completion), a cut turn included;
        text alone (an image's placeholder marks its place)."""
        cut = [{"role": "assistant", "content": self.cut_text}] if self.cut_text else []
        return [*map(without_images, self.env.completions), *cut]


class EpisodeRunner:
    """Plays episodes of one `AgentTask` on one generator; reused across steps (its engine and threads)."""

    def __init__(self, generator: Generator, tokenizer: Any, task: AgentTask, max_len: int,
                 max_workers: int = 32, max_tool_images: int | None = None) -> None:
        """max_tool_images: the images an episode's tools and environment may return in all (a run's
        `rollout.max_tool_images`, which its memory plan counts); more stop the run. None: no bound."""
        self.gen, self.tokenizer, self.task = generator, tokenizer, task
        self.max_tool_images = max_tool_images
        self.renderer = ChatRenderer(tokenizer)
        self.max_len = max_len
        self.engine: Engine | None = None  # built at first use (it needs the generator's KV cache)
        self.executor = AgentExecutor(max_workers=max_workers)
        eot = tokenizer.encode(self.renderer.end_of_turn)
        self.end_of_turn = tuple(eot)
        close = tokenizer.encode(TOOL_CALL_CLOSE)
        self.stop_sequences = [close] if close and tokenizer.decode(close) == TOOL_CALL_CLOSE else []

    def close(self) -> None:
        self.executor.close(wait=False)

    def play(self, prompts: Sequence[Prompt], sampling: SamplingParams, n: int, first_prompt_index: int = 0,
             between_steps: Callable[[], None] | None = None) -> list[list[tuple[_Live, EpisodeRecord]]]:
        """`n` episodes of each prompt; [prompt][sample] (finished: environment finished, reward readable). Every
        sampled token records the generator's `policy_version`. between_steps: called after each engine step while
        episodes are in flight; it may load new weights into the generator (an in-flight update: the episodes go
        on with them, keeping their KV cache)."""
        if self.engine is None:
            self.engine = Engine(self.gen, max_tokens=self.max_len)
        engine, budget = self.engine, sampling.max_new_tokens
        stop_ids = tuple(dict.fromkeys((*sampling.stop_token_ids, *self.renderer.stop_ids())))
        live: dict[tuple[int, int], _Live] = {}
        for i, p in enumerate(prompts):
            for j in range(n):
                env = self.task.make_env(p)
                key = (first_prompt_index + i, j)
                live[key] = _Live(p, env, None, 0)
                live[key].waiting = self.executor.submit(env.start, p)
        order = list(live)
        while any(not lv.env.done or lv.waiting is not None for lv in live.values()) or engine.has_work():
            for key, lv in live.items():  # environment answers that arrived
                if lv.waiting is not None and lv.waiting.done():
                    turn, lv.waiting = lv.waiting.result(), None
                    self._answer(key, lv, turn, sampling, stop_ids, budget)
            if engine.has_work():
                for ev in engine.step():
                    self._turn_ended(live[ev.request_id], ev, budget)
                if between_steps is not None:
                    between_steps()
            else:
                waiting = [lv.waiting for lv in live.values() if lv.waiting is not None]
                if waiting:
                    self.executor.wait_any(waiting, timeout=1.0)
                elif not engine.has_work():
                    break
        out = []
        for i in range(len(prompts)):
            out.append([(live[k], live[k].env.record) for k in order if k[0] == first_prompt_index + i])
        return out

    def _answer(self, key: tuple[int, int], lv: _Live, turn: TurnResult, sampling: SamplingParams,
                stop_ids: tuple[int, ...], budget: int) -> None:
        """The environment answered (its first observation, or a turn's tool results / messages)."""
        engine = self.engine
        assert engine is not None
        if turn.done:  # the environment ended the episode (or failed)
            self._finish(key, lv)
            return
        if not lv.tokens:  # the first observation: the episode's prompt
            lv.tools = self.task.tool_schemas(lv.env)
            lv.tokens = list(self.tokenizer.encode(self.renderer.render(turn.messages, tools=lv.tools)))
            if lv.prompt.meta.get("images"):
                vision, processor = self._vision("a prompt holds images")
                lv.tokens, lv.images = encode_with_images(lv.tokens, lv.prompt.meta["images"], vision, processor)
            lv.prompt_len = len(lv.tokens)
            sp = _turn_sampling(sampling, budget, stop_ids)
            try:  # (an episode with images is its own prompt group: its ImageInputs are its own)
                engine.add(key, lv.tokens, sp, stop_sequences=self.stop_sequences, images=lv.images,
                           group=key if lv.images is not None else None)
            except ContextOverflowError as e:
                log.warning("%s: cut (raise generator.max_model_len)", e)  # e names the episode
                self._cut(key, lv, "context")
            return
        inserted = self.renderer.delta_ids(turn.messages, tools=lv.tools, closed=lv.closed)
        images, new_images = message_images(turn.messages), None
        if images:
            vision, processor = self._vision("a tool or environment returned an image")
            lv.tool_images += len(images)
            if self.max_tool_images is not None and lv.tool_images > self.max_tool_images:
                raise ValueError(f"episode {key}: its tools and environment returned {lv.tool_images} images, more "
                                 f"than rollout.max_tool_images={self.max_tool_images} (what the memory plan "
                                 "counts): raise it")
            inserted, new_images = append_images(lv.images, len(lv.tokens), inserted, images, vision, processor)
        left = budget - (len(lv.tokens) - lv.prompt_len) - len(inserted)
        if left <= 0:  # no room for the answer and another turn (TRL drops a tool result that overflows)
            self._cut(key, lv, "length")
            return
        try:
            engine.resume(key, inserted, sampling=_turn_sampling(sampling, left, stop_ids), images=new_images)
        except ContextOverflowError:
            self._cut(key, lv, "context")
            return
        lv.images = new_images or lv.images
        lv.tokens += inserted
        lv.mask += [0] * len(inserted)
        lv.logprobs += [0.0] * len(inserted)
        lv.versions += [-1] * len(inserted)

    def _vision(self, what: str) -> tuple[Any, ImageProcessor]:
        """The policy's vision config and image processor (the generator's, else the tower's defaults);
        ValueError (one line, saying `what` brought images) for a text-only policy."""
        vision = self.gen.model.config.vision
        if vision is None:
            raise ValueError(f"{what} and the policy has no vision tower: use a vision-language model (e.g. "
                             "Qwen3-VL) or give the model text")
        return vision, self.gen.image_processor or ImageProcessor.for_model(vision)

    def _turn_ended(self, lv: _Live, ev: TurnEvent, budget: int) -> None:
        """A turn's sampled tokens are in: hand the text to the environment, or end the episode at its budget."""
        lv.tokens += ev.token_ids
        lv.mask += [1] * len(ev.token_ids)
        lv.logprobs += ev.logprobs
        lv.versions += ev.versions
        lv.closed = tuple(ev.token_ids[-len(self.end_of_turn):]) == self.end_of_turn
        used = len(lv.tokens) - lv.prompt_len
        text = self.tokenizer.decode(ev.token_ids[: len(ev.token_ids) - (len(self.end_of_turn) if lv.closed else 0)],
                                     skip_special_tokens=True)
        if ev.reason == "context" or (ev.reason == "length" and used >= budget):
            lv.cut_text = text
            self._cut(ev.request_id, lv, "length")  # cut mid-turn: nothing to answer
            return
        lv.waiting = self.executor.submit(lv.env.respond, text)

    def _cut(self, key: tuple[int, int], lv: _Live, why: str) -> None:
        """End an episode that ran out of room (`why`: its budget, "length", or its context, "context")."""
        lv.env.truncate(why)
        lv.finish_reason = "length"
        self._finish(key, lv)

    def _finish(self, key: tuple[int, int], lv: _Live) -> None:
        if self.engine is not None and key in self.engine.requests:
            self.engine.finish(key)
        lv.env.finish()
        if not lv.tokens:  # the environment failed or ended before any turn: an empty episode
            lv.tokens = list(self.tokenizer.encode(self.renderer.render([{"role": "user", "content": ""}])))
            lv.prompt_len = len(lv.tokens)


def solution_sequence(renderer: ChatRenderer, task: AgentTask, prompt: Prompt) -> tuple[list[int], list[int],
                                                                                   list[int]]:
    """A reference episode (`task.solution_messages(prompt)`) as the runner would have built it: (prompt ids,
    completion ids, mask): assistant turns (with their end-of-turn) 1, the inserted tool / environment tokens 0. A
    supervised warm start trains on the assistant turns only."""
    env = task.make_env(prompt)
    first = env.start(prompt)
    tools = task.tool_schemas(env)
    env.finish()
    tok = renderer.tokenizer
    prompt_ids = list(tok.encode(renderer.render(first.messages, tools=tools)))
    ids: list[int] = []
    mask: list[int] = []
    pending: list[dict[str, Any]] = []
    for m in task.solution_messages(prompt):
        if m["role"] != "assistant":
            pending.append(m)
            continue
        if pending:
            if message_images(pending):
                raise ValueError("a reference solution's tool / environment message holds images, which the warm "
                                 "start does not feed: give its results as text")
            inserted = renderer.delta_ids(pending, tools=tools, closed=True)
            ids, mask, pending = ids + inserted, mask + [0] * len(inserted), []
        turn = list(tok.encode(m["content"] + renderer.end_of_turn))
        ids, mask = ids + turn, mask + [1] * len(turn)
    return prompt_ids, ids, mask


def _turn_sampling(sampling: SamplingParams, max_new: int, stop_ids: tuple[int, ...]) -> SamplingParams:
    return dataclasses.replace(sampling, max_new_tokens=max(1, max_new), stop_token_ids=stop_ids)


def generate_episodes(runner: EpisodeRunner, prompts: Sequence[Prompt], sampling: SamplingParams, n: int,
                      world: World = SINGLE, between_steps: Callable[[], None] | None = None,
                      ) -> tuple[list[list[Rollout]], list[EpisodeRecord]]:
    """[prompt][sample] rollouts of `n` episodes per prompt, scored, with their episode records. On several ranks
    each plays its contiguous share of the prompt groups (keyed by the group's index in the whole batch) and every
    rank gets all groups back, as `generate_rollouts` does. A tensor-parallel generator's ranks play the same
    episodes together: the environments must answer them alike (their first rank's episodes are kept)."""
    tp = runner.gen.tp
    lo, hi = generation_world(world, tp).share(len(prompts))
    mine = list(prompts[lo:hi])
    groups: list[list[Rollout]] = []
    records: list[EpisodeRecord] = []
    version = runner.gen.policy_version  # an episode that sampled nothing is of the weights it started with
    played = runner.play(mine, sampling, n, first_prompt_index=lo, between_steps=between_steps) if mine else []
    drain_updates(between_steps)
    if mine:
        flat = [(p, lv, rec) for p, eps in zip(mine, played, strict=True) for lv, rec in eps]
        scores = iter(safe_score_episodes(runner.task, [p for p, _, _ in flat], [lv.env for _, lv, _ in flat],
                                          [lv.tokens[lv.prompt_len:] for _, lv, _ in flat]))
        weights = dict(runner.task.reward_weights)
        tok = runner.tokenizer
        for p, eps in zip(mine, played, strict=True):
            group = []
            for lv, rec in eps:
                rewards, error = next(scores)
                completion = lv.tokens[lv.prompt_len:]
                text = tok.decode(completion, skip_special_tokens=False)  # the conversation, role markers included
                sampled = [v for v in lv.versions if v >= 0]
                group.append(Rollout(p, lv.tokens[:lv.prompt_len], completion, lv.logprobs, lv.finish_reason, text,
                                     rewards, error, weights=weights, completion_mask=lv.mask,
                                     # the conversation as messages (TRL's conversational completion) beside
                                     # the decoded tokens: samples.jsonl shows both
                                     extra={"episode": rec.to_dict(), "messages": lv.messages()},
                                     policy_version=min(sampled, default=version), token_versions=lv.versions,
                                     images=lv.images))
                records.append(rec)
            groups.append(group)
        failed = [r.reward_error for g in groups for r in g if r.reward_error is not None]
        if failed:
            log.warning("task %r: %d of %d episodes failed, scored 0.0 (first: %s)", runner.task.name, len(failed),
                        sum(map(len, groups)), failed[0])
    parts = world.gather_lists(gathered_once([(groups, records)], tp))
    return [g for part, _ in parts for g in part], [r for _, recs in parts for r in recs]
