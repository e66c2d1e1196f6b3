"""`EpisodeEngine`: multi-turn episodes that keep their KV cache between turns (agentic RL).

An episode is one token sequence the engine keeps: its prompt is prefilled, a turn is decoded with continuous
batching beside the other running episodes, and the episode *pauses* at the turn's end -- a stop token (the
generator's eos ids unless `ignore_eos`, plus `stop_token_ids`, e.g. `<|im_end|>`), a stop token sequence (e.g. a
tool-call close tag's ids), a stop string (needs a tokenizer), the turn's budget (`max_new_tokens`) or the episode's
token capacity. A paused episode keeps its KV blocks; the caller appends tokens (a tool's output, the next assistant
header) with `resume`, and only those are prefilled over the cached prefix (`ModelRunner.prefill_cached`) before the
next turn decodes. While one episode waits for its environment the others keep decoding: `step` advances whatever
is runnable and returns the turns that ended.

    engine = EpisodeEngine(generator, max_episode_tokens=4096)
    engine.add("ep0", prompt_ids, SamplingParams(max_new_tokens=256, stop_token_ids=(im_end,)))
    while engine.has_work():
        for ev in engine.step():
            new_ids = environment(ev)                       # None: the episode is over
            engine.finish(ev.episode_id) if new_ids is None else engine.resume(ev.episode_id, new_ids)

Memory: a turn is admitted with the KV blocks for its whole budget (up to min(tokens + max_new_tokens,
max_episode_tokens)), so a running turn never runs out of KV memory and its block table never changes while it
decodes -- the decode step is `Generator.generate`'s CUDA-graphed step. At the turn's end the blocks past its tokens
go back; a paused episode holds only what its tokens use. When a turn's blocks are not free, episodes are
preempted, the most recently paused first, then the queued ones behind it: their blocks are freed, and their whole
conversation is prefilled again when they next run (the same tokens: the noise is keyed by position, and in
batch-invariant mode a re-prefilled token's K/V are bitwise the cached ones). Running turns are never preempted.
Episodes added with the same prompt (a GRPO group) share its KV: a later one takes the full blocks of one already
prefilled (refcounted; positions before a token's own are never rewritten), a copy of the partial block, and
prefills the prompt's last token alone.

Sampling: an episode's key comes from (seed, its id); the noise of the token at position p is a function of
(key, p) alone (`monorl.generate.sampling`), so an episode's tokens do not depend on what else runs, nor on whether
its prefix was cached or prefilled anew. Id (i, j) draws generate()'s noise for sample j of prompt i.

Per token the episode records whether the model sampled it (`sampled`), its log-prob (0.0 for inserted tokens) and
the `policy_version` the engine held when it was sampled (-1 for inserted tokens). Weights may change between steps
(`Generator.load_weights_`, in place): a paused episode's cached K/V stay those of the weights that computed them
(as in-flight weight updates do elsewhere); `preempt` makes one recompute them.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from monorl.generate.engine import Generator, stop_string_hit
from monorl.generate.kv_cache import blocks_for, slot_mapping, table_tensor
from monorl.generate.sampling import SamplingParams, sequence_key
from monorl.generate.scheduler import compact_slots

# why a turn ended (TurnEvent.reason)
STOP_TOKEN, STOP_SEQUENCE, STOP_STRING, LENGTH, CONTEXT = "stop_token", "stop_sequence", "stop_string", "length", \
    "context"


class ContextOverflowError(ValueError):
    """`resume` with tokens that leave no room in the episode's `max_episode_tokens` (the episode is unchanged)."""


@dataclass
class TurnEvent:
    episode_id: Hashable
    turn: int  # 0 for the first turn
    token_ids: list[int]  # the turn's sampled tokens (a stop token / sequence included)
    logprobs: list[float]
    reason: str  # stop_token | stop_sequence | stop_string | length (the turn's budget) | context (episode full)
    stop: int | tuple[int, ...] | str | None = None  # what matched, for the stop reasons
    versions: list[int] = field(default_factory=list)  # the policy version that sampled each of token_ids


