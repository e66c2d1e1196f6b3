"""Qwen3-MoE's expert paths on CUDA: `torch._grouped_mm` against the per-expert loop (forward and backward, bf16),
the gathered decode path and the grouped path replayed from CUDA graphs (no host reads inside), the
batch-invariant block's decode path under capture equal bit for bit to its eager pack path, and the generator's
decode of a small MoE (CUDA graphs on) against the trainer's log-probs, bitwise in the mode."""

from __future__ import annotations

import pytest
import torch

from monorl.generate import Generator, GeneratorConfig, SamplingParams
from monorl.model.batch_invariant import BatchInvariantLinear, make_batch_invariant_
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.moe import (
    BatchInvariantSparseMoeBlock,
    SparseMoeBlock,
    experts_gathered,
    experts_grouped_mm,
    experts_loop,
    grouped_mm_fits,
    route,
)
from monorl.train.packing import TrainSequence, make_micro_batches
from monorl.train.trainer import Trainer, TrainerConfig

pytestmark = pytest.mark.gpu

# Qwen3-30B-A3B's expert shapes, 16 of its 128 experts (top-8): real tile sizes, small memory
E, H, INTER, K = 16, 2048, 768, 8


def inputs(T: int, seed: int = 0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = (torch.randn(E, 2 * INTER, H, generator=g, device="cuda") * 0.02).to(dtype)
    down = (torch.randn(E, H, INTER, generator=g, device="cuda") * 0.02).to(dtype)
    x = torch.randn(T, H, generator=g, device="cuda").to(dtype)
    weights, experts = route(torch.randn(T, E, generator=g, device="cuda").to(dtype), K, True)
    return x, weights, experts, gate_up, down


def captured(fn, *args):
    """fn(*args) captured in a CUDA graph, then replayed: the replay's output."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(*args)  # warm-up outside the capture (kernel selection, lazy init)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    return out


def test_grouped_mm_equals_the_loop_forward_and_backward():
    x, w, experts, gate_up, down = inputs(300)
    assert grouped_mm_fits(x, gate_up, down)
    leaves = [t.detach().requires_grad_() for t in (x, gate_up, down)]
    outs, grads = [], []
    for path in (experts_loop, experts_grouped_mm):
        for t in leaves:
            t.grad = None
        out = path(leaves[0], w, experts, leaves[1], leaves[2])
        out.float().square().sum().backward()
        outs.append(out.float())
        grads.append([t.grad.float() for t in leaves])
    ref = experts_loop(x.float(), w.float(), experts, gate_up.float(), down.float())
    err = (outs[1] - ref).abs().max()
    assert err <= 2 * (outs[0] - ref).abs().max() + 1e-3  # bf16 rounding, no worse than the loop's
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("path,T", [(experts_gathered, 4), (experts_grouped_mm, 64)])
def test_decode_paths_replay_from_a_cuda_graph(path, T):
    args = inputs(T, seed=T)
    with torch.no_grad():
        eager = path(*args)
        replayed = captured(path, *args)
    assert torch.equal(replayed, eager)


@pytest.mark.parametrize("T", [1, 8, 64])
def test_block_under_capture_equals_eager(T):
    cfg = model_shape("qwen3-30b-a3b").replace(num_experts=E, num_layers=1)
    with torch.device("cuda"):
        block = SparseMoeBlock(cfg).to(torch.bfloat16)
    torch.nn.init.normal_(block.gate.weight, std=0.02)
    torch.nn.init.normal_(block.experts.gate_up_proj, std=0.02)
    torch.nn.init.normal_(block.experts.down_proj, std=0.02)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = block(x)
        torch.testing.assert_close(captured(block, x), eager, atol=0, rtol=0)
        block.__class__ = BatchInvariantSparseMoeBlock  # the mode: every expert over the rows under capture ...
        block.gate.__class__ = BatchInvariantLinear
        invariant = captured(block, x)
        torch.set_grad_enabled(True)
        try:  # ... bitwise the per-expert slices of an eager pack holding the same rows among others
            pack = torch.cat([torch.randn(37, H, device="cuda", dtype=torch.bfloat16), x])
            assert torch.equal(block(pack)[37:].detach(), invariant)
        finally:
            torch.set_grad_enabled(False)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_generator_decode_graphs_against_the_trainer(batch_invariant):
    cfg = model_shape("tiny-moe").replace(hidden_size=128, moe_intermediate_size=64, num_experts=16,
                                          num_experts_per_tok=4, num_layers=3, mlp_only_layers=(1,))
    policy = build_model(cfg, device="cuda", seed=0)
    gen = Generator(policy, GeneratorConfig(max_num_seqs=8, max_model_len=96, block_size=16), eos_token_ids=())
    trainer = Trainer(policy, TrainerConfig(), total_steps=1)
    if batch_invariant:
        make_batch_invariant_(policy)
        make_batch_invariant_(gen.model)
    prompts = [[(7 * i + j) % 120 + 2 for j in range(3 + 5 * i)] for i in range(6)]
    out = gen.generate(prompts, SamplingParams(max_new_tokens=24, temperature=1.0, seed=0), n=2)
    seqs = [TrainSequence(p, c.token_ids, c.logprobs, 0.0) for p, cs in zip(prompts, out, strict=True) for c in cs]
    diffs = []
    with torch.no_grad():
        for mb in make_micro_batches(seqs, 4096, "cuda", trainer.attn_backend):
            lp, _ = trainer.logprobs_entropy(mb, 1.0)
            diffs.append((lp - mb.old_logprobs).abs().max())
    worst = torch.stack(diffs).max().item()
    assert worst == 0.0 if batch_invariant else worst < 0.5  # bf16 on both sides; a near-tie may route apart
