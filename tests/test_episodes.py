"""Engine on CPU: an episode decoded with KV reuse across turns equals one whose whole conversation is
prefilled anew at every turn (bit for bit in batch-invariant mode), pauses (stop token / sequence / string, turn
budget, episode capacity), interleaving, context overflow, and block accounting. Tiny random models."""

from __future__ import annotations

import random

import pytest
import torch

from monorl.generate.cache import bytes_per_block, slot_mapping
from monorl.generate.engine import Engine
from monorl.generate.episodes import run_episodes
from monorl.generate.generator import Generator, GeneratorConfig
from monorl.generate.requests import (
    CONTEXT,
    LENGTH,
    STOP_SEQUENCE,
    STOP_STRING,
    STOP_TOKEN,
    ContextOverflowError,
    Request,
    TurnEvent,
)
from monorl.generate.sampling import SamplingParams
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from tests.test_generate import LetterTokenizer

TURNS = 3


@pytest.fixture(scope="module")
def model():
    return build_model(model_shape("tiny"), seed=3)


@pytest.fixture(scope="module")
def invariant_model():
    # the smaller shape: the invariant ops' CPU forms are slow
    return make_batch_invariant_(build_model(model_shape("tiny-untied"), seed=3))


def generator(model, tokenizer=None, **kw) -> Generator:
    cfg = dict(max_num_seqs=4, max_model_len=128, block_size=8)
    cfg.update(kw)
    gen = Generator(model, GeneratorConfig(**cfg), tokenizer=tokenizer, eos_token_ids=(1,))
    if model.__class__ is not gen.model.__class__:  # the generator's copy converted too, as the RL loop does
        make_batch_invariant_(gen.model)
    return gen


def scripted(seed: int, ids: list, vocab: int) -> tuple[dict, dict]:
    """Prompts and, per episode, the token lists its 'environment' inserts after turns 0..TURNS-2."""
    rng = random.Random(seed)
    prompts = {i: [rng.randrange(2, vocab) for _ in range(rng.randint(3, 20))] for i in ids}
    inserts = {i: [[rng.randrange(2, vocab) for _ in range(rng.randint(1, 5))] for _ in range(TURNS - 1)] for i in ids}
    return prompts, inserts


def turn_starts(ep: Request) -> list[int]:
    return [k for k in range(len(ep.tokens)) if ep.sampled[k] and not ep.sampled[k - 1]]


def reprefilled_turn(engine: Engine, ep: Request, start: int, sp: SamplingParams) -> TurnEvent:
    """The turn that starts at tokens[start], from an episode whose prompt is the whole conversation before it."""
    engine.add(ep.id, ep.tokens[:start], sp)
    events: list[TurnEvent] = []
    while not events:
        events = engine.step()
    engine.finish(ep.id)
    return events[0]


@pytest.mark.parametrize("invariant", [True, False])
def test_kv_reuse_equals_reprefill_every_turn(model, invariant_model, invariant):
    m = invariant_model if invariant else model
    gen = generator(m, stop_check_interval=3)  # episodes decode past their stops between checks
    engine = Engine(gen, max_tokens=80)
    free = gen.cache.blocks.num_free()
    prompts, inserts = scripted(0, [0, 1, 2], m.config.vocab_size)
    # frequent stop tokens, so that some turns end on one and the others at the budget
    sp = SamplingParams(max_new_tokens=6, temperature=0.9, seed=5, stop_token_ids=tuple(range(2, 14)))

    def environment(ep: Request, ev: TurnEvent) -> list[int] | None:
        engine.policy_version += 1  # a weight update after every turn
        return inserts[ep.id][ev.turn] if ev.turn < TURNS - 1 else None

    reasons: list[str] = []

    def recording(ep: Request, ev: TurnEvent) -> list[int] | None:
        reasons.append(ev.reason)
        return environment(ep, ev)

    done = run_episodes(engine, prompts, sp, recording)
    assert gen.cache.blocks.num_free() == free
    assert {STOP_TOKEN, LENGTH} <= set(reasons)
    assert max(v for ep in done.values() for v in ep.versions) >= 3  # later turns saw the updates
    for i, ep in done.items():
        starts = turn_starts(ep)
        assert len(starts) == TURNS and ep.tokens[:starts[0]] == prompts[i]
        for t, s in enumerate(starts):
            end = starts[t + 1] - len(inserts[i][t]) if t + 1 < TURNS else len(ep.tokens)
            assert all(ep.sampled[s:end]) and ep.versions[s:end] == sorted(ep.versions[s:end])
            assert ep.versions[s] >= (ep.versions[s - 1] if t else 0)
            if t + 1 < TURNS:
                assert ep.tokens[end:starts[t + 1]] == inserts[i][t] and not any(ep.sampled[end:starts[t + 1]])
                assert ep.versions[end:starts[t + 1]] == [-1] * len(inserts[i][t])
            if t == 0:
                continue  # turn 0 is a plain prefill in both
            ref = reprefilled_turn(engine, ep, s, sp)
            assert ref.token_ids == ep.tokens[s:end], (i, t)
            if invariant:
                assert ref.logprobs == ep.logprobs[s:end], (i, t)
            else:
                torch.testing.assert_close(torch.tensor(ref.logprobs), torch.tensor(ep.logprobs[s:end]),
                                           rtol=0, atol=1e-5)
    assert gen.cache.blocks.num_free() == free


