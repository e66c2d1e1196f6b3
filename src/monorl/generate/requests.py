"""A request -- the engine's one unit -- and what it records: a prompt whose turns are sampled (one turn for a plain
completion, several for an episode that pauses at a tool call holding its cache), its tokens, per-token log-probs
and policy versions, and why each turn ended; the prompt group it shares a prefill with; the events a step returns;
a finished one as a `Completion`.

Sampling: a request's key comes from (seed, its id); the noise of the token at position p is a function of (key, p)
alone (`monorl.generate.sampling`), so its tokens do not depend on what else runs, nor on whether its prefix was
cached or prefilled anew. Id (i, j) draws `generate()`'s noise for sample j of prompt i.
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable
from dataclasses import dataclass, field

from torch import Tensor

from monorl.generate.cache import SequenceState
from monorl.generate.sampling import SamplingParams, sequence_key
from monorl.model.vision_prompt import ImageInputs

# why a turn ended (TurnEvent.reason)
STOP_TOKEN, STOP_SEQUENCE, STOP_STRING, LENGTH, CONTEXT = "stop_token", "stop_sequence", "stop_string", "length", \
    "context"


class ContextOverflowError(ValueError):
    """`add` / `resume` with tokens that leave no room in the engine's `max_tokens` (the request is unchanged)."""


@dataclass
class TurnEvent:
    request_id: Hashable
    turn: int  # 0 for the first turn
    token_ids: list[int]  # the turn's sampled tokens (a stop token / sequence included)
    logprobs: list[float]
    reason: str  # stop_token | stop_sequence | stop_string | length (the turn's budget) | context (request full)
    stop: int | tuple[int, ...] | str | None = None  # what matched, for the stop reasons
    versions: list[int] = field(default_factory=list)  # the policy version that sampled each of token_ids
    finished: bool = False  # a one-turn request: finished with its turn (its cache freed)


@dataclass(eq=False)  # identity: groups are found in dicts by key, never compared
class PromptGroup:
    """Requests added with one prompt (a GRPO group): the prompt is prefilled once, its full blocks shared
    (refcounted) and its last block copied per member, each member's first token sampled from the one prefill row.
    The group holds its blocks and row until every member added is admitted."""

    key: Hashable
    prompt: list[int]
    pending: int = 0  # members added, not admitted yet
    blocks: list[int] | None = None  # the prompt's blocks, once prefilled
    row: Tensor | None = None  # [V] the prompt's last-token logits, once prefilled
    version: int = 0  # the policy version of the weights that computed `row`
    images: ImageInputs | None = None  # the prompt's images (an input kind the runner hands the model)


@dataclass(eq=False)  # identity: requests are found in lists and queues by `is`
class Request:
    id: Hashable
    key: int  # sampling key (`request_key`)
    sampling: SamplingParams  # the current turn's
    stop_sequences: tuple[tuple[int, ...], ...]
    stop_ids: frozenset[int]
    tokens: list[int]  # the whole request: prompt, sampled and inserted tokens
    one_turn: bool = False  # finished at its first turn's end (its cache freed in that step)
    group: PromptGroup | None = None  # until admitted: the group whose prompt prefill it takes
    sampled: list[bool] = field(default_factory=list)  # per token: sampled by the model (True) or inserted
    logprobs: list[float] = field(default_factory=list)  # per token: its log-prob if sampled, else 0.0
    versions: list[int] = field(default_factory=list)  # per token: the policy version that sampled it, else -1
    state: str = "queued"  # queued (tokens to prefill) | running (in a decode slot) | paused | finished
    cache: SequenceState = field(default_factory=SequenceState)
    paused_at: int = 0  # when it last paused (the engine's turn counter), for the preemption order
    prompt_len: int = 0
    turn: int = 0
    turn_start: int = 0  # index in `tokens` of the current turn's first sampled token
    produced: int = 0  # tokens sampled this turn, read or not (deferred reads: `Engine(defer_reads=True)`)
    last_event: TurnEvent | None = None
    # its prompt's images: the prefill feeds them at the prompt's placeholder tokens, and every later token's
    # (M-RoPE) position runs `position_offset` behind its index
    images: ImageInputs | None = None

    def __post_init__(self) -> None:
        n = len(self.tokens)
        self.sampled, self.logprobs, self.versions = [False] * n, [0.0] * n, [-1] * n
        self.turn_start = self.prompt_len = n

    @property
    def position_offset(self) -> int:
        """Its tokens' index minus their position (0 without images: `ImageInputs.position_offset`)."""
        return 0 if self.images is None else self.images.position_offset

    @property
    def turn_tokens(self) -> list[int]:
        return self.tokens[self.turn_start:]

    @property
    def may_stop(self) -> bool:
        """Whether its turn may end before its budget (a stop token, sequence or string)."""
        return bool(self.stop_ids or self.stop_sequences or self.sampling.stop_strings)

    def turn_room(self, max_tokens: int) -> int:
        """Tokens the running request may still sample this turn (>= 1 while it runs)."""
        return min(self.sampling.max_new_tokens - (len(self.tokens) - self.turn_start), max_tokens - len(self.tokens))

    def insert(self, new: list[int]) -> None:
        """Append inserted tokens (a tool's output, the next assistant header): context, never sampled."""
        self.tokens += new
        self.sampled += [False] * len(new)
        self.logprobs += [0.0] * len(new)
        self.versions += [-1] * len(new)

    def record(self, toks: list[int], lps: list[float], version: int, tokenizer, max_tokens: int,
               ) -> tuple[str | None, int | tuple[int, ...] | str | None]:
        """Record sampled tokens up to the turn's end (those after it are dropped); returns (why the turn ended, what
        matched) or (None, None). Token by token where a stop sequence or string may end the turn; else the tokens
        before the first stop token or the turn's room are extended whole (64 requests x 127 tokens: 15-25 ms of host
        time token by token, with the GPU idle, against 0.4 ms; a shared 2-core CPU)."""
        if self.stop_sequences or self.sampling.stop_strings:
            for tok, lp in zip(toks, lps, strict=True):
                self._append(tok, lp, version)
                reason, stop = self.turn_end(tok, tokenizer, max_tokens)
                if reason is not None:
                    return reason, stop
            return None, None
        n = min(len(toks), self.turn_room(max_tokens))  # the turn's room: its n-th token ends it if nothing before
        if self.stop_ids:
            n = next((k + 1 for k in range(n) if toks[k] in self.stop_ids), n)
        self.tokens += toks[:n]
        self.sampled += [True] * n
        self.logprobs += lps[:n]
        self.versions += [version] * n
        return self.turn_end(self.tokens[-1], tokenizer, max_tokens) if n else (None, None)

    def _append(self, tok: int, lp: float, version: int) -> None:
        self.tokens.append(tok)
        self.sampled.append(True)
        self.logprobs.append(lp)
        self.versions.append(version)

    def turn_end(self, tok: int, tokenizer, max_tokens: int) -> tuple[str | None, int | tuple[int, ...] | str | None]:
        """Whether the turn ends at its last token `tok`, and why."""
        if tok in self.stop_ids:
            return STOP_TOKEN, tok
        n_turn = len(self.tokens) - self.turn_start  # (not a slice of the turn a token: quadratic in its length)
        for seq in self.stop_sequences:
            if n_turn >= len(seq) and tuple(self.tokens[-len(seq):]) == seq:
                return STOP_SEQUENCE, seq
        if self.sampling.stop_strings:
            hit = stop_string_hit(tokenizer, self.turn_tokens, self.sampling.stop_strings)
            if hit is not None:
                return STOP_STRING, hit
        if n_turn >= self.sampling.max_new_tokens:
            return LENGTH, None
        if len(self.tokens) >= max_tokens:
            return CONTEXT, None
        return None, None


