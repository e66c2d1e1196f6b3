"""The trainer pack's padded Gated DeltaNet layout (`monorl.ops.gated_delta_padded`): over the references on CPU, the
padded sequence gives each packed sequence's outputs and gradients as the varlen references compute them, and its
length depends only on the pack's row and sequence counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from monorl.ops.gated_delta import causal_conv, chunk_gated_delta_rule
from monorl.ops.gated_delta_padded import RESET_G, padded_conv_rule, padded_layout, padded_rows

HK, DK, HV, DV, K = 2, 8, 4, 8, 4
SPLIT = (HK * DK, HK * DK, HV * DV)


def _inputs(lengths: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    mixed = torch.randn(T, sum(SPLIT), generator=g, dtype=torch.float64)
    weight = torch.randn(sum(SPLIT), K, generator=g, dtype=torch.float64) * 0.5
    a = torch.randn(T, HV, generator=g, dtype=torch.float64)
    b = torch.randn(T, HV, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return mixed, weight, a, b, cu


def _varlen(mixed, weight, a, b, cu):  # the trainer pack's reference path (`qwen3_5.GatedDeltaNet._mix`)
    x, _ = causal_conv(mixed, weight, cu, None)
    q, k, v = x.split(SPLIT, dim=-1)
    T = x.shape[0]
    g, beta = -F.softplus(a), b.sigmoid()
    o, _ = chunk_gated_delta_rule(q.reshape(T, HK, DK), k.reshape(T, HK, DK), v.reshape(T, HV, DV), g, beta, cu)
    return o


def _padded(mixed, weight, a, b, cu):
    layout = padded_layout(cu, mixed.shape[0], K)
    return padded_conv_rule(mixed, weight, -F.softplus(a), b.sigmoid(), layout, SPLIT, (HK, DK, HV, DV), fla=False)


@pytest.mark.parametrize("lengths", [[5], [64], [61, 3, 130, 1, 64, 0, 0], [200, 7, 0]])
def test_padded_layout_computes_each_sequence_as_the_varlen_references_do(lengths: list[int]) -> None:
    """Outputs and the gradients of every input (the references compute in fp32, batching sequences of one chunk
    count: a rounding's difference, so fp32 tolerances): chunk-aligned starts, the conv's zero rows and the reset
    row leave each sequence as it is alone (sequences of 64 and 61 + K - 1 tokens fill their chunks: the reset row
    and the conv's zero rows then take a chunk of their own)."""
    inputs = [t.requires_grad_() if t.is_floating_point() else t for t in _inputs(lengths, seed=sum(lengths))]
    want = _varlen(*inputs)
    got = _padded(*inputs)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    up = torch.randn_like(want)
    grads_want = torch.autograd.grad((want * up).sum(), inputs[:4])
    grads_got = torch.autograd.grad((got * up).sum(), inputs[:4])
    for name, w, g in zip(("mixed", "weight", "a", "b"), grads_want, grads_got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")


def test_a_sequence_after_the_reset_row_starts_from_zero_state() -> None:
    """Without the reset (the span's last row at g = 0) the second sequence continues the first one's state: the
    reset row is what separates sequences, so the equality above rests on it."""
    mixed, weight, a, b, cu = _inputs([70, 40], seed=3)
    assert padded_layout(cu, mixed.shape[0], K).resets.tolist() == [127, 191]  # spans of 128 and 64 rows
    want = _varlen(mixed, weight, a, b, cu)
    kept = padded_layout(cu, mixed.shape[0], K)
    kept.resets = torch.full_like(kept.resets, kept.size - 1)  # no reset between the two
    got = padded_conv_rule(mixed, weight, -F.softplus(a), b.sigmoid(), kept, SPLIT, (HK, DK, HV, DV), fla=False)
    torch.testing.assert_close(got[:70], want[:70])
    assert (got[70:] - want[70:]).abs().max() > 1e-3


def test_the_layout_is_a_function_of_the_pack_shape() -> None:
    """Rows chunk-aligned, at least K - 1 zero rows after each sequence, within `padded_rows` of the pack's rows and
    entries whatever the lengths (the graph's buffers are sized by it)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = int(torch.randint(1, 12, (1,), generator=g))
        lengths = torch.randint(0, 150, (n,), generator=g).tolist()
        T = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        lay = padded_layout(cu, T, K)
        assert lay.size == padded_rows(T, n, K)
        rows = lay.rows.tolist()
        assert len(set(rows)) == T and (max(rows) < lay.size if rows else True)
        for s, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
            if hi == lo:
                assert lay.resets[s] == lay.size - 1
                continue
            first, last = rows[lo], rows[hi - 1]
            assert first % 64 == 0 and rows[lo:hi] == list(range(first, last + 1))
            assert int(lay.resets[s]) >= last + K - 1 and (int(lay.resets[s]) + 1) % 64 == 0
            later = [r for r in rows[hi:] if r > last]
            assert not later or min(later) > lay.resets[s]
    assert RESET_G < -200  # exp underflows to 0 in fp32


@pytest.mark.parametrize("static", [False, True])
def test_a_hybrids_trainer_pack_on_the_padded_layout_equals_the_varlen_one(monkeypatch, static):
    """The model's path (`qwen3_5.GatedDeltaNet._mix`): a pack with shared prompts (copied into each sequence before
    the layout) and, static, zero-length entries; log-probs and every parameter's gradient, the padded layout on
    monorl's references (as fla runs it where it serves) against the varlen references."""
    import functools

    from monorl.model.decoder import build_model
    from monorl.ops import gated_delta_padded
    from monorl.train.packing import make_micro_batches
    from tests.test_recurrent_state import HYBRID
    from tests.test_shared_prompts import _groups, _logprobs

    model = build_model(HYBRID, seed=None).init_weights(1)
    seqs = _groups([4, 3], [70, 5], seed=2)
    (mb,) = make_micro_batches(seqs, 1024, "cpu", static=static)
    assert mb.ctx.shared is not None
    out, calls = {}, []
    on_references = functools.partial(gated_delta_padded.padded_conv_rule, fla=False)
    for laid in (False, True):
        if laid:
            monkeypatch.setattr(gated_delta_padded, "serves", lambda *t: True)
            monkeypatch.setattr(gated_delta_padded, "padded_conv_rule",
                                lambda *a, **k: calls.append(1) or on_references(*a, **k))
        model.zero_grad()
        lp = _logprobs(model, mb)
        (lp * torch.linspace(0.5, 1.5, lp.numel())).sum().backward()
        out[laid] = lp.detach(), [p.grad.clone() for p in model.parameters()]
    assert len(calls) == 3  # each Gated DeltaNet layer of the padded forward
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=1e-5)
    for a, b in zip(out[True][1], out[False][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def test_the_reference_layout_made_in_inference_mode_serves_a_training_forward() -> None:
    """The chunked reference caches its layout by the sequences' bounds: a generator's prefill (inference mode) may
    make it, and a trainer forward with the same bounds then saves its indices for backward."""
    lengths = [37, 5, 66]  # bounds no other test asks for: the cache starts without them
    with torch.inference_mode():
        _varlen(*_inputs(lengths, seed=3))
    inputs = [t.requires_grad_() if t.is_floating_point() else t for t in _inputs(lengths, seed=3)]
    _varlen(*inputs).sum().backward()
    assert all(t.grad is not None for t in inputs if t.is_floating_point())
