"""Trainer CUDA graphs on CUDA: static packs through flash varlen, and graph-replayed steps that match
the ordinary steps (same metrics and update, to bf16/atomic-order tolerance)."""

import math

import pytest
import torch

from monorl.compile import CompileConfig, compile_blocks
from monorl.model.attention import VarlenContext
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.train.losses import LossConfig
from monorl.train.packing import TrainSequence
from monorl.train.trainer import Trainer, TrainerConfig

pytestmark = pytest.mark.gpu


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def test_flash_varlen_with_zero_length_entries_and_larger_max_seqlen():
    """What a static pack hands flash: trailing zero-length sequences and a max_seqlen above the longest
    one. Outputs and gradients of the real tokens must equal the exact layout's."""
    _need_cuda()
    torch.manual_seed(0)
    lengths = [37, 5, 90, 1, 64]
    T, H, Hkv, D = sum(lengths), 8, 4, 128
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(T, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(T, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    outs = []
    for ctx in (VarlenContext.from_lengths(lengths, "cuda", "flash"),
                VarlenContext.from_lengths(lengths + [0, 0, 0], "cuda", "flash", max_seqlen=256)):
        q.grad = k.grad = v.grad = None
        o = ctx.attend(q, k, v)
        (o.float() * w).sum().backward()
        outs.append([o.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()])
    for a, b in zip(*outs, strict=True):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, atol=2e-2, rtol=2e-2)


def _seqs(n: int, seed: int, prompt: int = 40, completion: int = 30) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, c = prompt + (i * 7) % 11, completion + (i * 5) % 13
        out.append(TrainSequence(torch.randint(3, 120, (p,), generator=g).tolist(),
                                 torch.randint(3, 120, (c,), generator=g).tolist(),
                                 (-torch.rand(c, generator=g) * 3 - 2).tolist(), advantage=float(i % 3 - 1)))
    return out


@pytest.mark.parametrize("backend", ["none", "inductor"])
@pytest.mark.parametrize("kind", ["grpo", "token_grpo"])
def test_graph_replayed_steps_match_ordinary_steps(tmp_path, backend, kind):
    _need_cuda()
    from monorl.compile import setup_compile_cache

    cc = CompileConfig(backend=backend, cache_dir=str(tmp_path / "cache"))
    setup_compile_cache(cc)
    batches = [_seqs(12, 0), _seqs(12, 1), _seqs(5, 2, prompt=90)]  # shape A, A again (replay), then B
    runs = []
    for graphs in (False, True):
        model = build_model(model_shape("tiny"), device="cuda", seed=3)
        compile_blocks(model, cc)
        # eps 1: Adam's update ~ lr * grad, so bf16 noise between the two pack layouts cannot flip the sign of
        # a near-zero gradient's whole step (which plain Adam's first steps would do)
        tcfg = TrainerConfig(lr=1e-3, eps=1.0, micro_batch_tokens=512, warmup_steps=1, loss=LossConfig(kind=kind))
        tr = Trainer(model, tcfg, total_steps=4, attn_backend="flash", cuda_graphs=graphs)
        tr.warm_up(list(range(3, 43)), num_seqs=12, completion_len=30)
        init = [p.detach().clone() for p in model.parameters()]
        ms, captured = [], []
        for b in batches:
            ms.append(tr.step(b))
            captured.append(len(tr.graphs.graphs) if tr.graphs else 0)
        runs.append((tr, ms, torch.cat([(p.detach() - a).flatten() for a, p in zip(init, model.parameters(),
                                                                                       strict=True)])))
    (_, plain_m, plain_w), (tr, graph_m, graph_w) = runs
    assert tr.graphs is not None
    assert tr.graphs.replays == sum(m["micro_batches"] for m in graph_m)  # every micro-batch was a replay
    assert captured[1] == captured[0] < captured[2]  # A's shapes recur in step 2 (no capture); B's are new
    # each step reports the graphs it captured (the first also the warm-up's: nothing read them before it)
    assert [m["trainer/graph_captures"] for m in graph_m] == [captured[0], 0, captured[2] - captured[1]]
    assert graph_m[1]["time/graph_capture_s"] == 0 < graph_m[2]["time/graph_capture_s"]
    assert all("trainer/graph_captures" not in m for m in plain_m)
    for a, b in zip(plain_m, graph_m, strict=True):
        assert a["micro_batches"] == b["micro_batches"] and a["train_tokens"] == b["train_tokens"]
        for key in ("loss", "pg_loss", "ratio_mean", "logprob_diff_mean", "logprob_diff_max", "grad_norm"):
            assert math.isclose(a[key], b[key], rel_tol=2e-2, abs_tol=2e-3), (key, a[key], b[key])
    # the same update, up to bf16 differences between the two layouts' GEMM shapes
    assert float(plain_w.norm()) > 0
    assert float((graph_w - plain_w).norm() / plain_w.norm()) < 0.05
    # the gradient buffers stay the graphs' own (zeroed, not freed) between steps
    assert all(p.grad is g for p, g in zip(tr.graphs.params, tr.graphs.grads, strict=True))
    assert all(float(g.abs().max()) == 0.0 for g in tr.graphs.grads)


def test_a_slightly_smaller_pack_replays_a_captured_graph():
    """`trainer.graph_pad_slack`: a step whose pack is a little smaller than a captured shape is padded to it and
    replays that graph (no capture); with slack 0 it captures its own. The two steps' metrics agree."""
    _need_cuda()
    batches = [_seqs(12, 0), _seqs(12, 1, completion=26)]
    runs = {}
    for slack in (0.25, 0.0):
        model = build_model(model_shape("tiny"), device="cuda", seed=3)
        tcfg = TrainerConfig(lr=1e-3, eps=1.0, micro_batch_tokens=512, warmup_steps=1, graph_pad_slack=slack)
        tr = Trainer(model, tcfg, total_steps=4, attn_backend="flash", cuda_graphs=True)
        runs[slack] = [tr.step(b) for b in batches]
    assert runs[0.25][1]["trainer/graph_captures"] == 0 < runs[0.0][1]["trainer/graph_captures"]
    for key in ("loss", "pg_loss", "logprob_diff_mean", "grad_norm", "train_tokens", "micro_batches"):
        a, b = runs[0.25][1][key], runs[0.0][1][key]
        assert math.isclose(a, b, rel_tol=2e-2, abs_tol=2e-3), (key, a, b)


def test_a_graph_replayed_teacher_forward_equals_the_eager_one():
    """Distillation's teacher forward, replayed from a graph per pack shape where the student's step has graphs
    (monorl.train.frozen.frozen_forward), gives the eager forward's log-probs bit for bit (batch-invariant
    model), for two packs of one shape replaying the same graph, and the step runs on them."""
    _need_cuda()
    from monorl.model.batch_invariant import make_batch_invariant_
    from monorl.train.frozen import fill_frozen_logprobs, frozen_forward

    student = build_model(model_shape("tiny"), "cuda", torch.float32, seed=0)
    teacher = build_model(model_shape("tiny"), "cuda", torch.bfloat16, seed=1).eval().requires_grad_(False)
    make_batch_invariant_(student)
    make_batch_invariant_(teacher)
    tr = Trainer(student, TrainerConfig(lr=1e-4, micro_batch_tokens=512, loss=LossConfig(kind="token_grpo")),
                 total_steps=3, cuda_graphs=True, teacher=teacher)
    assert tr.graphs is not None
    seqs = _seqs(12, seed=4)
    mbs, _ = tr._my_micro_batches(seqs)
    eager = [tr.response_logprobs(teacher, mb, 0.8) for mb in mbs]
    fill_frozen_logprobs(tr, teacher, mbs, "teacher_logprobs", 0.8)
    fill_frozen_logprobs(tr, teacher, mbs, "teacher_logprobs", 0.8)  # replays, the first call captured
    assert any(k[0] == "teacher_logprobs" for k in tr.graphs.graphs)
    for mb, want in zip(mbs, eager, strict=True):
        assert torch.equal(mb.teacher_logprobs, want)
    assert torch.equal(frozen_forward(tr, teacher, mbs[0], "teacher_logprobs", 0.8), eager[0])
    row = tr.step(seqs, 0.8)
    assert math.isfinite(row["teacher/kl"]) and row["time/teacher_s"] > 0


def test_the_kl_reference_and_the_teacher_replay_graphs_of_their_own(monkeypatch):
    """With both a KL reference and a teacher, each frozen forward replays its own graph per pack shape (keyed by the
    field it fills: the two never share one, though both forwards see the same pack shapes), each bit for bit its
    model's eager log-probs (batch-invariant models), and a step with graphs packs once and runs on them."""
    _need_cuda()
    import monorl.train.trainer as trainer_module
    from monorl.model.batch_invariant import make_batch_invariant_
    from monorl.train.frozen import fill_frozen_logprobs

    student = build_model(model_shape("tiny"), "cuda", torch.float32, seed=0)
    ref = build_model(model_shape("tiny"), "cuda", torch.bfloat16, seed=2).eval().requires_grad_(False)
    teacher = build_model(model_shape("tiny"), "cuda", torch.bfloat16, seed=1).eval().requires_grad_(False)
    for m in (student, ref, teacher):
        make_batch_invariant_(m)
    tr = Trainer(student, TrainerConfig(lr=1e-4, micro_batch_tokens=512, loss=LossConfig(kind="token_grpo",
                                                                                         kl_coef=0.1)),
                 total_steps=3, cuda_graphs=True, teacher=teacher, ref_model=ref)
    assert tr.graphs is not None
    seqs = _seqs(12, seed=4)
    packed = []
    real = trainer_module.make_micro_batches
    monkeypatch.setattr(trainer_module, "make_micro_batches", lambda *a, **k: packed.append(1) or real(*a, **k))
    rows = [tr.step(seqs, 0.8) for _ in range(2)]  # the second replays every graph the first captured
    assert len(packed) == 2 and rows[1]["trainer/graph_captures"] == 0
    fields = {k[0] for k in tr.graphs.graphs if isinstance(k[0], str)}
    assert fields == {"ref_logprobs", "teacher_logprobs"}
    mbs, _ = tr._my_micro_batches(seqs)
    eager = {f: [tr.response_logprobs(m, mb, 0.8) for mb in mbs] for f, m in tr.frozen_models()}
    for f, m in tr.frozen_models():
        fill_frozen_logprobs(tr, m, mbs, f, 0.8)
    for f, want in eager.items():
        for mb, w in zip(mbs, want, strict=True):
            assert torch.equal(getattr(mb, f), w), f
    assert all(math.isfinite(r["kl"]) and math.isfinite(r["teacher/kl"]) for r in rows)


@pytest.mark.parametrize("freeze", [False, True], ids=["tower-trained", "tower-frozen"])
def test_graph_replayed_steps_with_images_match_ordinary_steps(freeze):
    """Packs with images (#59) replay graphs too, the tower's forward and backward inside them (its inputs made at
    pack time: `VisionInputs`), and so does the KL reference's forward over them: steps A, A' (equal grids, other
    pixels and tokens: replayed), B (other grids: captured) match the eager steps' metrics and update, the tower's
    included; a frozen tower (`freeze_vision_`) stays as it was."""
    _need_cuda()
    from monorl.model.qwen3_vl import freeze_vision_
    from tests.test_vl_graph_inputs import vl_train_sequences

    vision = model_shape("tiny-vl").vision
    grids_a = [[[1, 4, 6]], [[1, 2, 2], [1, 4, 4]], [[1, 6, 6]]]
    grids_b = [[[1, 8, 6]], [[1, 2, 2]], [[2, 4, 4]]]
    batches = [vl_train_sequences(vision, grids, seed, samples=4, completion=30)
               for grids, seed in ((grids_a, 0), (grids_a, 1), (grids_b, 2))]
    for b in batches:
        for i, s in enumerate(b):
            s.advantage = float(i % 3 - 1)
    runs = []
    for graphs in (False, True):
        model = build_model(model_shape("tiny-vl"), device="cuda", seed=3)
        if freeze:
            freeze_vision_(model)
        ref = build_model(model_shape("tiny-vl"), "cuda", torch.bfloat16, seed=4).eval().requires_grad_(False)
        tcfg = TrainerConfig(lr=1e-3, eps=1.0, micro_batch_tokens=512, warmup_steps=1,
                             loss=LossConfig(kind="grpo", kl_coef=0.05))
        tr = Trainer(model, tcfg, total_steps=4, attn_backend="flash", cuda_graphs=graphs, ref_model=ref)
        tower = [p.detach().clone() for p in model.model.visual.parameters()]
        init = [p.detach().clone() for p in model.parameters()]
        ms, captured = [], []
        for b in batches:
            ms.append(tr.step(b))
            captured.append(tr.graphs.count() if tr.graphs else 0)
        delta = torch.cat([(p.detach() - a).flatten() for a, p in zip(init, model.parameters(), strict=True)])
        tower_delta = torch.cat([(p.detach() - a).flatten()
                                 for a, p in zip(tower, model.model.visual.parameters(), strict=True)])
        runs.append((tr, ms, delta, tower_delta, captured))
    (_, plain_m, plain_w, plain_t, _), (tr, graph_m, graph_w, graph_t, captured) = runs
    assert tr.graphs is not None
    # every micro-batch was a replay, and so was the reference's forward over it
    assert tr.graphs.replays == 2 * sum(m["micro_batches"] for m in graph_m)
    assert captured[1] == captured[0] < captured[2]  # A's grids and shapes recur in step 2 (no capture); B's are new
    assert graph_m[1]["trainer/graph_captures"] == 0
    step_keys = [k for k in tr.graphs.graphs if not isinstance(k[0], str)]
    assert step_keys and all(k[0].image_grids for k in step_keys)  # each pack held images and replayed a graph
    assert {k[0] for k in tr.graphs.graphs if isinstance(k[0], str)} == {"ref_logprobs"}
    for a, b in zip(plain_m, graph_m, strict=True):
        assert a["micro_batches"] == b["micro_batches"] and a["train_tokens"] == b["train_tokens"]
        for key in ("loss", "pg_loss", "kl", "ratio_mean", "logprob_diff_mean", "grad_norm"):
            assert math.isclose(a[key], b[key], rel_tol=2e-2, abs_tol=2e-3), (key, a[key], b[key])
    assert float(plain_w.norm()) > 0
    assert float((graph_w - plain_w).norm() / plain_w.norm()) < 0.05
    if freeze:
        assert float(plain_t.abs().max()) == 0.0 == float(graph_t.abs().max())
    else:  # the tower trained inside the graphs as it does eagerly
        assert float(plain_t.norm()) > 0
        assert float((graph_t - plain_t).norm() / plain_t.norm()) < 0.05
