import pytest
import torch

from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.logprobs import token_logprobs
from monorl.train.packing import (
    PackShape,
    TrainSequence,
    bucket_size,
    covering_shape,
    make_micro_batches,
    pack,
    plan_micro_batches,
    token_buckets,
    token_share,
)


def _seq(p: int, c: int, start: int = 3) -> TrainSequence:
    return TrainSequence(list(range(start, start + p)), list(range(start + p, start + p + c)), [0.0] * c, 0.5)


def test_buckets_and_plan():
    assert token_buckets(1000)[:3] == (64, 128, 192) and token_buckets(1000)[-3:] == (896, 960, 1000)
    assert [bucket_size(n) for n in (1, 16, 17, 200, 8192, 8193, 8400)] == [16, 16, 32, 208, 8192, 9216, 9216]
    for n in range(1, 20000, 37):  # padding stays within 12.5% above 8 x the smallest bucket
        b = bucket_size(n)
        assert n <= b and (b <= 128 or b <= n * 1.125)
    plan = plan_micro_batches([60, 50, 40, 30, 20], max_tokens=100)
    assert sorted(i for b in plan for i in b) == [0, 1, 2, 3, 4]
    for b in plan:
        assert sum([60, 50, 40, 30, 20][i] for i in b) <= 100
    with pytest.raises(ValueError, match="sequence 1 has 120 tokens"):
        plan_micro_batches([10, 120], max_tokens=100)


def test_pack_layout_is_bucketed_and_unpadded():
    seqs = [_seq(5, 3), _seq(7, 4), _seq(2, 6)]
    (mb,) = make_micro_batches(seqs, max_tokens=64, device="cpu", buckets=(16, 32, 64))
    assert mb.input_ids.numel() == 32 and mb.num_real_tokens == 27
    assert mb.ctx.cu_seqlens.tolist() == [0, 8, 19, 27, 32]  # last segment is the filler
    assert mb.targets.numel() == 13
    # every target is the token right after its logit row
    assert torch.equal(mb.input_ids[mb.logit_index + 1], mb.targets)
    assert mb.seq_ids.tolist() == [0] * 3 + [1] * 4 + [2] * 6


def test_packed_logprobs_equal_per_sequence():
    torch.manual_seed(0)
    model = build_model(model_shape("tiny"), seed=1).eval()
    seqs = [TrainSequence(torch.randint(3, 100, (p,)).tolist(), torch.randint(3, 100, (c,)).tolist(), [0.0] * c, 1.0)
            for p, c in [(5, 3), (9, 7), (3, 1)]]
    mbs = make_micro_batches(seqs, max_tokens=64, device="cpu", buckets=(48, 64))
    assert len(mbs) == 1
    mb = mbs[0]
    with torch.no_grad():
        packed = token_logprobs(model.compute_logits(model(mb.input_ids, mb.ctx.positions, mb.ctx)[mb.logit_index]),
                                mb.targets)
        alone = []
        for s in seqs:
            from monorl.model.attention import VarlenContext

            ids = torch.tensor(s.prompt_ids + s.completion_ids)
            ctx = VarlenContext.from_lengths([len(ids)], "cpu")
            logits = model.compute_logits(model(ids, ctx.positions, ctx))
            p = len(s.prompt_ids)
            alone.append(token_logprobs(logits[p - 1:-1], torch.tensor(s.completion_ids)))
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=0)


def test_static_pack_pads_every_dimension_to_a_bucket():
    seqs = [_seq(5, 3), _seq(7, 4), _seq(2, 6)]
    (mb,) = make_micro_batches(seqs, max_tokens=64, device="cpu", buckets=(16, 32, 64), static=True)
    # 27 real tokens -> 32; max_seqlen 16 (>= 11); fillers of <= 16 tokens; 4 entries padded to 8 with zeros
    assert mb.shape == PackShape(tokens=32, seqs=8, targets=16, max_seqlen=16, full_tokens=32, copies=1)
    assert mb.ctx.cu_seqlens.tolist() == [0, 8, 19, 27, 32, 32, 32, 32, 32]
    assert mb.num_targets == 13 and mb.token_mask.tolist() == [1.0] * 13 + [0.0] * 3
    assert torch.equal(mb.input_ids[mb.logit_index[:13] + 1], mb.targets[:13])
    # another pack of the same bucket sizes has the same static shape (one CUDA graph serves both)
    (mb2,) = make_micro_batches([_seq(9, 2), _seq(4, 9)], max_tokens=64, device="cpu", buckets=(16, 32, 64),
                                static=True)
    assert mb2.shape == mb.shape


