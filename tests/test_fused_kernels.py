"""The fused block kernels (`monorl.ops.block_kernels`, `monorl.model.fused_kernels`). CPU: the converted model's
wiring (its ops' PyTorch fallbacks) against the unconverted model, fused and unfused, forward and the ops' backward;
what refuses to convert; the batch-invariant conversion running them. GPU: each Triton kernel against its fallback,
and a generator on the kernels against an eager forward."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from monorl.compile import CompileConfig
from monorl.distributed.weight_sync import sync_weights_
from monorl.generate import Generator, GeneratorConfig, SamplingParams
from monorl.model.attention import VarlenContext
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.fused_kernels import use_fused_kernels_, uses_fused_kernels
from monorl.ops import block_kernels
from monorl.ops.tunables import chip_of, tuned
from tests.conftest import full_forward_logprobs


def random_model(fused: bool, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """`tiny` (GQA 4/2 heads, head_dim 16), non-unit norm weights so a q/k norm mix-up shows."""
    model = build_model(model_shape("tiny"), device=device, dtype=torch.float32, seed=0)
    with torch.no_grad():
        g = torch.Generator(device=device).manual_seed(1)
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, device=device))
            else:
                p.mul_(5.0)
    if not fused:
        return model.to(dtype).eval().requires_grad_(False)
    copy = build_model(model.config, device=device, dtype=dtype, seed=None, fused=True).eval().requires_grad_(False)
    sync_weights_(copy, model)
    return copy


def packed_logits(model, lengths: list[int]) -> torch.Tensor:
    dev = model.lm_head_weight.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, model.config.vocab_size, (sum(lengths),), generator=g).to(dev)
    ctx = VarlenContext.from_lengths(lengths, dev)
    with torch.no_grad():
        return model.compute_logits(model(ids, ctx.positions, ctx))


@pytest.mark.parametrize("fused", [True, False])
def test_converted_forward_equals_the_model(fused):
    """The converted blocks compute the model (CPU: each op's PyTorch fallback), for packed sequences, from a fused
    copy's GEMM slices (the generator's) or separate projections (the trainer's)."""
    ref = random_model(fused=fused)
    conv = use_fused_kernels_(random_model(fused=fused))
    assert uses_fused_kernels(conv) and not uses_fused_kernels(ref)
    assert [n for n, _ in conv.named_parameters()] == [n for n, _ in ref.named_parameters()]
    a, b = packed_logits(conv, [5, 11, 1]), packed_logits(ref, [5, 11, 1])
    assert a.abs().max() > 1  # O(1) logits: a mis-wired norm or RoPE would show
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
    assert use_fused_kernels_(conv) is conv  # idempotent


def test_converted_backward_equals_autograd():
    """The ops' hand-written backward (what a batch-invariant trainer runs), the final norm's included: every
    parameter's gradient equals autograd through the model's own ops, fp32, with the residual stream feeding both
    the add and the norm."""
    ref = random_model(fused=False).requires_grad_(True)
    conv = use_fused_kernels_(random_model(fused=False).requires_grad_(True))
    lengths = [5, 11, 1]
    ids = torch.randint(2, ref.config.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    ctx = VarlenContext.from_lengths(lengths, "cpu")
    w = torch.randn(sum(lengths), ref.config.vocab_size, generator=torch.Generator().manual_seed(1))
    grads = []
    for m in (conv, ref):
        (m.compute_logits(m(ids, ctx.positions, ctx)) * w).sum().backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for n, g in grads[1].items():
        assert g.abs().max() > 0, n
        # fp32 rounding of sums in other orders, at the gradient's scale (the tied embedding's reaches ~200)
        torch.testing.assert_close(grads[0][n], g, atol=max(1e-4, 2e-6 * g.abs().max().item()), rtol=1e-4, msg=n)


def test_converted_blocks_hand_the_residual_on_under_activation_checkpointing():
    """A converted block returns (h, m), the residual add pending for the next block's norm: with activation
    checkpointing (each block recomputed in backward, that pair its input) the gradients are bitwise those of the
    plain pass, and the model's output is one hidden state per token."""
    lengths = [5, 11, 1]
    ids = torch.randint(2, model_shape("tiny").vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    ctx = VarlenContext.from_lengths(lengths, "cpu")
    grads = []
    for checkpointed in (False, True):
        m = use_fused_kernels_(random_model(fused=False).requires_grad_(True))
        m.activation_checkpointing = checkpointed
        out = m(ids, ctx.positions, ctx)
        assert out.shape == (sum(lengths), m.config.hidden_size)
        m.compute_logits(out).square().mean().backward()
        grads.append([p.grad for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_conversion_refusals():
    model = build_model(dataclasses.replace(model_shape("tiny"), head_dim=24), seed=0, fused=True)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        use_fused_kernels_(model)


def test_batch_invariant_conversion_runs_the_kernels():
    """A batch-invariant model's blocks run the kernels on both sides (trainer unfused, generator fused)."""
    for fused in (False, True):
        model = make_batch_invariant_(random_model(fused=fused))
        assert uses_fused_kernels(model)
        for m in (model, make_batch_invariant_(use_fused_kernels_(random_model(fused=fused)))):  # either order
            kinds = {type(x).__name__ for x in m.modules() if isinstance(x, torch.nn.Linear)}
            assert kinds == {"BatchInvariantLinear"}, kinds  # projections on the invariant GEMM at every row count


def test_generator_converts_only_on_cuda():
    """CPU generators keep the model's eager ops (the kernels are CUDA's); the switch is GeneratorConfig's."""
    gen = Generator(random_model(fused=False), GeneratorConfig(max_num_seqs=2, max_model_len=64))
    assert not uses_fused_kernels(gen.model)


# ---- GPU ------------------------------------------------------------------------------------------------------

def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> float:
    """The fraction of elements that differ (H200: none, for every op, at these shapes)."""
    return (a != b).float().mean().item()


@pytest.mark.gpu
@pytest.mark.parametrize("T, Hq, Hkv, D, hidden, inter", [(48, 16, 8, 128, 1024, 3072), (300, 32, 8, 128, 2560, 9728),
                                                          (3, 4, 2, 16, 64, 160)])
def test_kernels_match_fallbacks(T, Hq, Hkv, D, hidden, inter):
    """Each Triton kernel rounds like the eager ops (its fallback): the residual add exactly, the rest up to the
    order of the fp32 sum of squares (and exp's last bit in SiLU), so a small fraction of elements differ."""
    torch.manual_seed(0)
    dt, cuda = torch.bfloat16, "cuda"
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device=cuda, dtype=dt)
    qw, kw = (1 + 0.3 * torch.randn(D, device=cuda)).to(dt), (1 + 0.3 * torch.randn(D, device=cuda)).to(dt)
    from monorl.model.rope import rope_cos_sin

    cos, sin = rope_cos_sin(torch.arange(T, device=cuda) * 13, D, 1e6, dt)
    x, a = torch.randn(T, hidden, device=cuda, dtype=dt), torch.randn(T, hidden, device=cuda, dtype=dt)
    w = (1 + 0.3 * torch.randn(hidden, device=cuda)).to(dt)
    gu = 3 * torch.randn(T, 2 * inter, device=cuda, dtype=dt)

    def run(qkv, qw, kw, cos, sin, x, a, w, gu):  # q, k, gate, up: column slices of one GEMM output, as generated
        q, k, _ = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        return (*block_kernels.qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6), *block_kernels.add_rms_norm(x, a, w, 1e-6),
                block_kernels.silu_mul(*gu.split([inter, inter], dim=-1)))

    got = run(qkv, qw, kw, cos, sin, x, a, w, gu)
    ref = run(*(t.cpu() for t in (qkv, qw, kw, cos, sin, x, a, w, gu)))  # the fallbacks run off CUDA
    unsliced = run(qkv.clone(), qw, kw, cos, sin, x, a, w, gu.clone())
    assert all(torch.equal(g, u) for g, u in zip(got, unsliced, strict=True))
    names = ("q", "k", "h", "normed", "silu_mul")
    for name, g, r in zip(names, got, ref, strict=True):
        g = g.cpu()
        assert g.shape == r.shape and g.dtype == r.dtype, name
        torch.testing.assert_close(g, r, atol=2e-2, rtol=2e-2, msg=name)
        assert _ulps_apart(g, r) <= (0 if name == "h" else 0.02), (name, _ulps_apart(g, r))


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, Hq, Hkv, D, hidden, inter", [(300, 16, 8, 128, 1024, 3072), (37, 4, 2, 16, 64, 160)])
def test_backward_kernels_match_fallbacks(T, Hq, Hkv, D, hidden, inter, dt):
    """Each op's backward kernel (the norms' with RoPE's or the residual's gradient folded in; SiLU * up's; the
    token log-probs') against its PyTorch fallback through autograd: every input's gradient, weights' included
    (summed over rows in blocks, then the blocks), fp32 up to summation order, bf16 up to the output's rounding."""
    from monorl.model.rope import rope_cos_sin
    from monorl.ops.logprob_invariant import token_logprobs
    from monorl.ops.rmsnorm_invariant import bi_rms_norm

    torch.manual_seed(0)
    cuda = "cuda"
    ins = {"qkv": torch.randn(T, (Hq + 2 * Hkv) * D, device=cuda, dtype=dt),
           "qw": (1 + 0.3 * torch.randn(D, device=cuda)).to(dt), "kw": (1 + 0.3 * torch.randn(D, device=cuda)).to(dt),
           "x": torch.randn(T, hidden, device=cuda, dtype=dt), "a": torch.randn(T, hidden, device=cuda, dtype=dt),
           "w": (1 + 0.3 * torch.randn(hidden, device=cuda)).to(dt),
           "gu": 3 * torch.randn(T, 2 * inter, device=cuda, dtype=dt),
           "logits": 3 * torch.randn(T, 5000, device=cuda, dtype=dt)}
    cos, sin = rope_cos_sin(torch.arange(T, device=cuda) * 13, D, 1e6, dt)
    tokens = torch.randint(0, 5000, (T,), device=cuda)

    def grads(device: str) -> dict[str, torch.Tensor]:
        t = {k: v.detach().to(device, copy=True).requires_grad_(True) for k, v in ins.items()}
        q, k, _ = t["qkv"].split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        outs = (*block_kernels.qk_norm_rope(q, k, t["qw"], t["kw"], cos.to(device), sin.to(device), 1e-6),
                *block_kernels.add_rms_norm(t["x"], t["a"], t["w"], 1e-6), bi_rms_norm(t["a"], t["w"], 1e-6),
                block_kernels.silu_mul(*t["gu"].split([inter, inter], dim=-1)),
                token_logprobs(t["logits"], tokens.to(device), 0.7))
        g = torch.Generator().manual_seed(1)
        sum((o.float() * torch.randn(o.shape, generator=g).to(device)).sum() for o in outs).backward()
        return {k: v.grad.cpu() for k, v in t.items()}

    got, ref = grads(cuda), grads("cpu")  # the fallbacks run off CUDA
    tol = 1e-4 if dt == torch.float32 else 3e-2
    for name, r in ref.items():
        assert r.abs().max() > 0, name
        scale = r.float().abs().max().item()
        torch.testing.assert_close(got[name].float() / scale, r.float() / scale, atol=tol, rtol=0, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("T, Hq, Hkv, D", [(40, 16, 8, 128), (300, 32, 8, 128), (3, 4, 2, 16)])
def test_kv_write_in_the_qk_pass_equals_the_separate_write(T, Hq, Hkv, D):
    """`qk_norm_rope_write_kv` (the generator's q/k pass): q and k bitwise `qk_norm_rope`'s, and the KV cache as
    `write_kv` leaves it with them -- k and v at each token's slot, every other slot untouched."""
    torch.manual_seed(0)
    dt, cuda = torch.bfloat16, "cuda"
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device=cuda, dtype=dt)
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)  # column slices of one GEMM's output, as generated
    qw, kw = (1 + 0.3 * torch.randn(D, device=cuda)).to(dt), (1 + 0.3 * torch.randn(D, device=cuda)).to(dt)
    from monorl.model.rope import rope_cos_sin

    cos, sin = rope_cos_sin(torch.arange(T, device=cuda) * 7, D, 1e6, dt)
    blocks = T // 8 + 1  # twice the slots the tokens take, at least
    slots = torch.randperm(blocks * 16, device=cuda)[:T]
    cache = torch.randn(2, blocks, 16, Hkv, D, device=cuda, dtype=dt)
    expect = cache.clone()
    pq, pk = block_kernels.qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6)
    block_kernels.write_kv(pk, v.reshape(T, Hkv, D), expect, slots)
    got_q, got_k = block_kernels.qk_norm_rope_write_kv(q, k, v, qw, kw, cos, sin, 1e-6, cache, slots)
    assert torch.equal(got_q, pq) and torch.equal(got_k, pk)
    assert torch.equal(cache, expect)


@pytest.mark.gpu
def test_decode_rows_take_the_triton_gemm():
    """On Hopper a converted projection runs up to `matmul.gemv_rows` rows on the Triton GEMM (bitwise
    `matmul_invariant.linear`, close to cuBLAS) and more rows on cuBLAS (bitwise F.linear)."""
    from monorl.model.fused_kernels import FusedKernelsLinear
    from monorl.ops import matmul_invariant

    model = use_fused_kernels_(random_model(fused=True, device="cuda", dtype=torch.bfloat16))
    proj = model.model.layers[0].mlp.down_proj
    assert type(proj) is FusedKernelsLinear
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = tuned("matmul.gemv_rows", chip_of(0))
    x = torch.randn(rows + 1, proj.in_features, device="cuda", generator=g).bfloat16()
    if not matmul_invariant.faster_than_cublas(x[:rows]):
        pytest.skip("the decode tiling follows the row count on Hopper only; elsewhere cuBLAS runs every product")
    assert not matmul_invariant.faster_than_cublas(x)
    assert torch.equal(proj(x[:rows]), matmul_invariant.linear(x[:rows], proj.weight))
    torch.testing.assert_close(proj(x[:rows]), torch.nn.functional.linear(x[:rows], proj.weight), atol=2e-2, rtol=2e-2)
    assert torch.equal(proj(x), torch.nn.functional.linear(x, proj.weight))


@pytest.mark.gpu
def test_generator_on_fused_kernels_computes_the_model():
    """Decode (CUDA graphs) and prefill on the fused kernels: the log-probs of the generated tokens equal an eager
    full-sequence forward of the unconverted model (bf16 tolerance); the graph path equals the eager decode path."""
    model = random_model(fused=False, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(2, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 40, 17)]
    cfg = GeneratorConfig(max_num_seqs=6, max_model_len=256)
    gens = {graphs: Generator(model, cfg, compile=CompileConfig(backend="none", decode_cuda_graphs=graphs))
            for graphs in (True, False)}
    assert all(uses_fused_kernels(x.model) for x in gens.values())
    sp = SamplingParams(max_new_tokens=30, temperature=0.8, top_p=0.95, seed=3, ignore_eos=True)
    out = {graphs: x.generate(ps, sp, n=2) for graphs, x in gens.items()}
    assert [[c.token_ids for c in x] for x in out[True]] == [[c.token_ids for c in x] for x in out[False]]
    for p, comps in zip(ps, out[True], strict=True):
        for c in comps:
            torch.testing.assert_close(torch.tensor(c.logprobs), full_forward_logprobs(model, p, c.token_ids, 0.8),
                                       atol=0.1, rtol=0)
    off = Generator(model, GeneratorConfig(max_num_seqs=6, max_model_len=256, fused_kernels=False))
    assert not uses_fused_kernels(off.model)


@pytest.mark.gpu
def test_split_k_decode_products_compute_the_model(monkeypatch):
    """At Qwen3-0.6B's widths (two layers, a small vocabulary) the default mode's decode step takes o_proj and
    down_proj as fp32 K parts (`fused_kernels.project`; two up to 64 rows, 2-4 up to 192), summed by the next add +
    norm or the model's last add: the generated tokens' log-probs equal an eager forward of the model at 6 and 80
    rows, the graph path equals the eager one; the parts sum to the product, and the add + norm of the parts equals
    the one of their sum, bitwise."""
    import monorl.model.fused_kernels as fk
    from monorl.ops import decode_gemm

    cfg = dataclasses.replace(model_shape("qwen3-0.6b"), vocab_size=512, num_layers=2)
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16, seed=0).eval().requires_grad_(False)
    calls, split_k_parts = [], decode_gemm.split_k_parts
    monkeypatch.setattr(fk.decode_gemm, "split_k_parts",
                        lambda x, w: calls.append((x.shape[0], *w.shape)) or split_k_parts(x, w))
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 40, 17)]
    gcfg = GeneratorConfig(max_num_seqs=6, max_model_len=128)
    gens = {graphs: Generator(model, gcfg, compile=CompileConfig(backend="none", decode_cuda_graphs=graphs))
            for graphs in (True, False)}
    sp = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.95, seed=3, ignore_eos=True)
    out = {graphs: x.generate(ps, sp, n=2) for graphs, x in gens.items()}
    assert {(1024, 2048), (1024, 3072)} <= {c[1:] for c in calls}  # o_proj and down_proj took the split path
    assert [[(c.token_ids, c.logprobs) for c in x] for x in out[True]] == \
        [[(c.token_ids, c.logprobs) for c in x] for x in out[False]]
    for p, comps in zip(ps, out[True], strict=True):
        for c in comps:
            torch.testing.assert_close(torch.tensor(c.logprobs), full_forward_logprobs(model, p, c.token_ids, 0.8),
                                       atol=0.1, rtol=0)
    # 16- and 32-column tiles (Qwen3-0.6B's and 1.7B's down) at 40 rows; 64-row tiles and 4 or 2 parts above
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    chip = chip_of(0)
    for (N, K), M in itertools.product(((1024, 3072), (2048, 6144)), (40, 65, 128, 192)):
        x = torch.randn(M, K, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).bfloat16()
        w = (torch.randn(N, K, device="cuda") / K ** 0.5).bfloat16()
        P = decode_gemm.parts_for(M, N, sms, chip=chip)
        assert decode_gemm.split_k_fits(x, w) == (P > 1), (N, M, P)
        if P == 1:
            continue
        parts = split_k_parts(x, w)
        assert parts.shape == (P, M, N) and torch.equal(split_k_parts(x, w), parts)
        torch.testing.assert_close(parts.sum(0), x.float() @ w.float().t(), atol=1e-3, rtol=1e-3)
        h, ln = torch.randn(M, N, device="cuda").bfloat16(), torch.rand(N, device="cuda").bfloat16()
        got = block_kernels.add_parts_rms_norm(h, parts, ln, 1e-6)
        ref = block_kernels.add_rms_norm(h, decode_gemm.sum_parts(parts, h.dtype), ln, 1e-6)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    above = tuned("decode_gemm.mid_rows_max", chip) + 1
    x = torch.zeros(above, 3072, device="cuda").bfloat16()
    assert not decode_gemm.split_k_fits(x, w[:1024, :3072].contiguous())
    # a decode step of 80 rows (4-part products): log-probs of the model, graphs equal eager
    calls.clear()
    ps = [torch.randint(2, cfg.vocab_size, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (40,))]
    gcfg = GeneratorConfig(max_num_seqs=80, max_model_len=128)
    gens = {graphs: Generator(model, gcfg, compile=CompileConfig(backend="none", decode_cuda_graphs=graphs))
            for graphs in (True, False)}
    sp = SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.95, seed=4, ignore_eos=True)
    out = {graphs: x.generate(ps, sp, n=2) for graphs, x in gens.items()}
    assert {(80, 1024, 2048), (80, 1024, 3072)} <= set(calls)  # 80-row decode steps took the split path
    assert [[(c.token_ids, c.logprobs) for c in x] for x in out[True]] == \
        [[(c.token_ids, c.logprobs) for c in x] for x in out[False]]
    for p, comps in list(zip(ps, out[True], strict=True))[:8]:
        for c in comps:
            torch.testing.assert_close(torch.tensor(c.logprobs), full_forward_logprobs(model, p, c.token_ids, 0.8),
                                       atol=0.1, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("invariant", [False, True])
def test_prefill_graphs_equal_the_eager_prefill(invariant):
    """A prefill shape is captured at its third run and replayed after: rollouts (tokens, log-probs) equal a
    generator without graphs, bitwise, in both modes, over four batches of new prompts in one pack shape (eager,
    eager, eager + capture, replay) and one of another."""
    model = random_model(fused=False, device="cuda", dtype=torch.bfloat16)
    cfg = GeneratorConfig(max_num_seqs=8, max_model_len=256)
    gens = {graphs: Generator(model, cfg, compile=CompileConfig(backend="none", decode_cuda_graphs=graphs))
            for graphs in (True, False)}
    if invariant:
        for x in gens.values():
            make_batch_invariant_(x.model)
    g = torch.Generator().manual_seed(0)
    for trial, lengths in enumerate([(37, 50, 21)] * 4 + [(90, 3)]):
        ps = [torch.randint(2, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
        sp = SamplingParams(max_new_tokens=5, temperature=0.8, top_p=0.95, seed=trial, ignore_eos=True)
        out = {graphs: x.generate(ps, sp, n=2) for graphs, x in gens.items()}
        assert [[(c.token_ids, c.logprobs) for c in x] for x in out[True]] == \
            [[(c.token_ids, c.logprobs) for c in x] for x in out[False]], trial
    runner = gens[True].runner
    assert len(runner.prefill_graphs) == 1 and not gens[False].runner.prefill_graphs  # the shape seen 4 times


@pytest.mark.gpu
def test_entropy_kernel_equals_the_pytorch_entropy():
    """The trainer's entropy metric in one Triton pass against its PyTorch ops (the CPU path) on Qwen3-vocabulary
    logits: bf16 and fp32, temperatures, a nearly one-hot row and a uniform one, a column slice (row stride)."""
    from monorl.ops.entropy import token_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    V = 151936
    x = 4 * torch.randn(37, V + 8, device="cuda", generator=g)
    x[1] = -40.0
    x[1, 3] = 40.0
    x[2] = 0.5
    for dt in (torch.bfloat16, torch.float32):
        logits = x.to(dt)[:, :V]  # row stride V + 8
        for t in (1.0, 0.7, 1.3):
            got = token_entropy(logits, t)
            ref = token_entropy(logits.cpu(), t).cuda()
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=5e-5)  # fp32 sums over 151,936 logits, two orders
    assert got[1].item() < 1e-6 and abs(got[2].item() - torch.log(torch.tensor(float(V))).item()) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 2, 48, 64])