def test_first_turn_is_generates_completion(invariant_model):
    """Request (i, j) draws generate()'s noise for sample j of prompt i: its first turn is that completion."""
    gen = generator(invariant_model)
    prompts, _ = scripted(1, [0, 1], invariant_model.config.vocab_size)
    sp = SamplingParams(max_new_tokens=8, temperature=0.9, seed=7)
    ref = gen.generate([prompts[0], prompts[1]], sp, n=2)
    engine = Engine(gen, max_tokens=64)
    done = run_episodes(engine, {(i, j): prompts[i] for i in range(2) for j in range(2)}, sp, lambda ep, ev: None)
    for (i, j), ep in done.items():
        assert ep.last_event.token_ids == ref[i][j].token_ids
        assert ep.last_event.logprobs == ref[i][j].logprobs


def test_a_step_admits_rounds_until_the_slots_are_full(invariant_model):
    """Prefill first, as generate() does: queued episodes whose prompts exceed one prefill's token budget are admitted
    over several rounds within one step, so every slot decodes from the first step (one round a step decoded each
    round's whole turn before the next was admitted); the tokens are those of one big round."""
    prompts, _ = scripted(2, range(4), invariant_model.config.vocab_size)
    sp = SamplingParams(max_new_tokens=6, temperature=0.9, seed=5, ignore_eos=True)
    out = {}
    for budget in (max(map(len, prompts.values())), 4096):
        engine = Engine(generator(invariant_model, max_prefill_tokens=budget), max_tokens=64)
        for i, p in prompts.items():
            engine.add(i, p, sp)
        ended = engine.step()
        assert not engine.queue and len(engine.running) + len(ended) == 4  # all four admitted in the first step
        while engine.has_work():
            engine.step()
        out[budget] = {i: (engine.request(i).tokens, engine.request(i).last_event.logprobs) for i in prompts}
    assert out[4096] == out[max(map(len, prompts.values()))]


def test_overrun_chunks_keep_the_tokens_and_free_the_blocks(invariant_model):
    """With `overrun` a chunk runs past the nearest turn's end (those tokens dropped): samples of different budgets,
    more than the slots, give generate()'s tokens and log-probs (episode (i, j, tag) keys as (i, j)), in fewer
    engine steps (no stop tokens: chunks are cut by the budgets alone), and every block comes back."""
    prompts, _ = scripted(4, range(3), invariant_model.config.vocab_size)
    budgets = {(i, j): 3 + 5 * i + 2 * j for i in range(3) for j in range(3)}

    def sp(budget: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=budget, temperature=0.9, seed=2, ignore_eos=True)

    steps = {}
    for overrun in (0, 6):
        gen = generator(invariant_model, max_num_seqs=5)
        ref = {k: gen.generate([prompts[k[0]]], sp(b), n=3, first_prompt_index=k[0])[0][k[1]]
               for k, b in budgets.items()}
        engine = Engine(gen, max_tokens=64, overrun=overrun)
        for (i, j), b in budgets.items():
            engine.add((i, j, 7), prompts[i], sp(b))
        n, done = 0, {}
        while engine.has_work():
            n += 1
            for ev in engine.step():
                done[ev.request_id[:2]] = ev
                engine.finish(ev.request_id)
        steps[overrun] = n
        assert {k: ev.token_ids for k, ev in done.items()} == {k: c.token_ids for k, c in ref.items()}
        assert {k: ev.logprobs for k, ev in done.items()} == {k: c.logprobs for k, c in ref.items()}
        assert gen.cache.blocks.num_free() == gen.cache.blocks.usable_blocks
    assert steps[6] < steps[0]


