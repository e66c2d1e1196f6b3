"""`Engine`: the generator's one request-level engine. Its unit is a request (`monorl.generate.requests.Request`): a
prompt whose turns are sampled with continuous batching beside the other running requests; a turn ends at a stop
token (the generator's eos ids unless `ignore_eos`, plus `stop_token_ids`), a stop token sequence (e.g. a tool-call
close tag's ids), a stop string (needs a tokenizer), the turn's budget (`max_new_tokens`) or the request's capacity
(`max_tokens`). A one-turn request (`add(one_turn=True)`: a completion of `generate()`) is then finished, its cache
freed; any other *pauses* holding its cache: the caller appends tokens (a tool's output, the next assistant header)
with `resume`, and only those are prefilled over the cached prefix (`ModelRunner.prefill_cached`) before the next
turn decodes. While one request waits for its environment the others keep decoding: `step` advances whatever is
runnable and returns the turns that ended.

    engine = Engine(generator, max_tokens=4096)
    engine.add("ep0", prompt_ids, SamplingParams(max_new_tokens=256, stop_token_ids=(im_end,)))
    while engine.has_work():
        for ev in engine.step():
            new_ids = environment(ev)                       # None: the request is over
            engine.finish(ev.request_id) if new_ids is None else engine.resume(ev.request_id, new_ids)

`generate()` for a batch of prompts is a thin function over it (`monorl.generate.batch`); `run_episodes`
(`monorl.generate.episodes`) drives multi-turn requests to their end.

Memory (`monorl.generate.cache`): a turn is admitted with the blocks for every position its budget may write (up to
min(tokens + max_new_tokens - 1 + overrun, max_tokens - 1)), so a running turn never runs out of cache and its block
table never changes while it decodes -- which is what lets a CUDA graph run many steps unattended. At the turn's end
the blocks past its cached positions go back; a paused request holds only what its K/V use. When a turn's blocks are not
free, requests are preempted, the most recently paused first, then the queued ones behind it: their blocks are freed,
and their whole conversation is prefilled again when they next run (the same tokens: the noise is keyed by position,
and in batch-invariant mode a re-prefilled token's K/V are bitwise the cached ones). Running turns are never
preempted. Requests added with one prompt share it as a `PromptGroup` (`monorl.generate.admission`).

Weights may change between steps (`Generator.load_weights_`, in place; an in-flight update): per token a request
records the generator's `policy_version` when it was sampled (-1 for inserted tokens); a paused request's cached K/V
stay those of the weights that computed them (as in-flight weight updates do elsewhere); `preempt` makes one
recompute them. Tensor parallelism lives in the generator's copy and runner: every rank of a group makes the same
calls, so the engine schedules alike on each (its default seed is the group's first rank's).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Protocol

import torch

from monorl.generate.admission import Admission
from monorl.generate.cache import Cache, table_tensor
from monorl.generate.requests import (
    ContextOverflowError,
    PromptGroup,
    Request,
    TurnEvent,
    request_key,
)
from monorl.generate.runner import ModelRunner
from monorl.generate.sampling import SamplingParams
from monorl.generate.tensor_parallel import TensorParallel
from monorl.model.vision_prompt import ImageInputs


class EngineHost(Protocol):
    """What the engine runs on: a `monorl.generate.generator.Generator` (its copy, cache, runner and settings)."""

    config: Any  # GeneratorConfig: max_num_seqs, max_prefill_tokens, stop_check_interval
    cache: Cache | None
    runner: ModelRunner
    model: Any
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    device: torch.device
    max_model_len: int
    policy_version: int
    tp: TensorParallel

    def allocate_kv_cache(self, budget: int | None = None) -> None: ...


class Engine(Admission):
    def __init__(self, generator: EngineHost, max_tokens: int | None = None, turn_prefill: str = "auto",
                 overrun: int = 0, defer_reads: bool = False) -> None:
        """Requests on `generator`'s model, cache and model runner (its decode graphs included). max_tokens: a
        request's capacity (all its turns and inserted tokens); None: the generator's max_model_len. turn_prefill: how
        appended tokens attend their cached prefix (`ModelRunner.prefill_cached`: auto -- paged on CUDA, else varlen
        --, paged, varlen, or decode, the oldest form, kept to measure against). Engines may share a generator: one
        runs between another's steps (it reuses the decode slots; the other restores its running requests' slots at
        its next step) while the blocks the other holds leave it less memory. overrun: a decode chunk may run up to
        this many steps past a running turn's budget (those tokens are dropped; its turn reserves blocks for them),
        so that chunks do not shrink to the nearest turn end when many turns of different budgets run (a host read and
        an admission per chunk instead of per token). The tokens kept are the same: noise is keyed by position.
        defer_reads: while no running request may stop early and all are one-turn, a chunk's tokens are read after
        the next chunk is queued (the host appends them while the GPU runs on: with a read between every two launches
        the GPU idled ~0.1-0.2 s of a 5.7 s throughput run, H200); their events come a step later."""
        if overrun < 0:
            raise ValueError(f"overrun must be >= 0, got {overrun}")
        if generator.cache is None:
            generator.allocate_kv_cache()
        assert generator.cache is not None
        self.gen, self.runner, self.cache = generator, generator.runner, generator.cache
        self.overrun, self.defer_reads = overrun, defer_reads
        self.turn_prefill = self.runner.turn_prefill_form(turn_prefill)
        self.max_tokens = max_tokens or generator.max_model_len
        if not 2 <= self.max_tokens <= generator.max_model_len:
            raise ValueError(f"max_tokens {self.max_tokens} must be in [2, max_model_len {generator.max_model_len}]")
        need = self.cache.blocks_needed(self.max_tokens - 1)  # the last token's K/V is never written
        if need > self.cache.blocks.usable_blocks:
            raise ValueError(f"a request of {self.max_tokens} tokens needs {need} KV blocks, the cache has "
                             f"{self.cache.blocks.usable_blocks} (lower max_tokens)")
        self.requests: dict[Hashable, Request] = {}
        self.queue: deque[Request] = deque()  # tokens to prefill (new or resumed), in arrival order
        self.running: list[Request] = []  # running[i] decodes in slot i
        self.groups: dict[Hashable, PromptGroup] = {}  # groups with members not admitted yet
        self.default_seed = generator.tp.broadcast_int(int(torch.randint(0, 2**31 - 1, ()).item()))
        self.turns_ended = 0
        self.preemptions = 0  # requests whose cache was dropped to admit a turn (each costs a re-prefill)
        self.decoded = False  # whether the last step queued a decode chunk
        self.unread: Callable[[list[TurnEvent]], None] | None = None  # a deferred chunk read

    @property
    def policy_version(self) -> int:
        """The version of the weights the generator holds (recorded per sampled token)."""
        return self.gen.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self.gen.policy_version = version

    # ---- the caller's side -------------------------------------------------------------------------
    def add(self, request_id: Hashable, prompt_ids: list[int], sampling: SamplingParams,
            stop_sequences: Iterable[Iterable[int]] = (), one_turn: bool = False, group: Hashable = None,
            images: ImageInputs | None = None) -> Request:
        """Queue a new request; its first turn decodes under `sampling` (max_new_tokens: the turn's budget). group: the
        prompt group it joins (None: its prompt; requests of one group share its prompt's prefill). images: the
        prompt's (`ImageInputs`, its placeholder tokens expanded), fed by its group's one prefill."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} exists already")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError(f"request {request_id!r}: empty prompt")
        self._check_ids(request_id, prompt)
        if len(prompt) >= self.max_tokens:
            raise ContextOverflowError(f"request {request_id!r}: a prompt of {len(prompt)} tokens leaves no room in "
                                       f"max_tokens {self.max_tokens}")
        stops = self._check_turn(request_id, sampling, stop_sequences)
        seed = sampling.seed if sampling.seed is not None else self.default_seed
        sample_key = request_key(seed, request_id)
        key = tuple(prompt) if group is None else group
        g = self.groups.setdefault(key, PromptGroup(key, list(prompt), images=images))  # its own copy of `prompt`
        if g.prompt != prompt or g.images is not images:
            raise ValueError(f"request {request_id!r}: group {key!r} has another prompt or other images")
        if images is not None and self.gen.model.config.vision is None:
            raise ValueError(f"request {request_id!r} has images; the model has no vision tower (a text-only model)")
        if images is not None and images.length != len(prompt):
            raise ValueError(f"request {request_id!r}: images laid out for {images.length} prompt tokens, the "
                             f"prompt has {len(prompt)}")
        g.pending += 1
        req = Request(id=request_id, key=sample_key, sampling=sampling, stop_sequences=stops,
                      stop_ids=self._stop_ids(sampling), tokens=prompt, one_turn=one_turn, group=g, images=images)
        self.requests[request_id] = req
        self.queue.append(req)
        return req

    def resume(self, request_id: Hashable, new_token_ids: list[int], sampling: SamplingParams | None = None,
               stop_sequences: Iterable[Iterable[int]] | None = None, images: ImageInputs | None = None) -> None:
        """Append inserted tokens to a paused request and queue its next turn (sampling / stop_sequences: the next
        turn's, default the last turn's). images: where the new tokens hold images (a tool's), the request's images
        laid out through them (`append_images`): the turn's prefill runs the tower on the new ones. Raises
        ContextOverflowError, leaving the request paused and unchanged, if they leave no room for a sampled token
        within max_tokens."""
        req = self._get(request_id)
        if req.state != "paused":
            raise ValueError(f"request {request_id!r} is {req.state}, not paused")
        new = [int(t) for t in new_token_ids]
        self._check_ids(request_id, new)
        if images is not None and self.gen.model.config.vision is None:
            raise ValueError(f"request {request_id!r}: images inserted; the model has no vision tower (a text-only "
                             "model)")
        if images is not None and images.length != len(req.tokens) + len(new):
            raise ValueError(f"request {request_id!r}: images laid out for {images.length} tokens, the request has "
                             f"{len(req.tokens) + len(new)} with the new ones")
        total = len(req.tokens) + len(new)
        if total >= self.max_tokens:
            raise ContextOverflowError(f"request {request_id!r}: {len(req.tokens)} tokens + {len(new)} appended = "
                                       f"{total} leaves no room in max_tokens {self.max_tokens}")
        sampling = sampling or req.sampling
        stops = self._check_turn(request_id, sampling, req.stop_sequences if stop_sequences is None else stop_sequences)
        req.sampling, req.stop_sequences, req.stop_ids = sampling, stops, self._stop_ids(sampling)
        req.images = images if images is not None else req.images
        req.insert(new)
        req.turn, req.turn_start, req.produced, req.state = req.turn + 1, len(req.tokens), 0, "queued"
        self.queue.append(req)

    def finish(self, request_id: Hashable) -> Request:
        """Drop a request in any state and free its cache; returns it (its tokens, flags, log-probs, versions)."""
        req = self._get(request_id)
        if req.state == "queued":
            # (admission takes a request off the queue before its prefill runs: a prefill that raised leaves it out)
            for i, queued in enumerate(self.queue):
                if queued is req:
                    del self.queue[i]
                    break
            if req.group is not None:
                req.group.pending -= 1
                self.release_group_if_done(req.group)
                req.group = None
        elif req.state == "running":
            self._release_slots([r is not req for r in self.running])
        self.cache.free(req.cache)
        req.state = "finished"
        del self.requests[request_id]
        return req

    def preempt(self, request_id: Hashable) -> None:
        """Free a paused or queued request's cache now (to leave it to another engine, or to recompute its K/V under
        new weights); its whole conversation is prefilled again when it next runs."""
        req = self._get(request_id)
        if req.state == "running":
            raise ValueError(f"request {request_id!r} is running (a running turn keeps its blocks)")
        self.cache.free(req.cache)

    def close(self) -> None:
        """Finish every request and free the cache it holds (an exception mid-generation must not leak blocks)."""
        self.unread = None
        for request_id in list(self.requests):
            self.finish(request_id)
        for g in list(self.groups.values()):  # admitted whole, their prefill raised before the group was released
            g.pending = 0
            self.release_group_if_done(g)

    def request(self, request_id: Hashable) -> Request:
        return self._get(request_id)

    def has_work(self) -> bool:
        """Whether `step` would advance anything (queued or running requests, or tokens not read yet; paused ones
        wait for the caller)."""
        return bool(self.queue or self.running or self.unread)

    # ---- the step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[TurnEvent]:
        """Admit queued requests (prefill their new tokens, sample each turn's first token), then decode the running
        ones for up to `stop_check_interval` steps (with stops; else until the nearest turn budget, at most the
        runner's ring); returns the turns that ended (those requests are paused, or finished if one-turn)."""
        events: list[TurnEvent] = []
        self._own_slots()
        self.admit(events)
        self.decoded = bool(self.running)
        if not self.running:
            self._read_unread(events)
            return events
        runner, live = self.runner, len(self.running)
        # up to the nearest turn's end, or past it by `overrun` (within each turn's reserved blocks and the request's
        # capacity)
        left = min(min(r.sampling.max_new_tokens - r.produced + self.overrun, self.max_tokens - len(r.tokens))
                   for r in self.running)
        steps = min(left, runner.ring_size)
        may_stop = any(r.may_stop for r in self.running)
        if may_stop:
            steps = min(steps, self.gen.config.stop_check_interval)
        width = max(len(r.cache.table) for r in self.running)
        sampling = self.running[0].sampling  # every request's sampler configuration is the same (`_check_turn`)
        for _ in range(steps):
            runner.decode(live, width, sampling)
        if self.defer_reads and not may_stop and all(r.one_turn for r in self.running):
            self._deferred_chunk(steps, events)
            return events
        self._read_unread(events)
        toks, lps = runner.read_ring(steps, live)
        for req, req_toks, req_lps in zip(self.running, toks, lps, strict=True):
            req.produced += steps
            reason, stop = req.record(req_toks, req_lps, self.policy_version, self.gen.tokenizer, self.max_tokens)
            if reason is not None:
                self.end_turn(req, reason, stop, events)
        self._release_slots([r.state == "running" for r in self.running])
        return events

    def _deferred_chunk(self, steps: int, events: list[TurnEvent]) -> None:
        """Copy the chunk's tokens behind the queued steps and read them at the next step (`ModelRunner.copy_ring`):
        a request whose budget the chunk reaches gives its slot and blocks back now (its tokens are in the ring)."""
        wait = self.runner.copy_ring(steps, len(self.running))
        reqs, version = list(self.running), self.policy_version

        def read(events: list[TurnEvent]) -> None:
            toks, lps = wait()
            for req, req_toks, req_lps in zip(reqs, toks, lps, strict=True):
                reason, stop = req.record(req_toks, req_lps, version, self.gen.tokenizer, self.max_tokens)
                if reason is not None:
                    self.end_turn(req, reason, stop, events)

        for req in self.running:
            req.produced += steps
            if req.produced >= req.sampling.max_new_tokens:
                req.state = "reading"  # done; its last tokens are read at the next step
                self.cache.free(req.cache)
        self._release_slots([r.state == "running" for r in self.running])  # queued behind the copy
        self._read_unread(events)  # the chunk before this one: its copy is done, this one runs meanwhile
        self.unread = read

    def _read_unread(self, events: list[TurnEvent]) -> None:
        if self.unread is not None:
            read, self.unread = self.unread, None
            read(events)

    def end_turn(self, req: Request, reason: str, stop: Any, events: list[TurnEvent]) -> None:
        """A request's turn ended: pause it (its unused blocks go back) or, one-turn, finish it; add its event."""
        req.cache.cached = len(req.tokens) - 1  # the last sampled token was never fed
        if req.one_turn:
            req.state = "finished"
            self.cache.free(req.cache)
        else:
            req.state = "paused"
            self.cache.trim(req.cache, req.cache.cached)
        self.turns_ended += 1
        req.paused_at = self.turns_ended
        s = req.turn_start
        req.last_event = TurnEvent(req.id, req.turn, req.tokens[s:], req.logprobs[s:], reason, stop, req.versions[s:],
                                   finished=req.one_turn)
        events.append(req.last_event)

    def release_group_if_done(self, g: PromptGroup) -> None:
        """A group whose members are all admitted gives back its own references to the prompt's blocks."""
        if g.pending == 0:
            if g.blocks:
                self.cache.release_prefix(g.blocks)
            g.blocks, g.row = [], None
            if self.groups.get(g.key) is g:
                del self.groups[g.key]

    # ---- decode slots ------------------------------------------------------------------------------
    def set_slots(self, start: int, reqs: list[Request]) -> None:
        """Put requests in slots start.. : each feeds its last token at its position next."""
        if not reqs:
            return
        dev = self.gen.device
        self.runner.set_slots(list(range(start, start + len(reqs))),
                              torch.tensor([r.tokens[-1] for r in reqs], dtype=torch.int64, device=dev),
                              [len(r.tokens) - 1 for r in reqs], [r.key for r in reqs],
                              table_tensor([r.cache.table for r in reqs], self.runner.width, dev),
                              [r.position_offset for r in reqs])

    def _release_slots(self, live: list[bool]) -> None:
        if all(live):
            return
        self.running, (src, dst) = compact_slots(self.running, live)
        self.runner.move_slots(src, dst)
        self.runner.reset_slots(len(self.running))

    def _own_slots(self) -> None:
        """Restore the running requests' slots if another engine used them since; with none running, switch the
        runner to the queued requests' sampler graphs while nothing is live (`ModelRunner.select_graphs`)."""
        runner = self.runner
        if runner.slot_owner is not self:
            runner.reset_slots(0)
            self.set_slots(0, self.running)
            runner.slot_owner = self
        if not self.running and self.queue and runner.use_graphs:
            sampling = self.queue[0].sampling
            if runner.graph_key != sampling.sampler_key():
                runner.select_graphs(sampling)

    # ---- checks ------------------------------------------------------------------------------------
    def _get(self, request_id: Hashable) -> Request:
        if request_id not in self.requests:
            raise KeyError(f"no request {request_id!r}")
        return self.requests[request_id]

    def _check_ids(self, request_id: Hashable, ids: list[int]) -> None:
        V = self.gen.model.config.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= V):
            raise ValueError(f"request {request_id!r}: token ids outside [0, {V})")

    def _check_turn(self, request_id: Hashable, sampling: SamplingParams,
                    stop_sequences: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
        # every other request has the same key (this check): one of them stands for all (not O(requests) a call)
        other = next((r for r in self.requests.values() if r.id != request_id), None)
        if other is not None and sampling.sampler_key() != other.sampling.sampler_key():
            raise ValueError(f"request {request_id!r}: every request's temperature / top_p / top_k must be the same "
                             f"(one decode step samples them all), got {sampling.sampler_key()} beside "
                             f"{other.sampling.sampler_key()}")
        if sampling.stop_strings and self.gen.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer (Generator(..., tokenizer=...))")
        stops = tuple(tuple(int(t) for t in s) for s in stop_sequences)
        if any(not s for s in stops):
            raise ValueError(f"request {request_id!r}: an empty stop sequence")
        return stops

    def _stop_ids(self, sampling: SamplingParams) -> frozenset[int]:
        eos = frozenset() if sampling.ignore_eos else frozenset(self.gen.eos_token_ids)
        return frozenset(sampling.stop_token_ids) | eos


def compact_slots(items: list, live: list[bool]) -> tuple[list, tuple[list[int], list[int]]]:
    """Slot compaction: items[i] lives in slot i. Returns (the live items, each now at its new slot index, and the
    (src, dst) slot moves that put them there): the last live items move into the holes, so live slots are 0..n-1."""
    n = sum(live)
    holes = [i for i in range(n) if not live[i]]
    movers = [i for i in range(n, len(items)) if live[i]]
    new = list(items)
    for h, m in zip(holes, movers, strict=True):
        new[h] = items[m]
    return new[:n], (movers, holes)
