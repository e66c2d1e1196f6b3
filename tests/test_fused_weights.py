"""Fused q/k/v and gate/up projections (`fuse_projections_`): the generator's copy runs one GEMM per group,
while the Parameters stay HF-named row-slice views of the fused matrix, so checkpoints, `load_weights_`
and captured CUDA graphs are unaffected. CPU tests in fp32; one GPU test (bf16, CUDA graphs)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from monorl.generate import Generator, GeneratorConfig, SamplingParams
from monorl.generate.runner import graph_buckets
from monorl.model.attention import VarlenContext
from monorl.model.config import model_shape
from monorl.model.qwen3 import FusableProjections, build_model, fuse_projections_
from monorl.ops.batch_invariant import batch_invariant_mode
from tests.conftest import full_forward_logprobs

FUSED_PARAMS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def tiny_model(seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32, trainable: bool = False):
    """`tiny` shape (GQA 4/2 heads), weights x5 so logits are O(1) and greedy decoding is not degenerate."""
    model = build_model(model_shape("tiny"), device=device, dtype=dtype, seed=seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if not n.endswith("norm.weight"):
                p.mul_(5.0)
    return model.eval().requires_grad_(trainable)


def fusable(model) -> list[FusableProjections]:
    return [m for m in model.modules() if isinstance(m, FusableProjections)]


def prompts_of(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def packed_logits(model, lengths: list[int], seed: int = 0) -> torch.Tensor:
    ids = torch.tensor([t for p in prompts_of(lengths, model.config.vocab_size, seed) for t in p])
    ctx = VarlenContext.from_lengths(lengths, "cpu")
    with torch.no_grad():
        return model.compute_logits(model(ids, ctx.positions, ctx))


def count_projection_calls(model) -> list[int]:
    """A counter the per-projection Linear modules bump when called (the fused path calls none of them)."""
    calls = [0]
    for m in fusable(model):
        for lin in m._projections():
            lin.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_fused_forward_equals_unfused():
    ref = tiny_model()
    fused = fuse_projections_(copy.deepcopy(ref))
    assert all(m.is_fused() for m in fusable(fused)) and not any(m.is_fused() for m in fusable(ref))
    calls = count_projection_calls(fused)
    lengths = [5, 1, 12, 7]
    a, b = packed_logits(ref, lengths), packed_logits(fused, lengths)
    assert calls == [0]  # the fused GEMMs ran, not the per-projection ones
    assert a.abs().max() > 1.0  # O(1) logits: a mis-split matrix would show
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    # batch-invariant mode always takes the per-projection path: bitwise what the unfused model computes
    with batch_invariant_mode(True, torch.float32):
        assert torch.equal(packed_logits(fused, lengths), packed_logits(ref, lengths))
    assert calls[0] == 5 * ref.config.num_layers  # one forward of `fused`, 5 projections per layer


def test_parameters_are_views_of_the_fused_matrix():
    ref = tiny_model()
    model = fuse_projections_(copy.deepcopy(ref))
    assert [(n, p.shape) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in ref.named_parameters()]
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert list(model.state_dict()) == list(ref.state_dict())  # no fused_weight: checkpoints unchanged
    for (n, p), (_, q) in zip(model.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(p, q), n
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    cfg = model.config
    assert attn.fused_weight.shape == ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size)
    assert mlp.fused_weight.shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    row = 0
    for w in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight):
        assert w.untyped_storage().data_ptr() == attn.fused_weight.untyped_storage().data_ptr()
        assert w.data_ptr() == attn.fused_weight[row].data_ptr()
        row += w.shape[0]
    assert mlp.up_proj.weight.data_ptr() == mlp.fused_weight[cfg.intermediate_size].data_ptr()
    # an in-place write into a Parameter is a write into the fused matrix
    with torch.no_grad():
        attn.k_proj.weight.fill_(0.25)
    assert (attn.fused_weight[cfg.num_heads * cfg.head_dim:][:cfg.num_kv_heads * cfg.head_dim] == 0.25).all()
    # idempotent: fusing again allocates nothing (captured CUDA graphs keep their addresses)
    ptrs = [m.fused_weight.data_ptr() for m in fusable(model)]
    fuse_projections_(model)
    assert [m.fused_weight.data_ptr() for m in fusable(model)] == ptrs


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "to", "load_state_dict_assign", "load_state_dict"])
def test_reallocating_the_parameters_refuses(how):
    """Whatever re-allocates the Parameters must leave them views of a fused matrix holding their values."""
    ref = tiny_model()
    model = fuse_projections_(copy.deepcopy(ref))
    other = tiny_model(seed=1)
    if how == "deepcopy":
        model, want = copy.deepcopy(model), ref
    elif how == "pickle":
        model, want = pickle.loads(pickle.dumps(model)), ref
    elif how == "to":
        model, want = model.to(torch.float64), copy.deepcopy(ref).to(torch.float64)
    else:
        model.load_state_dict(other.state_dict(), assign=how.endswith("assign"))
        want = other
    assert all(m.is_fused() for m in fusable(model))
    for m in fusable(model):
        assert m.fused_weight.dtype == m._projections()[0].weight.dtype
    for (n, p), (_, q) in zip(model.named_parameters(), want.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    torch.testing.assert_close(packed_logits(model, [6, 3]), packed_logits(want, [6, 3]), atol=1e-5, rtol=1e-5)


def test_trainable_weights_get_gradients_through_the_unfused_path():
    model = fuse_projections_(tiny_model(trainable=True))
    ids = torch.tensor(prompts_of([9], model.config.vocab_size)[0])
    ctx = VarlenContext.from_lengths([9], "cpu")
    model.compute_logits(model(ids, ctx.positions, ctx)).logsumexp(-1).sum().backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n


def gen(model, **kw) -> Generator:
    cfg = dict(max_num_seqs=4, max_model_len=128, block_size=4)
    cfg.update(kw)
    return Generator(model, GeneratorConfig(**cfg), eos_token_ids=())


def test_generator_fuses_only_inference_models():
    frozen, trainable = tiny_model(), tiny_model(trainable=True)
    g = gen(frozen)
    assert g.model is frozen and all(m.is_fused() for m in fusable(frozen))
    assert not any(m.is_fused() for m in fusable(gen(tiny_model(), fuse_projections=False).model))
    t = gen(trainable)  # shared with a trainer: left as is
    assert t.model is trainable and not any(m.is_fused() for m in fusable(trainable))
    own = gen(trainable, dtype=torch.bfloat16)  # its own cast copy: frozen, fused
    assert own.model is not trainable and all(m.is_fused() for m in fusable(own.model))
    assert not any(p.requires_grad for p in own.model.parameters())
    assert [n for n, _ in own.model.named_parameters()] == [n for n, _ in trainable.named_parameters()]


def test_generation_fused_equals_unfused():
    base = tiny_model()
    fused, plain = gen(copy.deepcopy(base)), gen(copy.deepcopy(base), fuse_projections=False)
    assert all(m.is_fused() for m in fusable(fused.model)) and not any(m.is_fused() for m in fusable(plain.model))
    prompts = prompts_of([3, 17, 1], base.config.vocab_size, seed=1)  # 6 sequences through 4 slots
    for sp in (SamplingParams(max_new_tokens=12, temperature=0.0),
               SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=3)):
        a, b = fused.generate(prompts, sp, n=2), plain.generate(prompts, sp, n=2)
        assert [[c.token_ids for c in x] for x in a] == [[c.token_ids for c in x] for x in b]
        if sp.greedy:
            assert len({tuple(x[0].token_ids) for x in a}) == len(prompts)  # not degenerate
        la = torch.tensor([lp for x in a for c in x for lp in c.logprobs])
        lb = torch.tensor([lp for x in b for c in x for lp in c.logprobs])
        torch.testing.assert_close(la, lb, atol=1e-5, rtol=0)


def test_load_weights_updates_the_fused_matrix():
    g = gen(tiny_model(seed=0))

    def addresses():
        return [(m.fused_weight.data_ptr(), [w.weight.data_ptr() for w in m._projections()]) for m in fusable(g.model)]

    ptrs = addresses()
    sp = SamplingParams(max_new_tokens=16, temperature=0.0)
    prompts = prompts_of([4, 11, 6], g.model.config.vocab_size, seed=2)
    before = g.generate(prompts, sp)
    new = tiny_model(seed=1, trainable=True)  # e.g. the trainer's weights after a step
    g.load_weights_(new)
    assert addresses() == ptrs  # in place: captured CUDA graphs stay valid
    for gm, nm in zip(fusable(g.model), fusable(new), strict=True):
        assert torch.equal(gm.fused_weight, torch.cat([lin.weight for lin in nm._projections()]))
    after = g.generate(prompts, sp)
    ref = gen(copy.deepcopy(new).requires_grad_(False), fuse_projections=False).generate(prompts, sp)
    assert [x[0].token_ids for x in after] == [x[0].token_ids for x in ref]
    assert [x[0].token_ids for x in after] != [x[0].token_ids for x in before]
    torch.testing.assert_close(torch.tensor([x[0].logprobs for x in after]),
                               torch.tensor([x[0].logprobs for x in ref]), atol=1e-5, rtol=0)


def test_decode_buckets_start_at_two():
    assert graph_buckets(1) == [2] and graph_buckets(2) == [2] and graph_buckets(3) == [2, 3]
    assert graph_buckets(6) == [2, 4, 6]
    assert graph_buckets(40) == [2, 4, 8, 16, 24, 32, 40]
    assert graph_buckets(100) == [2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100]
    # one slot: the slot state still has the bucket's 2 rows; generation is unchanged
    one = gen(tiny_model(), max_num_seqs=1)
    assert one.runner.tok.shape[0] == 2 and one.runner.bucket(1) == 2
    prompts = prompts_of([5, 8], one.model.config.vocab_size, seed=4)
    sp = SamplingParams(max_new_tokens=10, temperature=0.0)
    assert ([x[0].token_ids for x in one.generate(prompts, sp)]
            == [x[0].token_ids for x in gen(tiny_model()).generate(prompts, sp)])


# ---- GPU ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_fused_cuda_graph_decode_matches_unfused(compile):
    """bf16 generator copies of fp32 masters (the RL loop's setup), decode replayed from CUDA graphs: the fused
    copy's log-probs equal the unfused model's full-sequence forward over the fused copy's own tokens, before
    and after `load_weights_` of new masters (so the captured graphs read the fused matrices in place).
    Fused and unfused GEMMs may round differently in bf16, so near-tied greedy tokens could flip: fused and unfused
    log-probs are compared on each pair's common prefix, and each against the full forward to bf16 tolerance."""
    master = tiny_model(device="cuda", trainable=True)
    cfg = dict(max_num_seqs=6, max_model_len=256, cuda_graphs=True, compile=compile)
    fused = Generator(master, GeneratorConfig(**cfg), eos_token_ids=())
    plain = Generator(master, GeneratorConfig(fuse_projections=False, **cfg), eos_token_ids=())
    assert fused.dtype == torch.bfloat16 and fused.runner.use_graphs and fused.runner.decode_backend == "triton"
    assert all(m.is_fused() for m in fusable(fused.model)) and not any(m.is_fused() for m in fusable(plain.model))
    ptrs = [m.fused_weight.data_ptr() for m in fusable(fused.model)]
    ps = prompts_of([5, 40, 17, 3, 29], master.config.vocab_size)
    sps = (SamplingParams(max_new_tokens=32, temperature=0.0),
           SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, seed=3))
    seen = []
    for step in range(2):
        if step:
            with torch.no_grad():  # new masters (as after a train step), synced in place into both copies
                for p, q in zip(master.parameters(), tiny_model(seed=1, device="cuda").parameters(), strict=True):
                    p.copy_(q)
            fused.load_weights_(master)
            plain.load_weights_(master)
            assert [m.fused_weight.data_ptr() for m in fusable(fused.model)] == ptrs
        for sp in sps:
            a, b = fused.generate(ps, sp, n=2), plain.generate(ps, sp, n=2)
            seen.append([c.token_ids for x in a for c in x])
            T = 1.0 if sp.greedy else sp.temperature
            err_fused, err_plain, err_prefix, same, total = [], [], [], 0, 0
            for p, ca, cb in zip(ps, a, b, strict=True):
                for x, y in zip(ca, cb, strict=True):
                    err_fused.append(torch.tensor(x.logprobs) - full_forward_logprobs(plain.model, p, x.token_ids, T))
                    err_plain.append(torch.tensor(y.logprobs) - full_forward_logprobs(plain.model, p, y.token_ids, T))
                    diff = [i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids, strict=True)) if s != t]
                    k = diff[0] if diff else len(x.token_ids)
                    err_prefix.append(torch.tensor(x.logprobs[:k]) - torch.tensor(y.logprobs[:k]))
                    same, total = same + k, total + len(x.token_ids)
            ef, ep, ex = (torch.cat(e).abs() for e in (err_fused, err_plain, err_prefix))
            msg = (f"step {step} greedy {sp.greedy}: {same}/{total} tokens agree; |fused - full forward| max "
                   f"{ef.max():.4f} mean {ef.mean():.4f} (unfused: {ep.max():.4f} {ep.mean():.4f}); |fused - unfused| "
                   f"on the common prefix max {ex.max() if ex.numel() else 0.0:.4f}")
            # H200, torch 2.11: tokens all agree; fused-vs-unfused log-probs differ by <= 0.003, and both are within
            # 0.06 (eager) / 0.12 (compiled) of the full forward, mean 0.001 / 0.02. A wrong slice or a stale fused
            # matrix after load_weights_ gives O(1) errors on most tokens.
            assert same >= total // 2, msg
            assert ex.numel() == 0 or ex.max() < 0.05, msg
            assert ef.max() < 0.25 and ef.mean() < 0.05, msg
    assert seen[0] != seen[2] and seen[1] != seen[3]  # the new weights are what the graphs ran
