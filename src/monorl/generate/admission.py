"""Admission: which queued requests take decode slots, with which blocks, and the prefill that starts their turns.

Prefill first: admission rounds run while queued requests find slots and blocks, so a step decodes every request it
can hold (one round a step kept 1024-token prompts 8 to a round, each round decoding its whole turn before the next
was admitted: 4x the decode steps on 64 episodes). A round takes queued requests in order, stopping at the first that
does not fit, up to `max_prefill_tokens` new tokens (one prefill at least), and makes one packed prefill of them.

What a request's turn prefills:
- a new request joins its `PromptGroup`: the group's prompt is prefilled once, when its first member is admitted;
  each member shares the prompt's full blocks (refcounted), gets a copy of the partial last block and samples its
  first token from the group's one prefill row (the n samples of a prompt, or a GRPO group of episodes);
- a request whose cache was preempted: its whole conversation, in the same packed prefill;
- a resumed request: only its appended tokens, over its cached prefix (`ModelRunner.prefill_cached`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Any

import torch

from monorl.generate.cache import Cache, slot_mapping
from monorl.generate.requests import PromptGroup, Request, TurnEvent
from monorl.generate.runner import ModelRunner


class Admission:
    """The engine's admission (`monorl.generate.engine.Engine` is one): what it reads and calls of the engine."""

    gen: Any
    cache: Cache
    runner: ModelRunner
    queue: deque[Request]
    running: list[Request]
    requests: dict[Hashable, Request]
    overrun: int
    max_tokens: int
    turn_prefill: str
    preemptions: int
    policy_version: int

    def end_turn(self, req: Request, reason: str, stop: Any, events: list[TurnEvent]) -> None: ...
    def set_slots(self, start: int, reqs: list[Request]) -> None: ...
    def release_group_if_done(self, g: PromptGroup) -> None: ...

    def admit(self, events: list[TurnEvent]) -> None:
        """Admission rounds while queued requests find slots and blocks (the module docstring)."""
        while self.queue and self._admit_round(events):
            pass

    def _admit_round(self, events: list[TurnEvent]) -> bool:
        """One round: move queued requests into free slots, in order, with their turn's blocks (preempting others for
        them), up to max_prefill_tokens new tokens; prefill; sample each one's first token. Whether any was admitted."""
        cfg, cache = self.gen.config, self.cache
        bs = cache.block_size
        whole: list[tuple[list[int], list[int], PromptGroup | Request]] = []  # prefilled from position 0
        members: dict[int, PromptGroup] = {}  # id(request) -> the group whose row starts it
        first: list[Request] = []  # admitted, whose first token comes from a whole prefill (a group's or its own)
        cached: list[Request] = []  # admitted, resumed over their cached prefix
        copies: list[tuple[int, int]] = []
        budget = 0
        for req in list(self.queue):
            if len(self.running) + len(first) + len(cached) >= cfg.max_num_seqs:
                break
            g, n = req.group, len(req.tokens)
            # every position the turn may write: the last sampled token is never fed
            reserve = cache.blocks_needed(min(n + req.sampling.max_new_tokens - 1 + self.overrun, self.max_tokens - 1))
            if g is not None:  # a new request: its group's prompt (prefilled by the first member admitted)
                full = n // bs
                own = reserve - full
                cost = n if g.blocks is None else 0
                need = own + (cache.blocks_needed(n) if g.blocks is None else 0)
                rows = 1 + (g.blocks is None)  # its sequence row (a recurrent kind's), and its prompt's
            elif not req.cache.table:  # preempted: its whole conversation
                cost, need, rows = n, reserve, 1
            else:  # resumed: its appended tokens
                cost, need, rows = n - req.cache.cached, reserve - len(req.cache.table), 0
            if cost and budget and budget + cost > cfg.max_prefill_tokens:
                break
            if not self._make_room(need, req, rows):
                break
            if g is not None:
                if g.blocks is None:
                    g.blocks = cache.allocate_prefix(cache.blocks_needed(n))
                    whole.append((g.prompt, g.blocks, g))
                cache.share(req.cache, g.blocks[:full])
                new = cache.extend(req.cache, own)
                if new and (n % bs or cache.copies_prompt_state):  # (a recurrent state row rides on the pair)
                    copies.append((g.blocks[full] if n % bs else g.blocks[-1], new[0]))
                g.pending -= 1
                members[id(req)] = g
                req.group = None
                first.append(req)
            elif not req.cache.table:
                cache.extend(req.cache, need)
                whole.append((req.tokens, req.cache.table, req))
                first.append(req)
            else:
                cache.extend(req.cache, need)
                cached.append(req)
            self.queue.remove(req)
            budget += cost
        if not first and not cached:
            if self.queue and not self.running:
                raise RuntimeError("no queued request could be admitted (KV cache accounting bug)")
            return False
        runner, version = self.runner, self.policy_version
        rows: dict[int, torch.Tensor] = {}  # id(request) -> its first token's logits
        if whole:
            # a group's images go through the tower once, in its one prefill; its members share the prompt's KV
            logits = runner.prefill([w[0] for w in whole], [slot_mapping(w[1], 0, len(w[0]), bs) for w in whole],
                                    images=[w[2].images for w in whole])
            for (_, _, target), row in zip(whole, logits, strict=True):
                if isinstance(target, PromptGroup):
                    target.row, target.version = row, version
                else:
                    rows[id(target)] = row
        cache.copy_blocks(copies)  # after the groups' prefill
        if cached:
            starts = [r.cache.cached for r in cached]
            logits = runner.prefill_cached([r.tokens[k:] for r, k in zip(cached, starts, strict=True)], starts,
                                           [r.cache.table for r in cached], self.turn_prefill,
                                           offsets=[r.position_offset for r in cached],
                                           images=[r.images for r in cached])
            rows.update({id(r): row for r, row in zip(cached, logits, strict=True)})
        admitted = first + cached
        for req in admitted:
            req.cache.cached = len(req.tokens)
            if id(req) in members:
                rows[id(req)] = members[id(req)].row
        tok, lp = self._sample_first(admitted, [rows[id(r)] for r in admitted])
        for g in {id(g): g for g in members.values()}.values():  # their rows are sampled
            self.release_group_if_done(g)
        go_on = []
        for req, t, p in zip(admitted, tok, lp, strict=True):
            req.state, req.produced = "running", 1
            v = members[id(req)].version if id(req) in members else version
            reason, stop = req.record([t], [p], v, self.gen.tokenizer, self.max_tokens)
            if reason is None:
                go_on.append(req)
            else:
                self.end_turn(req, reason, stop, events)
        self.set_slots(len(self.running), go_on)  # those whose turn goes on take the next slots
        self.running += go_on
        return True

    def _sample_first(self, admitted: list[Request], rows: list[torch.Tensor]) -> tuple[list[int], list[float]]:
        """Each admitted request's first token of the turn (and its log-prob) from its row."""
        # At least 2 rows (the first repeated): Dynamo specialises a size-1 dimension, so one row would compile the
        # sampler a second time. Rows are sampled independently; the extra one is dropped.
        idx = list(range(len(admitted))) + ([0] if len(admitted) == 1 else [])
        dev = self.gen.device
        logits = torch.stack([rows[i] for i in idx])
        keys = torch.tensor([admitted[i].key for i in idx], dtype=torch.int64, device=dev)
        positions = torch.tensor([len(admitted[i].tokens) for i in idx], dtype=torch.int64, device=dev)
        tok, lp = self.runner.sample_fn(logits, keys, positions, admitted[0].sampling, self.gen.model.token_logprobs)
        return tok[:len(admitted)].tolist(), lp[:len(admitted)].tolist()

    def _make_room(self, need: int, keep: Request, rows: int = 0) -> bool:
        """Free `need` blocks (and `rows` sequence rows) for a turn if they are not: preempt paused requests, the most
        recently paused first, then the queued ones behind it (the queue's last first); never `keep`."""
        cache = self.cache
        victims = sorted((r for r in self.requests.values() if r.state == "paused" and r.cache.table),
                         key=lambda r: -r.paused_at)
        victims += [r for r in reversed(self.queue) if r.cache.table]
        for victim in victims:
            if victim is keep:
                continue
            if cache.can_extend(need, rows):
                break
            cache.free(victim.cache)
            self.preemptions += 1
        return cache.can_extend(need, rows)
