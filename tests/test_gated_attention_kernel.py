"""Qwen3.5's gated full attention on the generator's kernels, run on CPU tensors by Triton's interpreter: the q/k
kernel (`block_kernels._qk_norm_rope_kernel`) with a partial rotary width and each query read from beside its
output gate (q's heads 2 * head_dim apart), its default case (whole heads, side by side) as before, the output gate
kernel (`attention_gate.sigmoid_gate_mul`), and the generator copy's layer and whole generator on them against the
plain path.

The interpreter has to be switched on before triton is imported, so `test_kernels_under_the_interpreter` runs this
file again in a subprocess with TRITON_INTERPRET=1; without triton (CPU CI) everything skips. fp32 only: the
interpreter computes bf16 wrongly (tests/test_sinks_triton.py). The kernels' sum of squares runs in another order
than torch's mean, hence the tolerances."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from monorl.model.attention import VarlenContext  # noqa: E402
from monorl.model.qwen3_5 import GatedAttention  # noqa: E402
from monorl.ops import attention_gate, block_kernels  # noqa: E402
from monorl.ops.offset_rmsnorm import offset_rms_norm_reference  # noqa: E402
from monorl.ops.rmsnorm_invariant import rms_norm_rows  # noqa: E402
from monorl.ops.rope import apply_rope  # noqa: E402
from tests.test_recurrent_state import HYBRID  # noqa: E402
from tests.triton_interpreter import cases, interpreter_patches, outer, run_this_file_interpreted  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
EPS = 1e-6


@outer
def test_kernels_under_the_interpreter():
    run_this_file_interpreted(__file__)


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    yield from interpreter_patches(monkeypatch, block_kernels, attention_gate)


@pytest.fixture
def kernels_on(monkeypatch):
    """The ops' CUDA branch (their kernels) for CPU tensors."""
    monkeypatch.setattr(block_kernels, "use_triton", lambda t: True)
    monkeypatch.setattr(attention_gate, "use_triton", lambda t: True)
    monkeypatch.setattr(attention_gate, "ENABLED", True)


def _inputs(T, Hq, Hkv, D, R, q_head_stride, seed=0):
    """q, k, v as column slices of one fused GEMM's output (q's heads q_head_stride apart, a gate beside each
    query when 2 * D), weights, cos / sin [T, R], a cache [2, 6 blocks, 4, Hkv, D] and T distinct slots."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, Hq * q_head_stride + 2 * Hkv * D, generator=g) * 3
    q, k, v = qkv.split([Hq * q_head_stride, Hkv * D, Hkv * D], dim=-1)
    qw, kw = torch.randn(2, D, generator=g) * 0.5
    ang = torch.rand(T, R // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    cache = torch.randn(2, 6, 4, Hkv, D, generator=g)
    slots = torch.randperm(24, generator=g)[:T]
    return q, k, v, qw, kw, cos, sin, cache, slots


def _reference(q, k, v, qw, kw, cos, sin, cache, slots, q_head_stride, offset):
    """The plain path, spelled out: per-head norm, RoPE of each head's first R dims (the rest passed through, as
    HF's apply_rotary_pos_emb with partial_rotary_factor), k and v written at their slots."""
    T, D, R = q.shape[0], qw.shape[0], cos.shape[-1]
    norm = offset_rms_norm_reference if offset else rms_norm_rows
    qh = norm(q.reshape(T, -1, q_head_stride)[..., :D], qw, EPS)
    kh = norm(k.reshape(T, -1, D), kw, EPS)
    qh, kh = (torch.cat([apply_rope(x[..., :R], cos, sin), x[..., R:]], dim=-1) for x in (qh, kh))
    cache = cache.clone()
    cache[0].view(-1, *kh.shape[1:])[slots] = kh
    cache[1].view(-1, *kh.shape[1:])[slots] = v.reshape(kh.shape)
    return qh, kh, cache


@cases
@pytest.mark.parametrize("Hq, Hkv, D, R", [(4, 2, 256, 64), (6, 2, 32, 8), (3, 1, 32, 16)],
                         ids=["qwen3.5-heads", "small", "odd-heads"])