@dataclass(eq=False)  # identity: episodes are found in lists and queues by `is`
class Episode:
    id: Hashable
    key: int  # sampling key (`sequence_key`)
    sampling: SamplingParams  # the current turn's
    stop_sequences: tuple[tuple[int, ...], ...]
    stop_ids: frozenset[int]
    tokens: list[int]  # the whole episode: prompt, sampled and inserted tokens
    sampled: list[bool] = field(default_factory=list)  # per token: sampled by the model (True) or inserted
    logprobs: list[float] = field(default_factory=list)  # per token: its log-prob if sampled, else 0.0
    versions: list[int] = field(default_factory=list)  # per token: the policy version that sampled it, else -1
    state: str = "queued"  # queued (tokens to prefill) | running (in a decode slot) | paused
    table: list[int] = field(default_factory=list)  # KV blocks: its tokens', and a running turn's budget
    cached: int = 0  # positions 0..cached-1 hold this episode's K/V
    paused_at: int = 0  # when it last paused (the engine's turn counter), for the preemption order
    prompt_len: int = 0
    turn: int = 0
    turn_start: int = 0  # index in `tokens` of the current turn's first sampled token
    last_event: TurnEvent | None = None

    def __post_init__(self) -> None:
        n = len(self.tokens)
        self.sampled, self.logprobs, self.versions = [False] * n, [0.0] * n, [-1] * n
        self.turn_start = self.prompt_len = n

    @property
    def turn_tokens(self) -> list[int]:
        return self.tokens[self.turn_start:]


def episode_key(seed: int, episode_id: Hashable) -> int:
    """An int id i keys as generate()'s sample 0 of prompt i, a pair (i, j) as its sample j, a triple (i, j, tag) as
    the pair (the tag only keeps ids of different batches apart); a string by its crc32."""
    if isinstance(episode_id, tuple) and len(episode_id) in (2, 3) and all(isinstance(x, int) for x in episode_id):
        return sequence_key(seed, *episode_id[:2])
    if isinstance(episode_id, int):
        return sequence_key(seed, episode_id, 0)
    if isinstance(episode_id, str):
        return sequence_key(seed, zlib.crc32(episode_id.encode()), 0)
    raise TypeError(f"episode ids are ints, (int, int) pairs or strings, got {episode_id!r}")