def test_sampler_kernels_pick_the_pytorch_samplers_tokens(B):
    """The Triton sampler against `sampling.sample`'s PyTorch ops on Qwen3-vocabulary bf16 logits: the same tokens
    (greedy, temperature, top-p; ties go to the lowest id), log-probs to fp32 rounding."""
    from monorl.generate.sampling import SamplingParams, sample

    g = torch.Generator(device="cuda").manual_seed(B)
    V = 151936
    logits = (4 * torch.randn(B, V, device="cuda", generator=g)).to(torch.bfloat16)
    logits[0, 11] = logits[0, 5] = 60  # a tie for greedy
    keys = torch.randint(0, 2**32, (B,), device="cuda", generator=g)
    pos = torch.randint(0, 4096, (B,), device="cuda", generator=g)
    for sp in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.8),
               SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.3, top_p=0.3),
               SamplingParams(temperature=0.6, top_p=0.999)):
        ref_tok, ref_lp = sample(logits, keys, pos, sp, kernels=False)
        tok, lp = sample(logits, keys, pos, sp)
        assert torch.equal(tok, ref_tok), (sp, (tok != ref_tok).sum().item())
        torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)
        if sp.greedy:
            assert tok[0].item() == 5


@pytest.mark.gpu
@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_sampler_kernels_never_pick_a_token_with_no_mass(top_p):
    """Gemma 3's 262,144 tokens, one holding all the mass: 4,096 rows all pick it (the kernel's uniform was once
    1.0 for one hash in 2**24: an infinite noise, a random token in 1.6% of rows at this vocabulary)."""
    from monorl.generate.sampling import SamplingParams, sample

    B, V = 4096, 262144
    logits = torch.full((B, V), -40.0, device="cuda", dtype=torch.bfloat16)
    logits[:, 7] = 0.0
    g = torch.Generator(device="cuda").manual_seed(1)
    keys = torch.randint(0, 2**32, (B,), device="cuda", generator=g)
    pos = torch.randint(0, 4096, (B,), device="cuda", generator=g)
    tok, _ = sample(logits, keys, pos, SamplingParams(temperature=0.8, top_p=top_p))
    assert (tok == 7).all(), f"{int((tok != 7).sum())} of {B} rows sampled a token with no mass"