def test_paused_episode_waits_while_others_decode(invariant_model):
    """Request 0 waits for its 'tool' for several steps while 1 and 2 decode on (and a generate() call takes the
    decode slots between two of their steps); every result is that of a run where each episode resumes at once."""
    gen = generator(invariant_model)
    prompts, inserts = scripted(2, [0, 1, 2], invariant_model.config.vocab_size)
    sp = SamplingParams(max_new_tokens=4, temperature=0.9, seed=5)  # eos may stop a turn: one token a step

    def environment(ep: Request, ev: TurnEvent) -> list[int] | None:
        return inserts[ep.id][ev.turn] if ev.turn < TURNS - 1 else None

    engine = Engine(gen, max_tokens=64)
    ref = run_episodes(engine, prompts, sp, environment)
    for i, p in prompts.items():
        engine.add(i, p, sp)
    held, held_steps, others_meanwhile, generated, done = None, 0, 0, False, {}
    while len(done) < 3:
        if held is not None and (held_steps == 6 or not engine.has_work()):
            engine.resume(0, environment(engine.request(0), held))
            held = None
        events = engine.step()
        if held is not None:
            held_steps += 1
            assert engine.request(0).state == "paused" and engine.request(0).cache.table
            if not generated and any(e.state == "running" for e in engine.requests.values()):
                gen.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=0.0))
                generated = True
        for ev in events:
            new = environment(engine.request(ev.request_id), ev)
            if new is None:
                done[ev.request_id] = engine.finish(ev.request_id)
            elif ev.request_id == 0 and ev.turn == 0:
                held, held_steps = ev, 0
            else:
                engine.resume(ev.request_id, new)
            others_meanwhile += held is not None and ev.request_id != 0
    assert generated and others_meanwhile > 0
    for i in range(3):
        assert done[i].tokens == ref[i].tokens
        assert done[i].logprobs == ref[i].logprobs
    assert gen.cache.blocks.num_free() == gen.cache.blocks.usable_blocks


def test_pauses_on_budget_stop_token_sequence_and_string(model):
    tok = LetterTokenizer()
    gen = generator(model, tokenizer=tok)
    engine = Engine(gen, max_tokens=96)
    prompt = scripted(3, [0], model.config.vocab_size)[0][0]
    fixed = dict(temperature=1.0, seed=11, ignore_eos=True)  # seeded: the same tokens every time

    def turn(sp: SamplingParams, stops=()) -> TurnEvent:
        engine.add("x", prompt, sp, stops)
        events: list[TurnEvent] = []
        while not events:
            events = engine.step()
        engine.finish("x")
        [ev] = events
        return ev

    free = turn(SamplingParams(max_new_tokens=12, **fixed))
    assert free.reason == LENGTH and len(free.token_ids) == 12 and free.stop is None
    toks = free.token_ids
    assert len(set(toks)) > 3  # not degenerate
    seq = tuple(toks[4:6])
    cut = next(k for k in range(2, 12) if tuple(toks[k - 2:k]) == seq)
    ev = turn(SamplingParams(max_new_tokens=12, **fixed), [(127, 127, 127), seq])
    assert (ev.reason, ev.stop, ev.token_ids) == (STOP_SEQUENCE, seq, toks[:cut])
    ev = turn(SamplingParams(max_new_tokens=12, stop_token_ids=(toks[5],), **fixed))
    assert (ev.reason, ev.stop, ev.token_ids) == (STOP_TOKEN, toks[5], toks[:toks.index(toks[5]) + 1])
    text = tok.decode(toks)
    stop_str = text[6:8]
    ev = turn(SamplingParams(max_new_tokens=12, stop_strings=(stop_str,), **fixed))
    assert (ev.reason, ev.stop, ev.token_ids) == (STOP_STRING, stop_str, toks[:text.index(stop_str) + 2])
    # a stop only matches within the turn: the prompt's last token does not complete a sequence
    assert (prompt[-1], toks[0]) not in zip(toks, toks[1:], strict=False)
    ev = turn(SamplingParams(max_new_tokens=12, **fixed), [(prompt[-1], toks[0])])
    assert ev.reason == LENGTH
    assert gen.cache.blocks.num_free() == gen.cache.blocks.usable_blocks