@pytest.mark.parametrize("tokens", [1, 5])  # q and k heads in two programs a token, and in one (below)
def test_gated_partial_rope_kernel_equals_the_reference(kernels_on, monkeypatch, Hq, Hkv, D, R, tokens):
    """Qwen3.5's layout: q read from beside its gate, the (1 + w) norm, RoPE on the first R dims, the KV write."""
    monkeypatch.setattr(block_kernels, "tuned", lambda name, chip: 3 if name == "block.split_qk_tokens" else 4)
    q, k, v, qw, kw, cos, sin, cache, slots = _inputs(tokens, Hq, Hkv, D, R, 2 * D)
    want_q, want_k, want_cache = _reference(q, k, v, qw, kw, cos, sin, cache, slots, 2 * D, offset=True)
    got_q, got_k = block_kernels.offset_qk_norm_rope_write_kv(q, k, v, qw, kw, cos, sin, EPS, cache, slots, 2 * D)
    torch.testing.assert_close(got_q, want_q, **TOL)
    torch.testing.assert_close(got_k, want_k, **TOL)
    torch.testing.assert_close(cache, want_cache, **TOL)  # the slots' k and v, every other slot untouched
    assert torch.equal(cache[1].view(-1, Hkv, D)[slots], v.reshape(tokens, Hkv, D))


@cases
@pytest.mark.parametrize("op", ["qk_norm_rope", "qk_norm_rope_write_kv", "offset_qk_norm_rope_write_kv"])
def test_the_default_case_is_as_before(kernels_on, op):
    """Whole heads rotated, q's heads side by side: the existing callers' (Qwen3's, Gemma 3's) kernel."""
    T, Hq, Hkv, D = 5, 4, 2, 32
    q, k, v, qw, kw, cos, sin, cache, slots = _inputs(T, Hq, Hkv, D, D, D, seed=1)
    want_q, want_k, want_cache = _reference(q, k, v, qw, kw, cos, sin, cache, slots, D, offset=op.startswith("o"))
    fn = getattr(block_kernels, op)
    if op == "qk_norm_rope":
        got_q, got_k = fn(q, k, qw, kw, cos, sin, EPS)
    else:
        got_q, got_k = fn(q, k, v, qw, kw, cos, sin, EPS, cache, slots)
        torch.testing.assert_close(cache, want_cache, **TOL)
    torch.testing.assert_close(got_q, want_q, **TOL)
    torch.testing.assert_close(got_k, want_k, **TOL)


def test_the_fallback_is_the_reference():
    """Off CUDA the op runs the plain path itself (`partial_rope`): the same values as the spelled-out reference."""
    q, k, v, qw, kw, cos, sin, cache, slots = _inputs(3, 4, 2, 32, 8, 64, seed=2)
    want_q, want_k, want_cache = _reference(q, k, v, qw, kw, cos, sin, cache, slots, 64, offset=True)
    got_q, got_k = block_kernels.offset_qk_norm_rope_write_kv(q, k, v, qw, kw, cos, sin, EPS, cache, slots, 64)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(cache, want_cache)


@cases
@pytest.mark.parametrize("H, D", [(4, 256), (3, 32)])
def test_sigmoid_gate_mul_equals_the_eager_ops(kernels_on, H, D):
    g = torch.Generator().manual_seed(3)
    T = 5
    qg = torch.randn(T, H * 2 * D + 16, generator=g)[:, : H * 2 * D] * 4  # a column slice, as from the GEMM
    gate = qg.view(T, H, 2 * D)[..., D:]
    o = torch.randn(T, H, D, generator=g)
    got = attention_gate.sigmoid_gate_mul(o, gate)
    torch.testing.assert_close(got, o.flatten(1) * torch.sigmoid(gate.reshape(T, -1)), rtol=1e-6, atol=1e-6)


CFG = HYBRID.replace(head_dim=32)  # the hybrid tiny model's, heads wider: rotary_dim 8 of 32


def _layers(seed: int = 4) -> tuple[GatedAttention, GatedAttention]:
    """The generator's fused copy of a gated attention layer, eager and converted (its norms `FusedOffsetRMSNorm`,
    as `use_fused_norms_` converts them), the same weights."""
    from monorl.model.layers import FusedOffsetRMSNorm

    torch.manual_seed(seed)
    plain, fused = GatedAttention(CFG, fused=True), GatedAttention(CFG, fused=True)
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.3)
    fused.load_state_dict(plain.state_dict())
    fused.q_norm.__class__ = fused.k_norm.__class__ = FusedOffsetRMSNorm
    return plain, fused