class EpisodeEngine:
    def __init__(self, generator: Generator, max_episode_tokens: int | None = None,
                 turn_prefill: str = "auto", overrun: int = 0) -> None:
        """Episodes on `generator`'s model, KV cache, block manager and model runner (its decode graphs included).
        max_episode_tokens: an episode's capacity (all its turns and inserted tokens); None: the generator's
        max_model_len. turn_prefill: how appended tokens attend their cached prefix (`ModelRunner.prefill_cached`:
        auto -- paged on CUDA, else varlen --, paged, varlen, or decode, the oldest form, kept to measure against).
        `Generator.generate` may run between steps (it reuses the decode slots; the engine restores its running
        episodes' slots at its next step) while the blocks this engine holds leave it less KV memory. overrun: a
        decode chunk may run up to this many steps past a running turn's budget (those tokens are dropped; its turn
        reserves KV blocks for them), so that chunks do not shrink to the nearest turn end when many turns of
        different budgets run (continuous batches: a host read and an admission per chunk instead of per token). The
        tokens kept are the same: noise is keyed by position."""
        if overrun < 0:
            raise ValueError(f"overrun must be >= 0, got {overrun}")
        self.overrun = overrun
        if generator.kv is None:
            generator.allocate_kv_cache()
        self.gen, self.runner, self.blocks = generator, generator.runner, generator.blocks
        self.turn_prefill = self.runner.turn_prefill_form(turn_prefill)
        self.block_size = generator.kv.block_size
        self.max_episode_tokens = max_episode_tokens or generator.max_model_len
        if not 2 <= self.max_episode_tokens <= generator.max_model_len:
            raise ValueError(f"max_episode_tokens {self.max_episode_tokens} must be in [2, max_model_len "
                             f"{generator.max_model_len}]")
        need = blocks_for(self.max_episode_tokens, self.block_size)
        if need > self.blocks.usable_blocks:
            raise ValueError(f"an episode of {self.max_episode_tokens} tokens needs {need} KV blocks, the cache has "
                             f"{self.blocks.usable_blocks} (lower max_episode_tokens)")
        self.policy_version = 0  # recorded per sampled token; whoever updates the weights bumps it
        self.episodes: dict[Hashable, Episode] = {}
        self.queue: deque[Episode] = deque()  # tokens to prefill (new or resumed), in arrival order
        self.running: list[Episode] = []  # running[i] decodes in slot i
        self.default_seed = int(torch.randint(0, 2**31 - 1, ()).item())
        self.turns_ended = 0
        self.by_prompt: dict[tuple[int, ...], list[Episode]] = {}  # live episodes by their prompt (KV sharing)
        self.preemptions = 0  # episodes whose KV was dropped to admit a turn (each costs a re-prefill)

    # ---- the caller's side -------------------------------------------------------------------------
    def add(self, episode_id: Hashable, prompt_ids: list[int], sampling: SamplingParams,
            stop_sequences: Iterable[Iterable[int]] = ()) -> None:
        """Queue a new episode; its first turn decodes under `sampling` (max_new_tokens: the turn's budget)."""
        if episode_id in self.episodes:
            raise ValueError(f"episode {episode_id!r} exists already")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError(f"episode {episode_id!r}: empty prompt")
        self._check_ids(episode_id, prompt)
        if len(prompt) >= self.max_episode_tokens:
            raise ContextOverflowError(f"episode {episode_id!r}: a prompt of {len(prompt)} tokens leaves no room in "
                                       f"max_episode_tokens {self.max_episode_tokens}")
        stops = self._check_turn(episode_id, sampling, stop_sequences)
        seed = sampling.seed if sampling.seed is not None else self.default_seed
        ep = Episode(id=episode_id, key=episode_key(seed, episode_id), sampling=sampling, stop_sequences=stops,
                     stop_ids=self._stop_ids(sampling), tokens=prompt)
        self.episodes[episode_id] = ep
        self.by_prompt.setdefault(tuple(prompt), []).append(ep)
        self.queue.append(ep)

    def resume(self, episode_id: Hashable, new_token_ids: list[int], sampling: SamplingParams | None = None,
               stop_sequences: Iterable[Iterable[int]] | None = None) -> None:
        """Append inserted tokens to a paused episode and queue its next turn (sampling / stop_sequences: the next
        turn's, default the last turn's). Raises ContextOverflowError, leaving the episode paused and unchanged, if
        they leave no room for a sampled token within max_episode_tokens."""
        ep = self._get(episode_id)
        if ep.state != "paused":
            raise ValueError(f"episode {episode_id!r} is {ep.state}, not paused")
        new = [int(t) for t in new_token_ids]
        self._check_ids(episode_id, new)
        total = len(ep.tokens) + len(new)
        if total >= self.max_episode_tokens:
            raise ContextOverflowError(f"episode {episode_id!r}: {len(ep.tokens)} tokens + {len(new)} appended = "
                                       f"{total} leaves no room in max_episode_tokens {self.max_episode_tokens}")
        sampling = sampling or ep.sampling
        stops = self._check_turn(episode_id, sampling, ep.stop_sequences if stop_sequences is None else stop_sequences)
        ep.sampling, ep.stop_sequences, ep.stop_ids = sampling, stops, self._stop_ids(sampling)
        ep.tokens += new
        ep.sampled += [False] * len(new)
        ep.logprobs += [0.0] * len(new)
        ep.versions += [-1] * len(new)
        ep.turn, ep.turn_start, ep.state = ep.turn + 1, len(ep.tokens), "queued"
        self.queue.append(ep)

    def finish(self, episode_id: Hashable) -> Episode:
        """Drop an episode in any state and free its KV blocks; returns it (its tokens, flags, log-probs, versions)."""
        ep = self._get(episode_id)
        if ep.state == "queued":
            self.queue.remove(ep)
        elif ep.state == "running":
            self._release_slots([e is not ep for e in self.running])
        self._drop_kv(ep)
        ep.state = "finished"
        del self.episodes[episode_id]
        key = tuple(ep.tokens[:ep.prompt_len])
        self.by_prompt[key].remove(ep)
        if not self.by_prompt[key]:
            del self.by_prompt[key]
        return ep

    def preempt(self, episode_id: Hashable) -> None:
        """Free a paused or queued episode's KV blocks now (to leave them to `Generator.generate`, or to recompute its
        K/V under new weights); its whole conversation is prefilled again when it next runs."""
        ep = self._get(episode_id)
        if ep.state == "running":
            raise ValueError(f"episode {episode_id!r} is running (a running turn keeps its blocks)")
        self._drop_kv(ep)

    def episode(self, episode_id: Hashable) -> Episode:
        return self._get(episode_id)

    def has_work(self) -> bool:
        """Whether `step` would advance anything (queued or running episodes; paused ones wait for the caller)."""
        return bool(self.queue or self.running)

    # ---- the step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[TurnEvent]:
        """Admit queued episodes (prefill their new tokens, sample each turn's first token), then decode the running
        ones for up to `stop_check_interval` steps (with stops; else until the nearest turn budget, at most the
        runner's ring); returns the turns that ended (those episodes are paused)."""
        events: list[TurnEvent] = []
        self._own_slots()
        self._admit(events)
        if not self.running:
            return events
        runner, live = self.runner, len(self.running)
        # up to the nearest turn's end, or past it by `overrun` (within each turn's reserved blocks and the
        # episode's capacity)
        left = min(min(self._turn_room(ep) + self.overrun, self.max_episode_tokens - len(ep.tokens))
                   for ep in self.running)
        steps = min(left, runner.ring_size)
        if any(ep.stop_ids or ep.stop_sequences or ep.sampling.stop_strings for ep in self.running):
            steps = min(steps, self.gen.config.stop_check_interval)
        width = max(len(ep.table) for ep in self.running)
        sampling = self.running[0].sampling  # every episode's sampler configuration is the same (`_check_turn`)
        for _ in range(steps):
            runner.decode(live, width, sampling)
        toks, lps = runner.read_ring(steps, live)
        for ep, ep_toks, ep_lps in zip(self.running, toks, lps, strict=True):
            self._append_chunk(ep, ep_toks, ep_lps, events)
        self._release_slots([ep.state == "running" for ep in self.running])
        return events

    def _admit(self, events: list[TurnEvent]) -> None:
        """Prefill first, as `Generator.generate` does: admission rounds while queued episodes find slots and blocks,
        so a step decodes every episode it can hold (one round a step kept 1024-token prompts 8 to a round, each
        round decoding its whole turn before the next was admitted: 4x the decode steps on 64 episodes)."""
        while self.queue and self._admit_round(events):
            pass

    def _admit_round(self, events: list[TurnEvent]) -> bool:
        """Move queued episodes into free slots, in order, with their turn's blocks (preempting others for them),
        up to max_prefill_tokens new tokens (one episode at least): one packed prefill. Whether any was admitted."""
        cfg, fresh, resumed, copies, budget = self.gen.config, [], [], [], 0
        for ep in list(self.queue):
            if len(self.running) + len(fresh) + len(resumed) >= cfg.max_num_seqs:
                break
            donor, shared = self._prompt_donor(ep, fresh) if not ep.table else (None, 0)
            n = 1 if donor else len(ep.tokens) - ep.cached  # a preempted episode is prefilled whole
            if (fresh or resumed) and budget + n > cfg.max_prefill_tokens:
                break
            need = blocks_for(min(len(ep.tokens) + ep.sampling.max_new_tokens + self.overrun,
                                  self.max_episode_tokens), self.block_size) - len(ep.table) - shared
            if not self._make_room(need, (ep, donor)):
                break
            if donor is not None:
                self.blocks.incref(donor.table[:shared])
                ep.table = donor.table[:shared] + self.blocks.allocate(need)
                ep.cached = len(ep.tokens) - 1
                if shared * self.block_size < ep.cached:  # positions up to the last one's are in a partial block
                    copies.append((donor.table[shared], ep.table[shared]))
            else:
                ep.table += self.blocks.allocate(need)
            self.queue.remove(ep)
            (resumed if ep.cached else fresh).append(ep)
            budget += n
        if not fresh and not resumed:
            if self.queue and not self.running:
                raise RuntimeError("no queued episode could be admitted (KV cache accounting bug)")
            return False
        bs, rows = self.block_size, []
        if fresh:
            rows.append(self.runner.prefill([ep.tokens for ep in fresh],
                                            [slot_mapping(ep.table, 0, len(ep.tokens), bs) for ep in fresh]))
        self.gen.kv.copy_blocks([c[0] for c in copies], [c[1] for c in copies])  # after the donors' prefill
        if resumed:
            rows.append(self.runner.prefill_cached([ep.tokens[ep.cached:] for ep in resumed],
                                                   [ep.cached for ep in resumed], [ep.table for ep in resumed],
                                                   self.turn_prefill))
        admitted = fresh + resumed
        for ep in admitted:
            ep.cached = len(ep.tokens)
        self._sample_first(admitted, torch.cat(rows), events)
        return True

    def _prompt_donor(self, ep: Episode, fresh: list[Episode]) -> tuple[Episode | None, int]:
        """An episode whose KV holds `ep`'s tokens but the last (its prompt's, or one being prefilled in this round),
        and how many of its blocks `ep` can share: those wholly before the last token, which `ep` prefills itself."""
        last = len(ep.tokens) - 1
        if last == 0:
            return None, 0
        for d in self.by_prompt.get(tuple(ep.tokens), ()):
            if d is not ep and d.table and (d.cached >= last or any(d is f for f in fresh)):
                return d, last // self.block_size
        return None, 0

    def _sample_first(self, admitted: list[Episode], logits: torch.Tensor, events: list[TurnEvent]) -> None:
        """Each admitted episode's first token of the turn from its last prefilled row; those whose turn goes on
        take the next slots."""
        # At least 2 rows (Dynamo specialises a size-1 dimension; see Generator._admit_round): the extra is dropped
        pad = [0] if len(admitted) == 1 else []
        dev = self.gen.device
        rows = logits[list(range(len(admitted))) + pad]
        keys = torch.tensor([ep.key for ep in admitted] + [admitted[0].key] * len(pad), dtype=torch.int64, device=dev)
        positions = torch.tensor([len(ep.tokens) for ep in admitted] + [len(admitted[0].tokens)] * len(pad),
                                 dtype=torch.int64, device=dev)
        first, first_lp = self.runner.sample_fn(rows, keys, positions, admitted[0].sampling,
                                                self.gen.model.token_logprobs)
        first_host, lp_host = first[:len(admitted)].tolist(), first_lp[:len(admitted)].tolist()
        go_on = [ep for ep, tok, lp in zip(admitted, first_host, lp_host, strict=True)
                 if not self._append(ep, tok, lp, events)]
        for ep in go_on:
            ep.state = "running"
        self._set_slots(len(self.running), go_on)
        self.running += go_on

    def _make_room(self, need: int, keep: tuple[Episode | None, ...]) -> bool:
        """Free `need` blocks for a turn if they are not: preempt paused episodes, the most recently paused first,
        then the queued ones behind it (the queue's last first); never those in `keep`."""
        victims = sorted((e for e in self.episodes.values() if e.state == "paused" and e.table),
                         key=lambda e: -e.paused_at)
        victims += [e for e in reversed(self.queue) if e.table]
        for victim in victims:
            if any(victim is k for k in keep):
                continue
            if self.blocks.can_allocate(need):
                break
            self._drop_kv(victim)
            self.preemptions += 1
        return self.blocks.can_allocate(need)

    def _drop_kv(self, ep: Episode) -> None:
        if ep.table:
            self.blocks.release(ep.table)
        ep.table, ep.cached = [], 0

    # ---- per-token bookkeeping ---------------------------------------------------------------------
    def _append_chunk(self, ep: Episode, toks: list[int], lps: list[float], events: list[TurnEvent]) -> None:
        """Record a decode chunk's tokens up to the turn's end (those after it are dropped): `_append` token by token
        where a stop sequence or string may end the turn; else the tokens before the first stop token or the turn's
        room are extended whole and the last one goes through `_append` (64 episodes x 127 tokens: 15-25 ms of host
        time token by token, with the GPU idle, against 0.4 ms; a shared 2-core CPU)."""
        if ep.stop_sequences or ep.sampling.stop_strings:
            for tok, lp in zip(toks, lps, strict=True):
                if self._append(ep, tok, lp, events):
                    return
            return
        n = min(len(toks), self._turn_room(ep))  # the turn's room: its n-th token ends it if nothing before does
        if ep.stop_ids:
            n = next((k + 1 for k in range(n) if toks[k] in ep.stop_ids), n)
        bulk = n - 1  # none of these ends the turn
        ep.tokens += toks[:bulk]
        ep.sampled += [True] * bulk
        ep.logprobs += lps[:bulk]
        ep.versions += [self.policy_version] * bulk
        self._append(ep, toks[bulk], lps[bulk], events)

    def _append(self, ep: Episode, tok: int, lp: float, events: list[TurnEvent]) -> bool:
        """Record a sampled token; at its turn's end pause the episode, add its event and return True."""
        ep.tokens.append(tok)
        ep.sampled.append(True)
        ep.logprobs.append(lp)
        ep.versions.append(self.policy_version)
        reason, stop = self._turn_end(ep, tok)
        if reason is None:
            return False
        ep.state, ep.cached = "paused", len(ep.tokens) - 1  # the last sampled token was never fed
        keep = blocks_for(len(ep.tokens), self.block_size)  # the turn's unused blocks go back
        self.blocks.release(ep.table[keep:])
        del ep.table[keep:]
        self.turns_ended += 1
        ep.paused_at = self.turns_ended
        ep.last_event = TurnEvent(ep.id, ep.turn, ep.tokens[ep.turn_start:], ep.logprobs[ep.turn_start:], reason, stop,
                                  ep.versions[ep.turn_start:])
        events.append(ep.last_event)
        return True

    def _turn_end(self, ep: Episode, tok: int) -> tuple[str | None, int | tuple[int, ...] | str | None]:
        if tok in ep.stop_ids:
            return STOP_TOKEN, tok
        n_turn = len(ep.tokens) - ep.turn_start  # (not a slice of the turn a token: quadratic in its length)
        for seq in ep.stop_sequences:
            if n_turn >= len(seq) and tuple(ep.tokens[-len(seq):]) == seq:
                return STOP_SEQUENCE, seq
        if ep.sampling.stop_strings:
            hit = stop_string_hit(self.gen.tokenizer, ep.turn_tokens, ep.sampling.stop_strings)
            if hit is not None:
                return STOP_STRING, hit
        if n_turn >= ep.sampling.max_new_tokens:
            return LENGTH, None
        if len(ep.tokens) >= self.max_episode_tokens:
            return CONTEXT, None
        return None, None

    def _turn_room(self, ep: Episode) -> int:
        """Tokens the running episode may still sample this turn (>= 1)."""
        return min(ep.sampling.max_new_tokens - len(ep.turn_tokens), self.max_episode_tokens - len(ep.tokens))

    # ---- decode slots ------------------------------------------------------------------------------
    def _set_slots(self, start: int, eps: list[Episode]) -> None:
        """Put episodes in slots start.. : each feeds its last token at its position next."""
        if not eps:
            return
        dev = self.gen.device
        self.runner.set_slots(list(range(start, start + len(eps))),
                              torch.tensor([ep.tokens[-1] for ep in eps], dtype=torch.int64, device=dev),
                              [len(ep.tokens) - 1 for ep in eps], [ep.key for ep in eps],
                              table_tensor([ep.table for ep in eps], self.runner.width, dev))

    def _release_slots(self, live: list[bool]) -> None:
        if all(live):
            return
        self.running, (src, dst) = compact_slots(self.running, live)
        self.runner.move_slots(src, dst)
        self.runner.reset_slots(len(self.running))

    def _own_slots(self) -> None:
        """Restore the running episodes' slots if something else (`Generator.generate`) used them since."""
        if self.runner.slot_owner is not self:
            self.runner.reset_slots(0)
            self._set_slots(0, self.running)
            self.runner.slot_owner = self

    # ---- checks ------------------------------------------------------------------------------------
    def _get(self, episode_id: Hashable) -> Episode:
        if episode_id not in self.episodes:
            raise KeyError(f"no episode {episode_id!r}")
        return self.episodes[episode_id]

    def _check_ids(self, episode_id: Hashable, ids: list[int]) -> None:
        V = self.gen.model.config.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= V):
            raise ValueError(f"episode {episode_id!r}: token ids outside [0, {V})")

    def _check_turn(self, episode_id: Hashable, sampling: SamplingParams,
                    stop_sequences: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
        # every other episode has the same key (this check): one of them stands for all (not O(episodes) a call)
        other = next((ep for ep in self.episodes.values() if ep.id != episode_id), None)
        if other is not None and sampling.sampler_key() != other.sampling.sampler_key():
            raise ValueError(f"episode {episode_id!r}: every episode's temperature / top_p / top_k must be the same "
                             f"(one decode step samples them all), got {sampling.sampler_key()} beside "
                             f"{other.sampling.sampler_key()}")
        if sampling.stop_strings and self.gen.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer (Generator(..., tokenizer=...))")
        stops = tuple(tuple(int(t) for t in s) for s in stop_sequences)
        if any(not s for s in stops):
            raise ValueError(f"episode {episode_id!r}: an empty stop sequence")
        return stops

    def _stop_ids(self, sampling: SamplingParams) -> frozenset[int]:
        eos = frozenset() if sampling.ignore_eos else frozenset(self.gen.eos_token_ids)
        return frozenset(sampling.stop_token_ids) | eos


def run_episodes(engine: EpisodeEngine, prompts: Mapping[Hashable, list[int]], sampling: SamplingParams,
                 environment: Callable[[Episode, TurnEvent], list[int] | None],
                 stop_sequences: Iterable[Iterable[int]] = ()) -> dict[Hashable, Episode]:
    """Drive episodes to their end: add every prompt, step; after each turn `environment(episode, event)` returns
    the tokens to append (the episode resumes) or None (it is finished). An append that overflows the episode
    finishes it too (its last_event says why the last turn ended). Returns the finished episodes by id."""
    stop_sequences = [tuple(s) for s in stop_sequences]
    for episode_id, prompt in prompts.items():
        engine.add(episode_id, prompt, sampling, stop_sequences)
    done: dict[Hashable, Episode] = {}
    while len(done) < len(prompts):
        if not engine.has_work():
            raise RuntimeError("episodes are paused with no turn to run (an environment left one unanswered)")
        for ev in engine.step():
            new = environment(engine.episode(ev.episode_id), ev)
            if new is not None:
                try:
                    engine.resume(ev.episode_id, new)
                    continue
                except ContextOverflowError:
                    pass
            done[ev.episode_id] = engine.finish(ev.episode_id)
    return done