def test_static_pack_logprobs_equal_dynamic_pack():
    """Zero-length entries, a larger max_seqlen and padded rows change nothing for the real tokens."""
    torch.manual_seed(0)
    model = build_model(model_shape("tiny"), seed=1).eval()
    seqs = [TrainSequence(torch.randint(3, 100, (p,)).tolist(), torch.randint(3, 100, (c,)).tolist(), [0.0] * c, 1.0)
            for p, c in [(5, 3), (9, 7), (3, 1)]]
    out = []
    for static in (False, True):
        (mb,) = make_micro_batches(seqs, max_tokens=64, device="cpu", static=static)
        with torch.no_grad():
            hidden = model(mb.input_ids, mb.ctx.positions, mb.ctx)
            lp = token_logprobs(model.compute_logits(hidden[mb.logit_index]), mb.targets)
        out.append(lp[: mb.num_targets])
        assert bool(torch.isfinite(lp).all())
    torch.testing.assert_close(out[1], out[0], atol=1e-5, rtol=0)


def _grouped(prompt: int, completion: int, group: int) -> TrainSequence:
    return TrainSequence([1] * prompt, [2] * completion, [0.0] * completion, 1.0, group=group)


def _shares(seqs: list[TrainSequence], ranks: int) -> list[tuple[int, int]]:
    return [(s.start, s.stop) for s in (token_share(seqs, r, ranks) for r in range(ranks))]


def test_token_share_balances_packed_tokens_between_groups() -> None:
    # one long group, three short: by sequence count rank 0 would pack 420 tokens and rank 1 60
    seqs = [_grouped(10, 100, 0)] * 4 + [_grouped(10, 10, g) for g in (1, 2, 3) for _ in range(4)]
    assert _shares(seqs, 2) == [(0, 4), (4, 16)]
    assert _shares(seqs, 4) == [(0, 4), (4, 8), (8, 12), (12, 16)]  # no rank left without a group
    assert _shares(seqs, 1) == [(0, 16)]


