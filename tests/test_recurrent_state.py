"""The engine's recurrent state (`monorl.generate.recurrent_state.RecurrentState`) on a hybrid tiny Qwen3.5 model,
CPU: the generator's tokens and log-probs equal the trainer-side forward on the same tokens; an episode continued
from its kept state equals its conversation prefilled anew; a prompt group's samples start from the prompt's state;
the cache's sizing and row accounting."""

from __future__ import annotations

import pytest
import torch

from monorl.generate.cache import Cache, kv_cache_bytes_needed
from monorl.generate.engine import Engine
from monorl.generate.episodes import run_episodes
from monorl.generate.recurrent_state import KIND, RecurrentState
from monorl.generate.requests import Request, TurnEvent
from monorl.generate.sampling import SamplingParams
from monorl.model.config import ModelConfig
from monorl.model.decoder import build_model
from tests.test_episodes import generator, reprefilled_turn, scripted, turn_starts

HYBRID = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=16, rope_theta=10000.0, max_position_embeddings=1024).with_family("qwen3_5_text").replace(
    layer_types=("linear_attention", "full_attention", "linear_attention", "linear_attention"),
    partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8)
# its MoE (Qwen3.5-MoE): every MLP 8 experts, top-2, and a shared expert
HYBRID_MOE = HYBRID.with_family("qwen3_5_moe_text", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                norm_topk_prob=True, shared_expert_intermediate_size=32)


@pytest.fixture(scope="module", params=[HYBRID, HYBRID_MOE], ids=["dense", "moe"])
def model(request):
    return build_model(request.param, seed=None).init_weights(3, std=0.2)


def trainer_logprobs(model, tokens: list[int], start: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and log p of tokens[start:] from one varlen forward over the whole sequence."""
    logits = model.logits_for([tokens])[0][start - 1:-1]
    lp = torch.log_softmax(logits.float(), dim=-1)
    return logits.argmax(-1).tolist(), lp.gather(1, torch.tensor(tokens[start:])[:, None])[:, 0].tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generator_equals_the_trainer_forward(model, temperature):
    """Prompts of several blocks and chunk sizes, n = 2 samples sharing each prompt's state (one exactly a block)."""
    gen = generator(model, max_num_seqs=6)
    prompts = [[5 + i % 100 for i in range(n)] for n in (8, 13, 70)]
    sp = SamplingParams(max_new_tokens=20, temperature=temperature, seed=11, ignore_eos=True)
    for prompt, samples in zip(prompts, gen.generate(prompts, sp, n=2), strict=True):
        for c in samples:
            greedy, lps = trainer_logprobs(model, prompt + c.token_ids, len(prompt))
            if temperature == 0:
                assert c.token_ids == greedy
            else:
                # fp32; the generator's copy fuses the projections (one GEMM where the trainer runs four): up to
                # 1.06e-4 apart on a 2-core CPU at these weights (std 0.2), 1e-4 before the fusion
                torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(lps), rtol=0, atol=3e-4)
        if temperature:  # the two samples differ: each continued its own copy of the prompt's state
            assert samples[0].token_ids != samples[1].token_ids


@pytest.mark.parametrize("stop_check_interval", [1, 3])
def test_episode_turns_continue_the_kept_state(model, stop_check_interval):
    """Each later turn (its inserted tokens prefilled from the kept state, or recomputed after a decode that ran past
    its stop) equals the turn sampled after prefilling the whole conversation anew."""
    gen = generator(model, stop_check_interval=stop_check_interval)
    engine = Engine(gen, max_tokens=100)
    free = gen.cache.blocks.num_free()
    prompts, inserts = scripted(0, [0, 1, 2], HYBRID.vocab_size)
    sp = SamplingParams(max_new_tokens=6, temperature=0.9, seed=5, stop_token_ids=tuple(range(2, 14)))

    def environment(ep: Request, ev: TurnEvent) -> list[int] | None:
        return inserts[ep.id][ev.turn] if ev.turn < len(inserts[ep.id]) else None

    done = run_episodes(engine, prompts, sp, environment)
    for ep in done.values():
        starts = turn_starts(ep)
        for t, s in enumerate(starts[1:], start=1):
            end = starts[t + 1] - len(inserts[ep.id][t]) if t + 1 < len(starts) else len(ep.tokens)
            ref = reprefilled_turn(engine, ep, s, sp)
            assert ref.token_ids == ep.tokens[s:end], (ep.id, t)
            torch.testing.assert_close(torch.tensor(ref.logprobs), torch.tensor(ep.logprobs[s:end]), rtol=0,
                                       atol=1e-4)
    assert gen.cache.blocks.num_free() == free
    kind = next(k for k in gen.cache.kinds if isinstance(k, RecurrentState))
    assert len(kind.free_rows) == kind.rows - 1 and not kind.prefix_rows  # every row back


