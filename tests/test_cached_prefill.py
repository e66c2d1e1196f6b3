"""`ModelRunner.prefill_cached` (an episode's next turn appended over its cached prefix) on CPU: the batched varlen
form equals the per-token decode rows it replaced and a plain prefill of each whole sequence, for several sequences
of different prefix and append lengths in one call (fp32 tolerance; bit for bit in batch-invariant mode), its index
layout, its portable attention against a per-sequence reference, and bad input. Tiny random models."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from monorl.generate.attention import CachedPrefillContext, sdpa_cached
from monorl.generate.cache import blocks_for, slot_mapping
from monorl.generate.engine import Engine
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.pack_layout import bucket_size
from tests.test_episodes import generator

# (prefix length, appended length): one-token prefixes and appends, appends within a block, across blocks (8), long
CASES = [(1, 1), (7, 2), (8, 9), (9, 1), (20, 16), (33, 5)]


@pytest.fixture(scope="module")
def model():
    return build_model(model_shape("tiny"), seed=3)


@pytest.fixture(scope="module")
def invariant_model():
    return make_batch_invariant_(build_model(model_shape("tiny-untied"), seed=3))


def three_ways(gen, cases: list[tuple[int, int]], seed: int = 0,
               ways: tuple[str, ...] = ("varlen", "decode", "whole")) -> tuple[torch.Tensor, ...]:
    """Random sequences of (prefix, appended) lengths `cases`; the last-token logits of each, the prefix prefilled
    and the rest appended in one prefill_cached call (varlen; decode rows; any other `turn_prefill` in `ways`), and
    each whole sequence prefilled; then each way's cached K/V of the sequences' tokens, stacked."""
    runner, bs = gen.runner, gen.cache.block_size
    rng = random.Random(seed)
    seqs = [[rng.randrange(2, gen.model.config.vocab_size) for _ in range(p + n)] for p, n in cases]
    out, kv = [], []
    for way in ways:
        tables = [gen.cache.blocks.allocate(blocks_for(len(s), bs)) for s in seqs]
        if way == "whole":
            logits = runner.prefill(seqs, [slot_mapping(t, 0, len(s), bs) for s, t in zip(seqs, tables, strict=True)])
        else:
            runner.prefill([s[:p] for s, (p, _) in zip(seqs, cases, strict=True)],
                           [slot_mapping(t, 0, p, bs) for t, (p, _) in zip(tables, cases, strict=True)])
            logits = runner.prefill_cached([s[p:] for s, (p, _) in zip(seqs, cases, strict=True)],
                                           [p for p, _ in cases], tables, way)
        out.append(logits.float())
        slots = torch.tensor([x for s, t in zip(seqs, tables, strict=True) for x in slot_mapping(t, 0, len(s), bs)])
        kv.append(gen.cache.kv.flatten(2, 3)[:, :, slots.to(gen.device)].float())
    return (*out, torch.stack(kv))


def test_varlen_equals_decode_rows_and_whole_prefill(model):
    varlen, decode, whole, kv = three_ways(generator(model, max_num_seqs=8), CASES)
    assert varlen.shape == (len(CASES), model.config.vocab_size)
    torch.testing.assert_close(varlen, decode, rtol=0, atol=1e-5)
    torch.testing.assert_close(varlen, whole, rtol=0, atol=1e-5)
    torch.testing.assert_close(kv[0], kv[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(kv[0], kv[2], rtol=0, atol=1e-5)


def test_varlen_is_bitwise_in_invariant_mode(invariant_model):
    """A batch-invariant model runs the varlen form as decode rows on its kernel: bitwise a whole prefill's."""
    varlen, decode, whole, kv = three_ways(generator(invariant_model, max_num_seqs=8), CASES)
    assert torch.equal(varlen, decode) and torch.equal(varlen, whole)
    assert torch.equal(kv[0], kv[1]) and torch.equal(kv[0], kv[2])


def test_layout():
    """Block size 4: sequence 0 (table [5, 9]) appends 2 tokens at position 5, sequence 1 (table [3]) one at 1."""
    ctx = CachedPrefillContext.build([[11, 12], [13]], [5, 1], [[5, 9], [3]], 4, torch.device("cpu"), "sdpa")
    assert ctx.slot_mapping.tolist() == [37, 38, 13] and ctx.positions.tolist() == [5, 6, 1]
    assert ctx.cu_seqlens_q.tolist() == [0, 2, 3] and ctx.cu_seqlens_k.tolist() == [0, 7, 9]
    assert ctx.key_slots.tolist() == [20, 21, 22, 23, 36, 37, 38, 12, 13]
    assert ctx.bounds.shape == (2, 7, 0) and ctx.seq_index.tolist() == [0, 0, 1]
    rows = ctx.decode_rows("torch")
    assert rows.block_tables.tolist() == [[5, 9], [5, 9], [3, 0]] and rows.seq_lens.tolist() == [6, 7, 2]
    assert rows.slot_mapping is ctx.slot_mapping and ctx.batch_invariant().backend == "invariant"


