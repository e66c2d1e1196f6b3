"""Qwen3-MoE through the shared pieces: the generator's copy against the trainer, routing included. In
batch-invariant mode every token is routed to the same experts on both sides (`routing_mismatch` exactly 0) and the
generator's log-probs equal the trainer's bit for bit; without it the log-probs agree to fp32 rounding. Tiny
configs on CPU."""

from __future__ import annotations

import pytest
import torch

from monorl.distributed.weight_sync import sync_weights_
from monorl.generate import Generator, GeneratorConfig, SamplingParams
from monorl.model.attention import VarlenContext
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.moe_routing import RouterTap, compare_routing, routing_mismatch
from monorl.train.packing import TrainSequence
from tests.test_families import prompts_of, scaled_model, trainer_logprobs

SHAPES = {
    "tiny-moe": model_shape("tiny-moe"),
    "no-norm-dense-layer": model_shape("tiny-moe").replace(norm_topk_prob=False, num_layers=3, mlp_only_layers=(1,)),
}


def moe_model(name: str, seed: int = 0) -> torch.nn.Module:
    return scaled_model(SHAPES[name], seed)


def rollouts(model, prompts, sp: SamplingParams, batch_invariant: bool = False) -> tuple[Generator, list]:
    gen = Generator(model, GeneratorConfig(max_num_seqs=4, max_model_len=128, block_size=4), eos_token_ids=())
    if batch_invariant:
        make_batch_invariant_(gen.model)
    out = gen.generate(prompts, sp, n=2)
    return gen, [TrainSequence(p, c.token_ids, c.logprobs, 0.0) for p, cs in zip(prompts, out, strict=True)
                 for c in cs]


def packed_forward(model, seqs: list[TrainSequence]):
    ids = [list(s.prompt_ids) + list(s.completion_ids) for s in seqs]
    ctx = VarlenContext.from_lengths([len(i) for i in ids], "cpu")
    flat = torch.tensor([t for i in ids for t in i])
    return lambda: model(flat, ctx.positions, ctx)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_generator_logprobs_equal_the_trainers(name):
    model = moe_model(name)
    prompts = prompts_of([3, 17, 1], model.config.vocab_size, seed=1)  # 6 sequences through 4 slots
    sp = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=3)
    gen, seqs = rollouts(model, prompts, sp)
    assert len({tuple(s.completion_ids) for s in seqs}) > 3  # not degenerate
    for s, lp in zip(seqs, trainer_logprobs(model, seqs, 0.9), strict=True):
        torch.testing.assert_close(torch.tensor(s.old_logprobs), lp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_batch_invariant_routing_and_logprobs_equal_bitwise(name):
    """The mode: the generator's decode steps (every expert over the step's rows) and the trainer's pack (experts on
    their slices of the sorted tokens) route every token alike and give the same log-probs, bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see tests/test_parity_everywhere.py: tiny tensors, shared CPU
    try:
        model = make_batch_invariant_(moe_model(name, seed=2))
        prompts = prompts_of([5, 9, 2], model.config.vocab_size, seed=4)
        gen, seqs = rollouts(model, prompts, SamplingParams(max_new_tokens=6, temperature=0.9, seed=1),
                             batch_invariant=True)
        for s, lp in zip(seqs, trainer_logprobs(model, seqs, 0.9), strict=True):
            assert torch.equal(torch.tensor(s.old_logprobs, dtype=torch.float32), lp)
        # the generator's copy over all the rollouts at once against the trainer's model one sequence at a time
        report = routing_mismatch(gen.model, model, packed_forward(gen.model, seqs),
                                  lambda: [packed_forward(model, [s])() for s in seqs])
        assert report.tokens == sum(len(s.prompt_ids) + len(s.completion_ids) for s in seqs)
        assert report.tokens_different == 0 and report.share == 0.0
    finally:
        torch.set_num_threads(threads)


def test_routing_mismatch_sees_a_different_router():
    """The measure is no constant: a router perturbed on one side shows up as routing differences."""
    model = moe_model("tiny-moe", seed=3)
    other = build_model(model.config, seed=None)
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        other.model.layers[1].mlp.gate.weight.add_(torch.randn_like(other.model.layers[1].mlp.gate.weight))
    seqs = [TrainSequence(p, [], [], 0.0) for p in prompts_of([20, 11], 128, seed=5)]
    report = routing_mismatch(model, other, packed_forward(model, seqs), packed_forward(other, seqs))
    assert 0 < report.tokens_different <= report.tokens == 31
    assert report.layer_routings_different == report.tokens_different  # layer 0 is untouched
    with pytest.raises(ValueError, match="not the same tokens"):
        compare_routing(torch.zeros(2, 3, 2, dtype=torch.long), torch.zeros(2, 4, 2, dtype=torch.long))


def test_generator_copy_takes_the_trainers_experts():
    """weight sync into a fused copy: the stacked experts and routers by name, the dense layer's gate/up fused."""
    model = moe_model("no-norm-dense-layer", seed=4)
    fused = build_model(model.config, seed=None, fused=True)
    sync_weights_(fused, model)
    assert torch.equal(fused.model.layers[0].mlp.experts.gate_up_proj, model.model.layers[0].mlp.experts.gate_up_proj)
    seqs = [TrainSequence(p, [], [], 0.0) for p in prompts_of([9, 4], 128)]
    with RouterTap(fused) as a, RouterTap(model) as b, torch.no_grad():
        ha, hb = packed_forward(fused, seqs)(), packed_forward(model, seqs)()
    torch.testing.assert_close(ha, hb, atol=1e-5, rtol=1e-5)
    assert compare_routing(a.experts(), b.experts()).tokens_different == 0


def test_parity_verb_reports_routing():
    """`monorl parity` on a random tiny MoE (the RL loop's own generator and trainer): in the mode PASS, routing
    mismatch 0; without it the routing line is reported too."""
    from monorl.parity import check_parity
    from monorl.presets import preset

    cfg = preset("tiny")
    cfg.device, cfg.batch_invariant, cfg.model.shape = "cpu", True, "tiny-moe"
    cfg.rollout.max_new_tokens, cfg.validation.num_prompts = 6, 2
    r = check_parity(cfg, num_prompts=2, samples=2)
    assert r.passed and r.max_abs_diff == 0.0 and r.routing is not None
    assert r.routing.tokens > r.tokens_checked and r.routing.tokens_different == 0
    assert "routing: tokens checked" in r.text() and r.text().endswith("PASS (bitwise)")
    cfg.batch_invariant = False
    off = check_parity(cfg, num_prompts=2, samples=2, tolerance=1e-4)
    assert off.passed and off.routing is not None and off.routing.tokens == r.routing.tokens
