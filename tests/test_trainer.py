import math

import pytest
import torch

from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.train.losses import LossConfig
from monorl.train.optim import AdamW, lr_factor
from monorl.train.packing import TrainSequence
from monorl.train.trainer import Trainer, TrainerConfig


def _seqs(n: int = 6, seed: int = 0) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, c = 4 + i, 3 + (i * 5) % 7
        out.append(TrainSequence(torch.randint(3, 100, (p,), generator=g).tolist(),
                                 torch.randint(3, 100, (c,), generator=g).tolist(),
                                 (-torch.rand(c, generator=g) * 3).tolist(), advantage=float(i % 3 - 1)))
    return out


def test_lr_schedule():
    assert [lr_factor(s, 2, 10, "linear") for s in (0, 1)] == [0.5, 1.0]
    assert lr_factor(2, 2, 10, "linear") == 1.0 and lr_factor(6, 2, 10, "linear") == 0.5
    assert lr_factor(10, 2, 10, "linear") == 0.0
    assert math.isclose(lr_factor(6, 2, 10, "cosine"), 0.5)
    assert lr_factor(9, 2, 10, "constant") == 1.0
    with pytest.raises(ValueError, match="unknown lr schedule"):
        lr_factor(0, 1, 2, "step")


@pytest.mark.parametrize("kind", ["grpo", "dapo", "dr_grpo"])
def test_step_changes_weights_and_accumulation_is_exact(kind):
    loss_cfg = LossConfig(kind=kind, dr_grpo_norm=8.0 if kind == "dr_grpo" else None)
    results = []
    for budget in (32, 4096):  # many micro-batches vs one
        model = build_model(model_shape("tiny"), seed=3)
        before = [p.detach().clone() for p in model.parameters()]
        tr = Trainer(model, TrainerConfig(lr=1e-3, micro_batch_tokens=budget, warmup_steps=1, loss=loss_cfg),
                     total_steps=4)
        m = tr.step(_seqs())
        assert m["micro_batches"] == (1 if budget == 4096 else m["micro_batches"]) and m["skipped"] == 0.0
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        results.append(m)
    assert results[0]["micro_batches"] > 1
    assert math.isclose(results[0]["loss"], results[1]["loss"], rel_tol=1e-5, abs_tol=1e-7)
    assert math.isclose(results[0]["grad_norm"], results[1]["grad_norm"], rel_tol=1e-4)


def test_logprob_diff_is_zero_when_old_logprobs_are_the_trainers():
    model = build_model(model_shape("tiny"), seed=3)
    tr = Trainer(model, TrainerConfig(lr=1e-3, micro_batch_tokens=4096), total_steps=2)
    seqs = _seqs()
    with torch.no_grad():
        from monorl.train.packing import make_micro_batches

        (mb,) = make_micro_batches(seqs, 4096, "cpu")
        lp = tr.response_logprobs(model, mb, 1.0).tolist()
    pos = 0
    for s in seqs:
        s.old_logprobs = lp[pos:pos + len(s.completion_ids)]
        pos += len(s.completion_ids)
    m = tr.step(seqs)
    assert m["logprob_diff_max"] < 1e-5
    assert math.isclose(m["ratio_mean"], 1.0, abs_tol=1e-5)


def _fused_adamw(monkeypatch):
    """The trainer's optimizer fused (as on CUDA, where the skip is decided on the device) on CPU."""
    monkeypatch.setattr("monorl.train.trainer.make_optimizer", lambda params, lr, wd, betas, eps: AdamW(
        params, lr=lr, betas=betas, eps=eps, weight_decay=wd, fused=True))


