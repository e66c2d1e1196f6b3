"""The trainer pack's padded Gated DeltaNet on CUDA (`monorl.ops.gated_delta_padded`): fla's non-varlen kernels over
the padded sequence against the varlen paths (fla's varlen conv and rule, or the reference where `rule_path` keeps
fla's backward off), outputs and gradients; and a hybrid's trainer steps replayed from CUDA graphs against ordinary
ones. Needs `fla-core` (the linear-attention extra); the gradient and graph tests need fla's backward
(`gated_delta_padded.capturable`: Triton >= 3.7.1 on Hopper)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from monorl.model.decoder import build_model
from monorl.ops import gated_delta
from monorl.ops import gated_delta_padded as padded
from monorl.train.losses import LossConfig
from monorl.train.trainer import Trainer, TrainerConfig
from tests.test_recurrent_state import HYBRID
from tests.test_trainer_graphs_gpu import _seqs

pytestmark = pytest.mark.gpu

# a hybrid with fla-sized heads (64): two linear layers around a full one, grouped values
WIDE = HYBRID.replace(linear_key_head_dim=64, linear_value_head_dim=64)


@pytest.fixture(autouse=True)
def _needs_fla(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("fla", reason="fla-core is not installed (the linear-attention extra)")
    monkeypatch.setattr(gated_delta, "FLA_ENABLED", True)


def _needs_backward() -> None:
    if not padded.capturable(torch.device("cuda")):
        pytest.skip("fla's backward does not serve here (gated_delta.rule_path: Triton < 3.7.1 on Hopper)")


def _layer_inputs(lengths: list[int], hk: int, dk: int, hv: int, dv: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T, C = sum(lengths), 2 * hk * dk + hv * dv
    mixed = torch.randn(T, C, generator=g, device="cuda").bfloat16()
    weight = torch.randn(C, 4, generator=g, device="cuda") * 0.5
    a = torch.randn(T, hv, generator=g, device="cuda").bfloat16()
    b = torch.randn(T, hv, generator=g, device="cuda").bfloat16()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return mixed, weight, a, b, cu


def _both(mixed, weight, a, b, cu, heads):
    """(padded, varlen) outputs of the conv and the rule, as `qwen3_5.GatedDeltaNet._mix` runs each."""
    hk, dk, hv, dv = heads
    split = (hk * dk, hk * dk, hv * dv)
    g, beta = -F.softplus(a.float()), b.sigmoid()
    layout = padded.padded_layout(cu, mixed.shape[0], weight.shape[1])
    got = padded.padded_conv_rule(mixed, weight, g, beta, layout, split, heads)
    x = gated_delta.packed_causal_conv(mixed, weight, cu)
    q, k, v = x.split(split, dim=-1)
    T = x.shape[0]
    want, _ = gated_delta.gated_delta_rule(q.reshape(T, hk, dk), k.reshape(T, hk, dk), v.reshape(T, hv, dv), g,
                                           beta, cu, None, one_token_each=False)
    return got, want


LENGTHS = [1, 61, 3, 130, 64, 5, 0, 0]


@pytest.mark.parametrize("heads", [(2, 64, 4, 64), (16, 128, 16, 128)])  # grouped values; the 0.8B's
def test_padded_forward_equals_the_varlen_one(heads):
    with torch.no_grad():
        assert padded.serves(*_layer_inputs([4], *heads)[:2])
        got, want = _both(*_layer_inputs(LENGTHS, *heads), heads)
    assert got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("heads", [(2, 64, 4, 64), (16, 128, 16, 128)])
def test_padded_gradients_equal_the_varlen_ones(heads):
    _needs_backward()
    base = _layer_inputs(LENGTHS, *heads, seed=1)
    outs = []
    for which in (0, 1):
        leaves = [t.detach().clone().requires_grad_() if t.is_floating_point() else t for t in base]
        o = _both(*leaves, heads)[which]
        w = torch.randn(o.shape, generator=torch.Generator(device="cuda").manual_seed(5), device="cuda")
        (o.float() * w).sum().backward()
        outs.append([o.float()] + [t.grad.float() for t in leaves[:4]])
    for name, got, want in zip(("o", "mixed", "weight", "a", "b"), *outs, strict=True):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2, msg=lambda m, n=name: f"{n}: {m}")


def _grouped(groups: int, n: int, seed: int) -> list:
    """GRPO's layout: `groups` prompts, n completions each (a pack holds each prompt once: `SharedPrompts`)."""
    seqs = _seqs(groups * n, seed)
    for i, s in enumerate(seqs):
        s.prompt_ids, s.group = list(seqs[i - i % n].prompt_ids), i // n
    return seqs


def test_hybrid_graph_replayed_steps_match_ordinary_steps():
    """As tests/test_trainer_graphs_gpu.py's dense test: shape A, A again (replayed), then B, then shared prompts;
    the same metrics and update as eager steps, every micro-batch a replay."""
    _needs_backward()
    batches = [_seqs(12, 0), _seqs(12, 1), _seqs(5, 2, prompt=90), _grouped(3, 4, 3)]
    runs = []
    for graphs in (False, True):
        model = build_model(WIDE, device="cuda", seed=3)
        tcfg = TrainerConfig(lr=1e-3, eps=1.0, micro_batch_tokens=512, warmup_steps=1, loss=LossConfig(kind="grpo"))
        tr = Trainer(model, tcfg, total_steps=4, attn_backend="flash", cuda_graphs=graphs)
        assert (tr.graphs is not None) == graphs
        init = [p.detach().clone() for p in model.parameters()]
        ms = [tr.step(b) for b in batches]
        runs.append((tr, ms, torch.cat([(p.detach() - a).flatten() for a, p in zip(init, model.parameters(),
                                                                                       strict=True)])))
    (_, plain_m, plain_w), (tr, graph_m, graph_w) = runs
    assert tr.graphs.replays == sum(m["micro_batches"] for m in graph_m) > 0
    assert graph_m[1]["trainer/graph_captures"] == 0  # shape A replayed
    for a, b in zip(plain_m, graph_m, strict=True):
        assert a["micro_batches"] == b["micro_batches"] and a["train_tokens"] == b["train_tokens"]
        for key in ("loss", "pg_loss", "ratio_mean", "logprob_diff_mean", "grad_norm"):
            assert math.isclose(a[key], b[key], rel_tol=2e-2, abs_tol=2e-3), (key, a[key], b[key])
    assert float(plain_w.norm()) > 0
    assert float((graph_w - plain_w).norm() / plain_w.norm()) < 0.05