def request_key(seed: int, request_id: Hashable) -> int:
    """An int id i keys as generate()'s sample 0 of prompt i, a pair (i, j) as its sample j, a triple (i, j, tag) as
    the pair (the tag only keeps ids of different batches apart); a string by its crc32."""
    if isinstance(request_id, tuple) and len(request_id) in (2, 3) and all(isinstance(x, int) for x in request_id):
        return sequence_key(seed, *request_id[:2])
    if isinstance(request_id, int):
        return sequence_key(seed, request_id, 0)
    if isinstance(request_id, str):
        return sequence_key(seed, zlib.crc32(request_id.encode()), 0)
    raise TypeError(f"request ids are ints, (int, int) pairs or strings, got {request_id!r}")


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    # decoded with special tokens skipped (what TRL's reward functions and vLLM's default text hold), cut before a
    # stop string and without the stop token; None without a tokenizer. token_ids keep every token.
    text: str | None = None
    versions: list[int] | None = None  # per token: the policy version of the weights that sampled it


def completion_of(tokenizer, req: Request) -> Completion:
    """A finished one-turn request as `generate()`'s caller gets it."""
    k, reason = req.prompt_len, req.last_event.reason if req.last_event else LENGTH
    return make_completion(tokenizer, req.tokens[k:], req.logprobs[k:], req.versions[k:],
                           "length" if reason in (LENGTH, CONTEXT) else "stop", req.stop_ids,
                           req.sampling.stop_strings)


def make_completion(tokenizer, tokens: list[int], logprobs: list[float], versions: list[int], finish_reason: str,
                    stop_ids: frozenset[int], stop_strings: tuple[str, ...]) -> Completion:
    """A finished sample as the caller gets it: its tokens as sampled, and (with a tokenizer) its text."""
    text = None
    if tokenizer is not None:
        ids = tokens
        if finish_reason == "stop" and ids and ids[-1] in stop_ids:
            ids = ids[:-1]  # the stop token stays in token_ids (the policy must learn to emit it), not in text
        # stop strings are matched on the raw text as generated (`stop_string_hit`), cut here in the text
        # without special tokens
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if stop_strings:
            cut = [text.find(s) for s in stop_strings if s in text]
            if cut:
                text = text[:min(cut)]
    return Completion(token_ids=list(tokens), logprobs=list(logprobs), finish_reason=finish_reason, text=text,
                      versions=list(versions))


def stop_string_hit(tokenizer, tokens: list[int], stops: tuple[str, ...]) -> str | None:
    """The first of `stops` found in the decoded tail of `tokens`, or None. Decodes only a tail window: a stop string
    of c characters spans at most ~c tokens."""
    window = max(len(s) for s in stops) + 8
    tail = tokenizer.decode(tokens[-window:], skip_special_tokens=False)
    return next((s for s in stops if s in tail), None)