def test_resume_overflow_and_full_context(model):
    gen = generator(model)
    engine = Engine(gen, max_tokens=32)
    start = gen.cache.blocks.num_free()
    engine.add(0, list(range(2, 22)), SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    [ev] = engine.step()
    ep = engine.request(0)
    assert ev.reason == LENGTH and len(ep.tokens) == 26 and ep.state == "paused"
    before = list(ep.tokens)
    with pytest.raises(ContextOverflowError, match="26 tokens \\+ 6 appended = 32"):
        engine.resume(0, [5] * 6)
    assert ep.tokens == before and ep.state == "paused" and len(ep.sampled) == len(ep.logprobs) == 26
    engine.resume(0, [5, 6, 7], SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))
    [ev] = engine.step()
    assert ev.reason == CONTEXT and len(ep.tokens) == 32 and len(ev.token_ids) == 3
    with pytest.raises(ContextOverflowError):
        engine.resume(0, [])
    engine.finish(0)
    assert gen.cache.blocks.num_free() == start and not engine.requests
    with pytest.raises(ContextOverflowError, match="no room"):
        engine.add(1, list(range(2, 34)), SamplingParams())


def test_preempted_episodes_recompute_the_same_tokens(invariant_model):
    """A KV cache too small for every episode's turns at once: turns are admitted by preempting paused episodes
    (their conversation prefilled again later), and every episode is the one an ample cache gives, bit for bit."""
    prompts, inserts = scripted(4, range(4), invariant_model.config.vocab_size)
    sp = SamplingParams(max_new_tokens=5, temperature=0.9, seed=2, ignore_eos=True)
    per_block = bytes_per_block(invariant_model.config, 8, torch.float32)

    def run(blocks: int | None) -> dict:
        gen = generator(invariant_model, kv_cache_bytes=blocks and blocks * per_block)
        engine = Engine(gen, max_tokens=64)
        held: list[int] = []

        def environment(ep: Request, ev: TurnEvent) -> list[int] | None:
            assert len(ep.cache.table) == -(-(len(ep.tokens) - 1) // 8)  # a paused episode keeps only its K/V's blocks
            held.append(gen.cache.blocks.usable_blocks - gen.cache.blocks.num_free())
            return inserts[ep.id][ev.turn] if ev.turn < TURNS - 1 else None

        done = run_episodes(engine, prompts, sp, environment)
        assert gen.cache.blocks.num_free() == gen.cache.blocks.usable_blocks
        if blocks:
            assert engine.preemptions > 0 and max(held) <= 10
        return done

    runs = {blocks: run(blocks) for blocks in (None, 11)}  # 11: 10 usable blocks of 8 tokens; an episode reaches 6
    for i in prompts:
        assert runs[11][i].tokens == runs[None][i].tokens
        assert runs[11][i].logprobs == runs[None][i].logprobs


def test_a_group_shares_its_prompts_kv(invariant_model):
    """Episodes with one prompt (a GRPO group; two slots, so the third starts a turn later) share the prompt's
    full blocks, and each is the episode it is alone, bit for bit."""
    prompt = scripted(6, [0], invariant_model.config.vocab_size)[0][0][:3] * 7  # 21 tokens: 2 blocks shared
    inserts = {(0, j): [[2 + j] * (j + 1), [9, 9]] for j in range(3)}
    sp = SamplingParams(max_new_tokens=4, temperature=0.9, seed=4, ignore_eos=True)
    gen = generator(invariant_model, max_num_seqs=2)
    engine = Engine(gen, max_tokens=64)
    tables = []

    def environment(ep: Request, ev: TurnEvent) -> list[int] | None:
        tables.append(list(ep.cache.table))
        return inserts[ep.id][ev.turn] if ev.turn < TURNS - 1 else None

    group = run_episodes(engine, {i: prompt for i in inserts}, sp, environment)
    assert gen.cache.blocks.num_free() == gen.cache.blocks.usable_blocks and not engine.groups
    assert len({tuple(t[:2]) for t in tables}) == 1 and len({t[2] for t in tables}) > 1
    for i in inserts:
        alone = run_episodes(engine, {i: prompt}, sp, environment)[i]
        assert alone.tokens == group[i].tokens and alone.logprobs == group[i].logprobs


def test_a_member_added_after_its_group_began_decoding(invariant_model):
    """A group member added while an earlier one decodes and another still waits for a slot (an environment that
    answers late: #56's 2-thread runs stopped with "group ... has another prompt", the group's prompt being the first
    member's token list, grown by its decoding) joins the group and is the episode it is alone, bit for bit."""
    prompt = scripted(6, [0], invariant_model.config.vocab_size)[0][0][:3] * 5
    sp = SamplingParams(max_new_tokens=40, temperature=0.9, seed=4, ignore_eos=True)
    STOP = [[0] * 8]  # a stop sequence (never sampled here) makes a step decode one token, not the whole turn
    engine = Engine(generator(invariant_model, max_num_seqs=1), max_tokens=64)

    def finish(engine: Engine, done: dict) -> dict:
        while engine.has_work():
            done.update({ev.request_id: ev for ev in engine.step()})
        return done

    for j in range(2):
        engine.add((0, j), prompt, sp, STOP, one_turn=True)
    done = {ev.request_id: ev for ev in engine.step()}  # (0, 0) prefills and decodes, (0, 1) waits for the slot
    assert (0, 0) not in done and engine.groups
    engine.add((0, 2), prompt, sp, STOP, one_turn=True)
    finish(engine, done)
    for j in range(3):
        alone = Engine(generator(invariant_model), max_tokens=64)
        alone.add((0, j), prompt, sp, STOP, one_turn=True)
        ev = finish(alone, {})[(0, j)]
        assert ev.token_ids == done[(0, j)].token_ids and ev.logprobs == done[(0, j)].logprobs


def test_finish_frees_queued_and_running_episodes(model):
    gen = generator(model, max_num_seqs=2)
    engine = Engine(gen, max_tokens=64)
    sp = SamplingParams(max_new_tokens=8, temperature=0.9, seed=1)  # eos may stop a turn: one token a step
    for i, p in scripted(5, range(4), model.config.vocab_size)[0].items():
        engine.add(i, p, sp)
    engine.step()
    states = {e.state for e in engine.requests.values()}
    assert "queued" in states and states & {"running", "paused"}
    engine.preempt(3)
    for i in range(4):
        engine.finish(i)
    assert gen.cache.blocks.num_free() == gen.cache.blocks.usable_blocks and not engine.has_work()


def test_bad_input_is_refused(model):
    engine = Engine(generator(model), max_tokens=64)
    sp = SamplingParams(max_new_tokens=4, temperature=0.9)
    engine.add(0, [2, 3], sp)
    with pytest.raises(ValueError, match="exists"):
        engine.add(0, [2, 3], sp)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add(1, [], sp)
    with pytest.raises(ValueError, match="outside"):
        engine.add(1, [2, 500], sp)
    with pytest.raises(ValueError, match="temperature / top_p / top_k"):
        engine.add(1, [2, 3], SamplingParams(temperature=0.5))
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add(1, [2, 3], SamplingParams(temperature=0.9, stop_strings=("x",)))
    with pytest.raises(ValueError, match="empty stop sequence"):
        engine.add(1, [2, 3], sp, [()])
    with pytest.raises(TypeError, match="request ids"):
        engine.add(1.5, [2, 3], sp)
    with pytest.raises(ValueError, match="queued, not paused"):
        engine.resume(0, [4])
    with pytest.raises(KeyError, match="no request 7"):
        engine.finish(7)
    with pytest.raises(ValueError, match="max_tokens"):
        Engine(generator(model), max_tokens=1000)


def test_prefill_cached_equals_prefill_in_invariant_mode(invariant_model):
    """The runner's piece alone: a prompt's last logits from a plain prefill, and from a prefill of its first part
    then of the rest over the cached prefix, are equal bit for bit."""
    gen = generator(invariant_model)
    runner, bs = gen.runner, gen.cache.block_size
    p = scripted(5, [0], invariant_model.config.vocab_size)[0][0] + [7] * 9
    t1, t2 = gen.cache.blocks.allocate(4), gen.cache.blocks.allocate(4)
    whole = runner.prefill([p], [slot_mapping(t1, 0, len(p), bs)])
    runner.prefill([p[:5]], [slot_mapping(t2, 0, 5, bs)])
    part = runner.prefill_cached([p[5:]], [5], [t2])
    assert torch.equal(whole, part)
    assert torch.equal(gen.cache.kv[:, :, t1], gen.cache.kv[:, :, t2])  # the same keys and values were cached