@cases
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_the_generator_copys_layer_on_the_kernels_equals_the_plain_path(kernels_on, monkeypatch, phase):
    from monorl.generate.attention import DecodeContext, PrefillContext
    from monorl.model import qwen3_5
    from monorl.model.rope import model_rope

    calls = []
    op = qwen3_5.offset_qk_norm_rope_write_kv
    monkeypatch.setattr(qwen3_5, "offset_qk_norm_rope_write_kv", lambda *a: calls.append(1) or op(*a))
    plain, fused = _layers()
    D, Hkv, bs = CFG.head_dim, CFG.num_kv_heads, 4
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(2, 8, bs, Hkv, D, generator=g)  # (a decode's earlier keys: whatever the cache holds)
    if phase == "prefill":  # two prompts of 3 and 6 tokens in blocks [1] and [5, 2]
        positions = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 5])
        slots = torch.tensor([4, 5, 6, 20, 21, 22, 23, 8, 9])
        ctx = PrefillContext(VarlenContext.from_lengths([3, 6], "cpu"), slots)
    else:  # three sequences at lengths 3, 9 and 6 (the new token's included)
        positions = torch.tensor([2, 8, 5])
        slots = torch.tensor([6, 4 * 7 + 0, 4 * 3 + 1])
        ctx = DecodeContext(torch.tensor([[1, 0, 0], [5, 2, 7], [4, 3, 0]], dtype=torch.int32),
                            torch.tensor([3, 9, 6], dtype=torch.int32), slots)
    x = torch.randn(positions.shape[0], CFG.hidden_size, generator=g)
    cos, sin = model_rope(CFG, positions, torch.float32)
    assert cos.shape[-1] == 8 and not plain._kernels_serve(x, cache, slots)
    cache_plain, cache_fused = cache.clone(), cache.clone()
    with torch.no_grad():
        want = plain(x, cos, sin, ctx, cache_plain)
        got = fused(x, cos, sin, ctx, cache_fused)
    assert calls == [1]
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(cache_fused, cache_plain, **TOL)


def test_the_trainer_and_unconverted_copies_keep_the_plain_path():
    """Only the fused copy with converted norms, writing a KV cache, takes the kernels (CUDA or not aside)."""
    from monorl.model.layers import FusedOffsetRMSNorm

    trainer = GatedAttention(CFG)
    trainer.q_norm.__class__ = FusedOffsetRMSNorm  # (even so: no fused projection to read q beside its gate from)
    plain, fused = _layers()
    x, cache, slots = torch.zeros(2, 64), torch.zeros(2, 1), torch.zeros(2, dtype=torch.long)
    serve = lambda t, *a: True  # noqa: E731 (the device check passed)
    with pytest.MonkeyPatch.context() as m:
        m.setattr("monorl.model.qwen3_5.kernels_serve", serve)
        assert fused._kernels_serve(x, cache, slots)
        assert not plain._kernels_serve(x, cache, slots) and not trainer._kernels_serve(x, cache, slots)
        assert not fused._kernels_serve(x, cache, None)


@cases
def test_a_generator_on_the_kernels_equals_the_trainer_forward(kernels_on, monkeypatch):
    """The hybrid tiny model's generator copy, its norms converted and its gated attention on the kernels (forced
    on for CPU tensors): each sampled token's log-prob equal to the trainer's forward over the sequence."""
    from monorl.generate.sampling import SamplingParams
    from monorl.model import qwen3_5
    from monorl.model.decoder import build_model
    from monorl.model.fused_kernels import use_fused_norms_
    from tests.test_episodes import generator
    from tests.test_recurrent_state import trainer_logprobs

    calls = []
    op = qwen3_5.offset_qk_norm_rope_write_kv
    monkeypatch.setattr(qwen3_5, "offset_qk_norm_rope_write_kv", lambda *a: calls.append(1) or op(*a))
    model = build_model(HYBRID, seed=None).init_weights(3, std=0.2)
    gen = generator(model, max_num_seqs=3)
    use_fused_norms_(gen.model)  # as a CUDA generator with fused kernels converts its copy
    sp = SamplingParams(max_new_tokens=5, temperature=1.0, seed=11, ignore_eos=True)
    prompts = [[7, 9, 11], list(range(20, 50))]
    for prompt, samples in zip(prompts, gen.generate(prompts, sp, n=2), strict=True):
        for c in samples:
            _, lps = trainer_logprobs(model, prompt + c.token_ids, len(prompt))
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(lps), rtol=0, atol=1e-4)
    assert len(calls) >= 5  # the prefill and every decode step ran the kernels
