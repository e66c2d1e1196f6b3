"""Batch-invariant mode on a hybrid (Qwen3.5's Gated DeltaNet, `monorl.ops.gated_delta_invariant`), CPU: the
generator's sampled-token log-probs equal the trainer's bit for bit, with prompts and generations crossing several
chunk boundaries (a small chunk here), groups of samples, and an episode's later turns prefilled over the kept
state; the rule's pieces (a pack, token-by-token decode, a resumed prefill) compute each token alike; the mode's
rows are counted in the plan."""

from __future__ import annotations

import pytest
import torch

from monorl.generate.cache import kv_cache_bytes_needed
from monorl.generate.engine import Engine
from monorl.generate.episodes import run_episodes
from monorl.generate.generator import Generator, GeneratorConfig
from monorl.generate.recurrent_state import RecurrentState
from monorl.generate.sampling import SamplingParams
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.decoder import build_model
from monorl.ops import gated_delta_invariant
from monorl.ops.gated_delta import chunk_gated_delta_rule
from monorl.ops.gated_delta_invariant import invariant_decode, invariant_rule
from monorl.train.packing import TrainSequence, make_micro_batches
from monorl.train.trainer import Trainer, TrainerConfig
from tests.test_episodes import TURNS, generator, reprefilled_turn, scripted, turn_starts
from tests.test_families import prompts_of, rollouts, scaled_model, trainer_logprobs
from tests.test_qwen3_5 import _inputs
from tests.test_recurrent_state import HYBRID, HYBRID_MOE

C = 8  # the mode's chunk here: prompts and generations of ~20-40 tokens cross several boundaries


@pytest.fixture(autouse=True)
def small_chunk(monkeypatch):
    monkeypatch.setattr(gated_delta_invariant, "CHUNK", C)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see tests/test_parity_everywhere.py: tiny tensors, shared CPU
    yield
    torch.set_num_threads(threads)


def test_decode_and_resumed_prefill_compute_each_token_as_the_pack():
    q, k, v, g, beta, cu, _ = _inputs([1, 21, 0, 16, 5])
    o, states, _, kept_len = invariant_rule(q, k, v, g, beta, cu)
    ref, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu, chunk=C)
    assert (o - ref).abs().max().item() < 1e-5  # the default reference's algorithm, in another order
    assert kept_len == [1, 5, 0, 0, 5]
    one = [t[1:22] for t in (q, k, v, g, beta)]
    for cut in (3, 8, 13):  # a prefill mid-chunk, at a boundary; then decode steps, or a resumed prefill
        head = [t[:cut] for t in one]
        o_head, state, kept, n = invariant_rule(*head, torch.tensor([0, cut]))
        outs = [o_head]
        st, kp = state, kept
        for t in range(cut, 21):
            o_t, st, kp = invariant_decode(*[x[t:t + 1] for x in one], st, kp, torch.tensor([t]))
            outs.append(o_t)
        assert torch.equal(torch.cat(outs), o[1:22]), cut
        assert torch.equal(st[0], states[1]) and 21 % C == 5
        o_rest, st, _, n_after = invariant_rule(*[t[cut:] for t in one], torch.tensor([0, 21 - cut]), state,
                                                kept, n)
        assert torch.equal(torch.cat([o_head, o_rest]), o[1:22]) and torch.equal(st[0], states[1])
        assert n_after == [5]


@pytest.fixture(scope="module", params=[HYBRID, HYBRID_MOE], ids=["dense", "moe"])
def model(request):
    return make_batch_invariant_(scaled_model(request.param, seed=2))


def test_generator_equals_the_trainer_bitwise(model):
    prompts = prompts_of([5, 19, 8], HYBRID.vocab_size, seed=4)  # inside one chunk, past two, exactly one
    sp = SamplingParams(max_new_tokens=14, temperature=0.9, seed=1)
    seqs = rollouts(model, prompts, sp, batch_invariant=True)  # n = 2 samples a prompt, sharing its state row
    assert len({tuple(s.completion_ids) for s in seqs}) == len(seqs)
    for s, lp in zip(seqs, trainer_logprobs(model, seqs, 0.9), strict=True):
        assert torch.equal(torch.tensor(s.old_logprobs, dtype=torch.float32), lp)


def test_the_mode_computes_the_default_models_logprobs():
    plain = scaled_model(HYBRID, seed=2)
    seqs = [list(range(3, 40))]
    torch.testing.assert_close(make_batch_invariant_(scaled_model(HYBRID, seed=2)).logits_for(seqs)[0],
                               plain.logits_for(seqs)[0], rtol=0, atol=1e-4)