@pytest.mark.gpu
def test_top_p_rows_inside_and_outside_the_nucleus():
    """A row whose Gumbel-max over the whole vocabulary lies in the nucleus keeps that token; the others run the
    nucleus search and a masked pass. Both kinds occur here, and every token equals the PyTorch sampler's."""
    from monorl.generate.sampling import SamplingParams, sample

    g = torch.Generator(device="cuda").manual_seed(7)
    B, V = 256, 151936
    logits = (2 * torch.randn(B, V, device="cuda", generator=g)).to(torch.bfloat16)
    keys = torch.randint(0, 2**32, (B,), device="cuda", generator=g)
    pos = torch.randint(0, 4096, (B,), device="cuda", generator=g)
    free, _ = sample(logits, keys, pos, SamplingParams(temperature=0.8))  # the same noise, no nucleus
    for top_p in (0.5, 0.95):
        sp = SamplingParams(temperature=0.8, top_p=top_p)
        tok, lp = sample(logits, keys, pos, sp)
        ref_tok, ref_lp = sample(logits, keys, pos, sp, kernels=False)
        assert torch.equal(tok, ref_tok), (top_p, (tok != ref_tok).sum().item())
        torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)
        moved = tok != free
        assert moved.any() and not moved.all(), (top_p, moved.sum().item())


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 40, 64])
def test_nucleus_without_sort_equals_the_sorted_scan(B):
    """bf16 logits' top-p threshold found 2 bits of the order key a level (`sample_kernels._nucleus_bisect`) is
    bitwise the one the sorted scan (`_nucleus_kernel`) takes, at several logit scales, with ties and both zeros."""
    from monorl.ops import sample_kernels as sk

    g = torch.Generator(device="cuda").manual_seed(B)
    V = 151936
    scale = float(2 ** (62 - V.bit_length()))
    chip = chip_of(0)
    nch = -(-V // tuned("sampler.chunk", chip))
    for spread in (0.05, 1.0, 4.0, 16.0):
        logits = (spread * torch.randn(B, V, device="cuda", generator=g)).to(torch.bfloat16)
        logits[0, :500] = 0.0
        logits[0, 500:1000] = -0.0
        logits[-1, 7:5000:3] = logits[-1, 5]  # many ties with one value
        for T, p in ((0.8, 0.95), (1.3, 0.3), (0.6, 0.999), (1.0, 0.5), (1.0, 0.9999)):
            inv_t = sk._fp32(1.0 / sk._fp32(T))
            top_p = torch.full((1,), p, dtype=torch.float64, device="cuda")
            got, ref = torch.empty(B, device="cuda"), torch.empty(B, device="cuda")
            sk._nucleus_bisect(logits, got, top_p, inv_t, scale, nch)
            srt = torch.sort(logits, dim=-1, descending=True).values.contiguous()
            sk._nucleus_kernel[(B,)](srt, ref, top_p, inv_t, scale, V=V, BLOCK=tuned("sampler.block", chip),
                                     num_warps=tuned("sampler.sort_path_warps", chip))
            assert torch.equal(got, ref), (spread, T, p)


def test_a_generator_on_the_kernels_is_not_compiled():
    """Inductor has nothing left to fuse in a copy on the fused kernels: `compile_generator` leaves its blocks and
    sampler alone (the trainer's model still compiles), and compiles an eager-ops copy as before."""
    from monorl.compile import compile_generator
    from monorl.generate.sampling import sample

    cc = CompileConfig(backend="inductor")
    for kernels in (True, False):
        model = random_model(fused=True)
        sampler, _ = compile_generator(model, sample, cc, torch.device("cpu"), "torch", fused_kernels=kernels)
        compiled = [layer._compiled_call_impl is not None for layer in model.model.layers]
        assert compiled == [not kernels] * len(compiled) and sampler is sample  # (the sampler compiles on CUDA only)