def test_rows_run_out_before_blocks_preempt_paused_episodes(model):
    """max_num_seqs=1: 3 state rows (one scratch) for 6 episodes pausing at each turn, blocks to spare. A turn that
    finds no row free preempts a paused episode (recomputed later, as for blocks), and every turn still equals
    the conversation prefilled anew."""
    gen = generator(model, max_num_seqs=1, kv_cache_bytes=1 << 22)
    kind = next(k for k in gen.cache.kinds if isinstance(k, RecurrentState))
    assert kind.rows == 3 and gen.cache.blocks.usable_blocks > 6 * 16  # the rows, not the blocks, bind
    engine = Engine(gen, max_tokens=100)
    prompts, inserts = scripted(1, list(range(6)), HYBRID.vocab_size)
    sp = SamplingParams(max_new_tokens=5, temperature=0.9, seed=2, stop_token_ids=tuple(range(2, 14)))

    def environment(ep: Request, ev: TurnEvent) -> list[int] | None:
        return inserts[ep.id][ev.turn] if ev.turn < len(inserts[ep.id]) else None

    done = run_episodes(engine, prompts, sp, environment)
    assert engine.preemptions > 0
    for ep in done.values():
        starts = turn_starts(ep)
        for t, s in enumerate(starts[1:], start=1):
            end = starts[t + 1] - len(inserts[ep.id][t]) if t + 1 < len(starts) else len(ep.tokens)
            ref = reprefilled_turn(engine, ep, s, sp)
            assert ref.token_ids == ep.tokens[s:end], (ep.id, t)
    assert len(kind.free_rows) == kind.rows - 1


def test_allocated_bytes_are_the_planned_bytes(model):
    """The generator's default cache (the plan's KV row, `kv_cache_bytes_needed`) allocates exactly what the plan
    counts, and a larger budget buys blocks, not state rows."""
    gen = generator(model, max_num_seqs=3)
    assert gen.cache.allocated_bytes() == gen.kv_bytes_needed()
    assert gen.kv_bytes_needed() == kv_cache_bytes_needed(HYBRID, 3, 128, 8, torch.float32)
    big = generator(model, max_num_seqs=3, kv_cache_bytes=4 * gen.kv_bytes_needed())
    assert big.cache.num_blocks > 3 * gen.cache.num_blocks
    assert [k.rows for k in big.cache.kinds if isinstance(k, RecurrentState)] == [2 * 3 + 1]
    assert big.cache.allocated_bytes() <= 4 * gen.kv_bytes_needed()


def test_sizing_counts_state_rows():
    per_seq = RecurrentState(HYBRID, [0, 2, 3]).bytes_per_sequence(torch.float32)
    conv_dim = 2 * 2 * 8 + 4 * 8
    assert per_seq == 3 * (3 * conv_dim * 4 + 4 * 8 * 8 * 4) + 8
    per_seq -= 8
    paged_only = HYBRID.replace(layer_types=("full_attention",) * 4, linear_conv_kernel_dim=0)
    base = kv_cache_bytes_needed(paged_only, 4, 64, 8, torch.float32)
    with_rows = kv_cache_bytes_needed(HYBRID, 4, 64, 8, torch.float32)
    blocks = 4 * 8 + 1
    # one full-attention layer of four, each block's row-map entry, 2 x 4 + 1 rows (each with its `covered` count)
    assert with_rows == base // 4 + blocks * 8 + 9 * (per_seq + 8)


def test_rows_follow_sequences():
    with pytest.raises(ValueError, match="needs max_num_seqs"):
        Cache(HYBRID, 9, 8, torch.device("cpu"), torch.float32)
    cache = Cache(HYBRID, 9, 8, torch.device("cpu"), torch.float32, max_num_seqs=2)
    kind = next(k for k in cache.kinds if isinstance(k, RecurrentState))
    from monorl.generate.cache import SequenceState

    a, b = SequenceState(), SequenceState()
    cache.extend(a, 2)
    prefix = cache.allocate_prefix(1)
    cache.share(b, prefix)
    assert len({a.kind_state[KIND], b.kind_state[KIND], kind.prefix_rows[prefix[0]]}) == 3
    assert kind.row_of_block[a.table].tolist() == [a.kind_state[KIND]] * 2
    kind.covered[a.kind_state[KIND]] = 5
    cache.trim(a, 5)
    assert a.table  # its state covers its positions: kept
    cache.trim(a, 4)
    assert not a.table and KIND not in a.kind_state  # it does not: freed, to be recomputed
    cache.free(b)
    cache.release_prefix(prefix)
    assert len(kind.free_rows) == 4 and cache.can_extend(1, 4) and not cache.can_extend(1, 5)