def test_static_layout():
    """The layout a CUDA graph replays: block size 4, sequence 0 (table [5, 9]) appends 2 tokens at position 5,
    sequence 1 (table [3]) one at 1. 3 tokens round up to 64 with filler sequences of at most 16 (each its own
    keys, in the scratch block 0), then zero-length entries to 8 sequences; 9 + 61 keys to 64 + pad rows of slot 0
    (a bucket of 64); bounds and table width to powers of two."""
    ctx = CachedPrefillContext.build([[11, 12], [13]], [5, 1], [[5, 9], [3]], 4, torch.device("cpu"), "sdpa",
                                     static=True)
    assert ctx.cu_seqlens_q.tolist() == [0, 2, 3, 19, 35, 51, 64, 64, 64]
    assert ctx.cu_seqlens_k.tolist() == [0, 7, 9, 25, 41, 57, 70, 70, 70]
    assert ctx.slot_mapping[:3].tolist() == [37, 38, 13] and ctx.positions[:3].tolist() == [5, 6, 1]
    assert ctx.positions[3:19].tolist() == list(range(16)) and ctx.positions[51:].tolist() == list(range(13))
    assert ctx.slot_mapping[3:].tolist() == [p % 4 for p in ctx.positions[3:].tolist()]  # the scratch block
    assert ctx.key_slots.shape == (bucket_size(70, 64),) and ctx.key_slots[:9].tolist() == [20, 21, 22, 23, 36, 37,
                                                                                           38, 12, 13]
    assert not ctx.key_slots[70:].any() and ctx.bounds.shape == (16, 16, 0) and ctx.block_tables.shape == (8, 4)
    assert ctx.block_tables[:2].tolist() == [[5, 9, 0, 0], [3, 0, 0, 0]] and not ctx.block_tables[2:].any()


@pytest.mark.parametrize("invariant", [False, True])
def test_static_layout_computes_the_real_rows_as_the_plain_one(model, invariant_model, invariant):
    """The fillers, zero-length entries and unread key rows change no real row: logits and the real tokens' K/V as
    without them (fp32 tolerance; bit for bit in batch-invariant mode), by either attention form."""
    gen = generator(invariant_model if invariant else model, max_num_seqs=8)
    runner, bs = gen.runner, gen.cache.block_size
    rng = random.Random(5)
    seqs = [[rng.randrange(2, gen.model.config.vocab_size) for _ in range(p + n)] for p, n in CASES]
    chunks, starts = [s[p:] for s, (p, _) in zip(seqs, CASES, strict=True)], [p for p, _ in CASES]
    for way in ("varlen", "decode"):
        out, kv = [], []
        for static in (False, True):
            tables = [gen.cache.blocks.allocate(blocks_for(len(s), bs)) for s in seqs]
            runner.prefill([s[:p] for s, (p, _) in zip(seqs, CASES, strict=True)],
                           [slot_mapping(t, 0, p, bs) for t, (p, _) in zip(tables, CASES, strict=True)])
            ctx = CachedPrefillContext.build(chunks, starts, tables, bs, gen.device, "sdpa", static=static)
            ids = [t for c in chunks for t in c]
            ids = torch.tensor(ids + [0] * (ctx.positions.numel() - len(ids)))
            out.append(runner._cached_forward(ctx.cu_seqlens_q.numel() - 1, way, ids, ctx)[:len(CASES)])
            slots = torch.tensor([x for s, t in zip(seqs, tables, strict=True) for x in slot_mapping(t, 0, len(s), bs)])
            kv.append(gen.cache.kv.flatten(2, 3)[:, :, slots].clone())
            gen.cache.blocks.release([b for t in tables for b in t])
        if invariant:
            assert torch.equal(out[0], out[1]) and torch.equal(kv[0], kv[1]), way
        else:
            torch.testing.assert_close(out[1], out[0], rtol=0, atol=1e-5)
            torch.testing.assert_close(kv[1], kv[0], rtol=0, atol=1e-5)


def test_sdpa_cached_is_each_sequences_causal_attention():
    """Grouped heads (4 query, 2 kv); sequence s's n queries are its last n positions of len_k keys."""
    torch.manual_seed(0)
    lens_q, lens_k = [3, 1, 5], [7, 1, 5]
    q = torch.randn(sum(lens_q), 4, 16)
    k, v = torch.randn(sum(lens_k), 2, 16), torch.randn(sum(lens_k), 2, 16)
    cu = [torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32) for x in (lens_q, lens_k)]
    out = sdpa_cached(q, k, v, cu[0], cu[1], 6, 9)  # bounds above the longest runs
    for s, (n, m) in enumerate(zip(lens_q, lens_k, strict=True)):
        qs, ks, vs = (x[c[s]:c[s + 1]].transpose(0, 1) for x, c in ((q, cu[0]), (k, cu[1]), (v, cu[1])))
        mask = torch.arange(m)[None, :] <= torch.arange(m - n, m)[:, None]
        ref = F.scaled_dot_product_attention(qs, ks.repeat_interleave(2, 0), vs.repeat_interleave(2, 0),
                                             attn_mask=mask)
        torch.testing.assert_close(out[cu[0][s]:cu[0][s + 1]], ref.transpose(0, 1), rtol=0, atol=1e-6)


def test_bad_input_is_refused(model):
    gen = generator(model)
    runner = gen.runner
    table = gen.cache.blocks.allocate(1)  # positions 0..7
    with pytest.raises(ValueError, match="non-empty token list"):
        runner.prefill_cached([[3], []], [1, 1], [table, table])
    with pytest.raises(ValueError, match="covers 8 positions"):
        runner.prefill_cached([[3, 4]], [7], [table])
    with pytest.raises(ValueError, match="turn_prefill"):
        runner.prefill_cached([[3]], [1], [table], "eager")
    with pytest.raises(ValueError, match="turn_prefill"):
        Engine(gen, turn_prefill="fast")
    with pytest.raises(ValueError, match="needs the Triton attention kernel"):  # CPU: auto is varlen
        Engine(gen, turn_prefill="paged")
    assert Engine(gen).turn_prefill == "varlen"
    with pytest.raises(ValueError, match="must be one of"):
        CachedPrefillContext.build([[3]], [1], [table], 8, torch.device("cpu"), "triton")