@pytest.mark.parametrize("fused", [False, True])
def test_non_finite_gradient_skips_update(fused, monkeypatch):
    """A NaN advantage: the update is skipped (weights, moments and AdamW's step count untouched), reported, and the
    next finite step updates. Fused: the skip decided on the device (`found_inf`), read with the metrics."""
    if fused:
        _fused_adamw(monkeypatch)
    model = build_model(model_shape("tiny"), seed=3)
    tr = Trainer(model, TrainerConfig(lr=1e-3), total_steps=3)
    assert bool(tr.optimizer.defaults.get("fused")) == fused
    seqs = _seqs()
    seqs[0].advantage = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    m = tr.step(seqs)
    assert m["skipped"] == 1.0 and not math.isfinite(m["grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(float(st["step"]) == 0 and not st["exp_avg"].any() for st in tr.optimizer.state.values())
    m = tr.step(_seqs())
    assert m["skipped"] == 0.0 and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("max_grad_norm", [1e3, 1e-3])
def test_fused_update_equals_the_unfused_and_calls_after_update(max_grad_norm, monkeypatch):
    """The device-decided path takes the step the host-read path takes (fused and for-each AdamW agree to
    rounding; the clip, there fused AdamW's grad_scale, shows in the first moments), and `after_update` runs once,
    with the update already applied."""
    out = {}
    for fused in (False, True):
        if fused:
            _fused_adamw(monkeypatch)
        model = build_model(model_shape("tiny"), seed=3)
        tr = Trainer(model, TrainerConfig(lr=1e-3, max_grad_norm=max_grad_norm), total_steps=3)
        seen = []
        m = tr.step(_seqs(), after_update=lambda seen=seen, w=model.lm_head_weight: seen.append(w.detach().clone()))
        assert len(seen) == 1 and torch.equal(seen[0], model.lm_head_weight)
        moments = [tr.optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
        out[fused] = (m, [p.detach().clone() for p in model.parameters()], moments)
    assert math.isclose(out[True][0]["grad_norm"], out[False][0]["grad_norm"], rel_tol=1e-6)
    assert (out[False][0]["grad_norm"] > max_grad_norm) == (max_grad_norm < 1)  # the small bound clips
    for a, b in zip(out[True][1], out[False][1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for a, b in zip(out[True][2], out[False][2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-12)
    norm = torch.cat([m.flatten() for m in out[True][2]]).norm() / 0.1  # exp_avg = (1 - beta1) g after one step
    assert float(norm) <= min(max_grad_norm, out[True][0]["grad_norm"]) * (1 + 1e-4)


@pytest.mark.parametrize("fused", [False, True])
def test_sft_steps_reduce_nll(fused, monkeypatch):
    if fused:
        _fused_adamw(monkeypatch)
    model = build_model(model_shape("tiny"), seed=0)
    tr = Trainer(model, TrainerConfig(lr=3e-3, warmup_steps=1, schedule="constant"), total_steps=30)
    seqs = _seqs(4)
    losses = [tr.sft_step(seqs)["loss"] for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]


def test_config_validation():
    with pytest.raises(ValueError, match="trainer.lr"):
        TrainerConfig(lr=0)
    with pytest.raises(ValueError, match="compute_dtype"):
        TrainerConfig(compute_dtype="fp8")


@pytest.mark.parametrize("kind", ["grpo", "token_grpo"])
def test_static_shapes_step_equals_dynamic_step(kind):
    """The CUDA-graph layout (bucketed sequence count, masked padded rows, fixed max_seqlen), run without
    capture, gives the same metrics and update as the dynamic packs, over two steps of different shapes."""
    runs = []
    for static in (False, True):
        model = build_model(model_shape("tiny"), seed=3)
        tr = Trainer(model, TrainerConfig(lr=1e-3, micro_batch_tokens=32, warmup_steps=1,
                                          loss=LossConfig(kind=kind)), total_steps=4, static_shapes=static)
        tr.warm_up(list(range(3, 9)), num_seqs=4, completion_len=5)  # leaves weights and metric sums untouched
        ms = [tr.step(_seqs(6, seed=0)), tr.step(_seqs(4, seed=1))]
        runs.append((ms, [p.detach().clone() for p in model.parameters()]))
    (dyn_m, dyn_w), (st_m, st_w) = runs
    for a, b in zip(dyn_m, st_m, strict=True):
        assert a["micro_batches"] > 1 and a["train_tokens"] == b["train_tokens"]
        for k in ("loss", "pg_loss", "ratio_mean", "clip_frac", "logprob_diff_mean", "logprob_diff_max", "grad_norm"):
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6), (k, a[k], b[k])
    for a, b in zip(dyn_w, st_w, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_trace_kernels_leaves_weights_gradients_and_metrics_untouched():
    """The pass `monorl.speedups.precompile` traces (on CUDA its kernels' outputs are garbage) changes nothing a step
    reads: the next step equals a step on a fresh trainer."""
    out = []
    for trace in (False, True):
        model = build_model(model_shape("tiny"), seed=3)
        tr = Trainer(model, TrainerConfig(lr=1e-3, micro_batch_tokens=32, warmup_steps=1), total_steps=4)
        if trace:
            tr.trace_kernels(list(range(3, 9)), num_seqs=4, completion_len=5, temperature=0.8)
            assert all(p.grad is None or not p.grad.any() for p in model.parameters())
        out.append((tr.step(_seqs()), [p.detach().clone() for p in model.parameters()]))
    (m0, w0), (m1, w1) = out
    assert m0 == m1
    assert all(torch.equal(a, b) for a, b in zip(w0, w1, strict=True))


def test_capture_log_reports_what_each_step_captured() -> None:
    from monorl.train.graphs import CaptureLog

    log = CaptureLog()
    assert log.since_last_read() == {"trainer/graph_captures": 0.0, "time/graph_capture_s": 0.0}
    log.add(1.5)
    log.add(0.5)
    assert log.since_last_read() == {"trainer/graph_captures": 2.0, "time/graph_capture_s": 2.0}
    assert log.since_last_read() == {"trainer/graph_captures": 0.0, "time/graph_capture_s": 0.0}
    log.add(0.25)
    assert log.since_last_read() == {"trainer/graph_captures": 1.0, "time/graph_capture_s": 0.25}


def test_warm_up_packs_are_a_ranks_share_of_the_step():
    """Under FSDP a rank trains its share of a step: the warm-up packs (and captures) that many sequences, the same
    on every rank, not the whole step (whose packs were larger than the graphs' pool is planned for)."""
    from monorl.distributed.world import World

    one, four = World(0, 1), World(0, 4)
    tr1 = Trainer(build_model(model_shape("tiny"), seed=3), TrainerConfig(lr=1e-3, micro_batch_tokens=4096),
                  total_steps=1, world=one)
    tr4 = Trainer(build_model(model_shape("tiny"), seed=3), TrainerConfig(lr=1e-3, micro_batch_tokens=4096),
                  total_steps=1, world=four)
    def shapes(tr: Trainer, num_seqs: int) -> list:
        packs = tr._warm_up_packs(list(range(3, 9)), num_seqs=num_seqs, completion_len=5, smaller=False, group_size=8)
        return [(mb.shape, mb.input_ids.numel()) for mb, *_ in packs]

    assert shapes(tr4, 64) == shapes(tr1, 16) != shapes(tr1, 64)  # 64 sequences on 4 ranks: 16 a rank
    assert shapes(tr4, 40) == shapes(tr1, 10)


@pytest.mark.parametrize("kl_reference", [False, True])
def test_warm_up_graph_keys_are_the_steps(kl_reference: bool):
    """The graphs the warm-up captures are the ones a step replays: its packs' keys (shape, the step's sequence
    count, ...) are those of a rank's share of a step of that many sequences. With the share's count in the key
    (session 9) no step replayed a warm-up graph: each captured its own, outside the planned pool (Qwen3-8B on 4
    H100s ran out of memory). With a KL reference, the step's packs are keyed (`_cover`) before the reference scores
    them, the warm-up's carry zeros: the same keys."""
    from monorl.distributed.world import World

    prompt, comp, n, T = list(range(3, 9)), 5, 64, 1.0
    loss = LossConfig(kl_coef=0.1 if kl_reference else 0.0)
    for rank in range(4):
        ref = build_model(model_shape("tiny"), seed=3).requires_grad_(False) if kl_reference else None
        tr = Trainer(build_model(model_shape("tiny"), seed=3), TrainerConfig(lr=1e-3, micro_batch_tokens=4096,
                                                                             loss=loss),
                     total_steps=1, world=World(rank, 4), ref_model=ref)
        warm = {tr._graph_key(mb, adv.numel(), T)
                for mb, _, adv, full in tr._warm_up_packs(prompt, n, comp, smaller=True, group_size=8) if full}
        seqs = [TrainSequence(list(prompt), list(range(10, 10 + comp)), [0.0] * comp, 1.0, group=j // 8)
                for j in range(n)]
        step = {tr._graph_key(mb, len(seqs), T) for mb in tr._micro_batches(seqs, tr._my_share(seqs))}
        assert warm == step, rank


def test_run_warms_the_trainer_up_at_the_longest_training_prompt(tmp_path, monkeypatch):
    """The start-up's trainer warm-up (here, under compiled blocks) packs prompts as long as the longest training
    prompt the memory plan sizes packs with, and completions of max_new_tokens: the largest pack a step makes, whose
    graph later packs replay padded."""
    from monorl.run.grpo import GRPORun
    from tests.test_resume import small_cfg

    seen = []
    real = Trainer.warm_up

    def record(self, prompt_ids, num_seqs, completion_len, *args, **kwargs):
        seen.append((len(prompt_ids), num_seqs, completion_len))
        return real(self, prompt_ids, num_seqs, completion_len, *args, **kwargs)

    monkeypatch.setattr(Trainer, "warm_up", record)
    # up to 4 numbers of up to 4 digits: the longest training prompt is longer than the first validation prompt
    cfg = small_cfg(tmp_path / "run", **{"compile.backend": "eager", "steps": "1", "warm_start.steps": "0",
                                         "checkpoint.final": "false", "task.args.max_numbers": "4",
                                         "task.args.max_digits": "4"})
    run = GRPORun(cfg, progress=False)
    spec = run.spec
    assert len(spec.tokenizer.encode(spec.task.render(spec.val_prompts[0], spec.tokenizer))) < spec.max_prompt_tokens
    run.run()
    r = run.cfg.rollout
    assert seen == [(run.spec.max_prompt_tokens, r.prompts_per_step * r.group_size, r.max_new_tokens)]