def test_token_share_equal_lengths_is_the_even_split() -> None:
    seqs = [_grouped(10, 10, i // 8) for i in range(64)]
    assert _shares(seqs, 4) == [(0, 16), (16, 32), (32, 48), (48, 64)]
    # fewer groups than ranks: cut inside the group, every part packs the prompt once
    one_group = [_grouped(10, 10, 0)] * 16
    assert _shares(one_group, 4) == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_token_share_covers_every_sequence_once() -> None:
    g = torch.Generator().manual_seed(1)
    for ranks in (2, 3, 4):
        seqs = [_grouped(5, int(torch.randint(1, 50, (1,), generator=g)), i // 3) for i in range(20)]
        shares = _shares(seqs, ranks)
        assert shares[0][0] == 0 and shares[-1][1] == 20
        assert all(a[1] == b[0] for a, b in zip(shares, shares[1:], strict=False))
        assert all(lo % 3 == 0 for lo, _ in shares)  # cuts fall between groups



def _shape(**kw) -> PackShape:
    base = {"tokens": 64, "seqs": 8, "targets": 32, "max_seqlen": 32, "full_tokens": 64, "copies": 1}
    return PackShape(**(base | kw))


def test_covering_shape_is_the_cheapest_captured_shape_that_holds_the_pack():
    new = _shape()
    bigger = _shape(tokens=72, full_tokens=72, seqs=16, max_seqlen=64)
    biggest = _shape(tokens=80, full_tokens=80, targets=36)
    assert covering_shape(new, [biggest, bigger], slack=0.25) == bigger
    assert covering_shape(new, [_shape(tokens=96, full_tokens=96)], slack=0.25) is None  # 50% more tokens
    assert covering_shape(new, [_shape(targets=48)], slack=0.25) is None  # 50% more completion rows
    assert covering_shape(new, [_shape(tokens=72, full_tokens=72, max_seqlen=16)], slack=0.25) is None  # smaller
    assert covering_shape(new, [_shape(full_tokens=72, copies=2)], slack=0.25) is None  # a shared layout
    assert covering_shape(new, [bigger], slack=0.0) is None
    assert covering_shape(new, [new], slack=0.0) == new
    # floor: a pack below it may grow by slack * floor (a rank's small last micro-batch into a captured shape)
    assert covering_shape(new, [_shape(tokens=96, full_tokens=96)], slack=0.25, floor=160) is not None  # +32 <= 40
    assert covering_shape(new, [_shape(tokens=112, full_tokens=112)], slack=0.25, floor=160) is None  # +48 > 40


@pytest.mark.parametrize("share", [False, True])
def test_a_pack_padded_to_a_covering_shape_trains_as_its_own(share):
    """Padded to a captured larger shape (`pack(shape=...)`): more filler tokens, sequence entries, rows and copy
    columns, and a larger max_seqlen. In batch-invariant mode the real tokens' log-probs are bit for bit the bucketed
    pack's; the gradients of a weighted sum of them to fp32 rounding (the backward sums over more rows)."""
    torch.manual_seed(0)
    model = build_model(model_shape("tiny"), seed=1)
    make_batch_invariant_(model)
    prompt = torch.randint(3, 100, (9,)).tolist()
    seqs = [TrainSequence(prompt if share else torch.randint(3, 100, (9,)).tolist(),
                          torch.randint(3, 100, (c,)).tolist(), [0.0] * c, 1.0) for c in (3, 7, 5)]
    (mb,) = make_micro_batches(seqs, max_tokens=512, device="cpu", static=True)
    sh = mb.shape
    big = PackShape(tokens=sh.tokens + 32, seqs=2 * sh.seqs, targets=sh.targets + 16, max_seqlen=2 * sh.max_seqlen,
                    full_tokens=sh.full_tokens + 32, copies=2 * sh.copies if share else 1)
    (padded,) = make_micro_batches(seqs, max_tokens=512, device="cpu", static=True, cover=lambda _: big)
    assert padded.shape == big and (padded.ctx.shared is not None) == share
    assert padded.num_targets == mb.num_targets and padded.token_mask[padded.num_targets:].abs().sum() == 0
    weights = torch.linspace(0.5, 1.5, mb.num_targets)
    out = []
    for m in (mb, padded):
        model.zero_grad()
        hidden = model(m.input_ids, m.ctx.positions, m.ctx)
        lp = token_logprobs(model.compute_logits(hidden[m.logit_index]), m.targets)[: m.num_targets]
        (lp * weights).sum().backward()
        out.append((lp.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(out[0][0], out[1][0])
    for a, b in zip(out[0][1], out[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def test_a_pack_that_cannot_take_a_shape_keeps_its_own():
    seqs = [_seq(5, 3), _seq(7, 4), _seq(2, 6)]
    buckets = (16, 32, 64)
    (mb,) = make_micro_batches(seqs, max_tokens=64, device="cpu", buckets=buckets, static=True)
    with pytest.raises(ValueError, match="does not fit"):  # 27 tokens into 16
        pack(seqs, [0, 1, 2], buckets, "cpu", static=True, shape=_shape(tokens=16, full_tokens=16, max_seqlen=16))
    # too few sequence entries for the fillers the layout needs: make_micro_batches keeps the bucketed pack
    few = _shape(seqs=4, targets=16, max_seqlen=16)
    with pytest.raises(ValueError, match="took"):
        pack(seqs, [0, 1, 2], buckets, "cpu", static=True, shape=few)
    (kept,) = make_micro_batches(seqs, max_tokens=64, device="cpu", buckets=buckets, static=True,
                                 cover=lambda _: few)
    assert kept.shape == mb.shape