def test_episode_turns_resumed_over_the_kept_state_equal_the_trainer_bitwise(model):
    """Each later turn prefills its inserted tokens over the kept state (mid-chunk: the kept rows recomputed); its
    log-probs equal the trainer's on the whole conversation, and the turn sampled after prefilling it anew."""
    gen = generator(model)
    engine = Engine(gen, max_tokens=100)
    prompts, inserts = scripted(0, [0, 1, 2], HYBRID.vocab_size)
    sp = SamplingParams(max_new_tokens=6, temperature=0.9, seed=5)
    done = run_episodes(engine, prompts, sp,
                        lambda ep, ev: inserts[ep.id][ev.turn] if ev.turn < TURNS - 1 else None)
    seqs, sampled = [], []
    for i, ep in done.items():
        starts = turn_starts(ep)
        assert len(ep.tokens) > 2 * C and any(s % C for s in starts[1:])
        for t, s in enumerate(starts[1:], start=1):
            end = starts[t + 1] - len(inserts[i][t]) if t + 1 < TURNS else len(ep.tokens)
            ref = reprefilled_turn(engine, ep, s, sp)
            assert ref.token_ids == ep.tokens[s:end] and ref.logprobs == ep.logprobs[s:end], (i, t)
        p = starts[0]
        seqs.append(TrainSequence(ep.tokens[:p], ep.tokens[p:], [0.0] * (len(ep.tokens) - p), 0.0))
        sampled.append((torch.tensor(ep.sampled[p:]), torch.tensor(ep.logprobs[p:], dtype=torch.float32)))
    for (mask, lps), lp in zip(sampled, trainer_logprobs(model, seqs, 0.9), strict=True):
        assert torch.equal(lps[mask], lp[mask])


def test_the_modes_rows_are_planned_and_allocated(model):
    gen = generator(model, max_num_seqs=3)
    kind = next(k for k in gen.cache.kinds if isinstance(k, RecurrentState))
    assert kind.batch_invariant and kind.kept[0].shape[2] == C
    assert gen.cache.allocated_bytes() == gen.kv_bytes_needed() == kv_cache_bytes_needed(
        HYBRID, 3, 128, 8, torch.float32, batch_invariant=True)
    default = RecurrentState(HYBRID, [0, 2, 3]).bytes_per_sequence(torch.float32)
    per_layer = C * ((2 * 8 + 4 * 8) * 4 + 2 * 4 * 4)  # k (2 heads of 8), v (4 of 8), g and beta (4 heads), fp32
    assert kind.bytes_per_sequence(torch.float32) == default + 3 * per_layer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cfg", [HYBRID, HYBRID_MOE], ids=["dense", "moe"])
def test_generator_equals_the_trainer_bitwise_on_cuda(monkeypatch, cfg):
    """The same on CUDA (no fla in the mode): the bf16 generator (decode from CUDA graphs) against the trainer's
    packs (fp32 masters under its autocast), the real chunk of 64, prompts and generations across chunks."""
    monkeypatch.setattr(gated_delta_invariant, "CHUNK", 64)
    model = make_batch_invariant_(build_model(cfg, "cuda", torch.float32, seed=None).init_weights(3, std=0.2))
    gen = Generator(model, GeneratorConfig(max_num_seqs=6, max_model_len=512, kv_cache_bytes=1 << 28))
    make_batch_invariant_(gen.model)  # as the RL loop converts both sides
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, HYBRID.vocab_size, (n,), generator=g).tolist() for n in (5, 64, 130, 17, 70)]
    sp = SamplingParams(max_new_tokens=70, temperature=1.0, seed=7, ignore_eos=True)
    out = gen.generate(prompts, sp, n=2)
    seqs = [TrainSequence(p, c.token_ids, c.logprobs, 0.0) for p, cs in zip(prompts, out, strict=True) for c in cs]
    for budget in (256, 4096):  # one sequence a pack, all in one
        tr = Trainer(model, TrainerConfig(micro_batch_tokens=budget), total_steps=1)
        for mb in make_micro_batches(seqs, budget, "cuda"):
            with torch.no_grad():
                lp = tr.response_logprobs(model, mb, 1.0)
            mask = mb.token_mask > 0
            assert torch.equal(lp[mask], mb.old_logprobs[mask]), budget
