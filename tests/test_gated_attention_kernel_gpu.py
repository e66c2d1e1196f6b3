"""Qwen3.5's gated full attention on the generator's kernels, on a GPU in bf16: the q/k kernel with partial RoPE and
each query read from beside its gate (`block_kernels.offset_qk_norm_rope_write_kv`, q_head_stride), the output gate
(`attention_gate.sigmoid_gate_mul`), each against the eager ops it replaces; the generator copy's layer on them
against its eager path (paged Triton decode, varlen prefill); and a CUDA generator whose converted copy is as close
to the trainer as the eager copy is. The interpreted CPU tests: tests/test_gated_attention_kernel.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")]


@pytest.fixture(autouse=True)
def kernels_enabled(monkeypatch):
    """The path under test, whatever `attention_gate.ENABLED`'s default."""
    from monorl.ops import attention_gate
    monkeypatch.setattr(attention_gate, "ENABLED", True)

BF16_STEP = dict(rtol=8e-3, atol=2e-2)  # one bf16 rounding apart (the row sums' order differs from torch's)
EPS = 1e-6


@pytest.mark.parametrize("tokens", [1, 64, 300])  # a decode step (q and k in two programs), a bigger one, a prefill
def test_gated_qk_norm_partial_rope_write_kv_in_bf16(tokens):
    from monorl.ops.block_kernels import offset_qk_norm_rope_write_kv
    from monorl.ops.offset_rmsnorm import offset_rms_norm_reference
    from monorl.ops.rope import apply_rope

    torch.manual_seed(1)
    T, Hq, Hkv, D, R = tokens, 8, 2, 256, 64  # Qwen3.5's full-attention heads: rotary_dim 64 of 256
    qkv = (torch.randn(T, (2 * Hq + 2 * Hkv) * D, device="cuda") * 3).bfloat16()
    qg, k, v = qkv.split([2 * Hq * D, Hkv * D, Hkv * D], dim=-1)
    qw, kw = (torch.randn(2, D, device="cuda") * 0.3).bfloat16()
    ang = torch.rand(T, R // 2, device="cuda") * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).bfloat16(), torch.cat([ang.sin()] * 2, -1).bfloat16()
    cache = torch.randn(2, 40, 16, Hkv, D, device="cuda").bfloat16()
    before = cache.clone()
    slots = torch.randperm(640, device="cuda")[:T]
    got_q, got_k = offset_qk_norm_rope_write_kv(qg, k, v, qw, kw, cos, sin, EPS, cache, slots, 2 * D)

    def eager(x, w):  # the layer's plain path: norm, RoPE of the first R dims, the rest passed through
        x = offset_rms_norm_reference(x, w, EPS)
        return torch.cat([apply_rope(x[..., :R], cos, sin), x[..., R:]], dim=-1)

    want_q = eager(qg.view(T, Hq, 2 * D)[..., :D], qw)
    want_k = eager(k.reshape(T, Hkv, D), kw)
    torch.testing.assert_close(got_q.float(), want_q.float(), **BF16_STEP)
    torch.testing.assert_close(got_k.float(), want_k.float(), **BF16_STEP)
    assert torch.equal(cache[0].view(-1, Hkv, D)[slots], got_k)
    assert torch.equal(cache[1].view(-1, Hkv, D)[slots], v.reshape(T, Hkv, D))
    untouched = torch.ones(640, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert torch.equal(cache.view(2, 640, Hkv, D)[:, untouched], before.view(2, 640, Hkv, D)[:, untouched])


def test_sigmoid_gate_mul_in_bf16():
    from monorl.ops.attention_gate import sigmoid_gate_mul

    torch.manual_seed(2)
    T, H, D = 64, 8, 256
    qg = (torch.randn(T, 2 * H * D + 1024, device="cuda") * 4).bfloat16()[:, : 2 * H * D]  # a column slice
    gate = qg.view(T, H, 2 * D)[..., D:]
    o = torch.randn(T, H, D, device="cuda").bfloat16()
    want = o.flatten(1) * torch.sigmoid(gate.reshape(T, -1))
    torch.testing.assert_close(sigmoid_gate_mul(o, gate).float(), want.float(), **BF16_STEP)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_the_generator_copys_layer_on_the_kernels_in_bf16(phase):
    from monorl.generate.attention import DecodeContext, PrefillContext
    from monorl.model.attention import VarlenContext
    from monorl.model.layers import FusedOffsetRMSNorm
    from monorl.model.qwen3_5 import GatedAttention
    from monorl.model.rope import model_rope
    from tests.test_recurrent_state import HYBRID

    cfg = HYBRID.replace(hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=256)  # rotary_dim 64
    torch.manual_seed(3)
    plain = GatedAttention(cfg, fused=True)
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.05)
    plain = plain.cuda().bfloat16()
    fused = GatedAttention(cfg, fused=True).cuda().bfloat16()
    fused.load_state_dict(plain.state_dict())
    fused.q_norm.__class__ = fused.k_norm.__class__ = FusedOffsetRMSNorm  # as `use_fused_norms_` converts them
    bs, B = 16, 6
    cache = torch.randn(2, 64, bs, cfg.num_kv_heads, cfg.head_dim, device="cuda").bfloat16()
    lengths = torch.tensor([1, 17, 40, 5, 64, 33])
    tables = torch.arange(B * 4, dtype=torch.int32, device="cuda").view(B, 4).flip(1)  # (blocks out of order)
    if phase == "prefill":
        positions = torch.cat([torch.arange(n) for n in lengths.tolist()]).cuda()
        seq = torch.repeat_interleave(torch.arange(B), lengths).cuda()
    else:  # each sequence's last token, its earlier keys whatever the cache holds
        positions, seq = (lengths - 1).cuda(), torch.arange(B, device="cuda")
    slots = (tables[seq, positions // bs].long() * bs + positions % bs).contiguous()
    if phase == "prefill":
        ctx = PrefillContext(VarlenContext.from_lengths(lengths.tolist(), "cuda"), slots)
    else:
        ctx = DecodeContext(tables, lengths.int().cuda(), slots, backend="triton")
    x = torch.randn(positions.shape[0], cfg.hidden_size, device="cuda").bfloat16()
    cos, sin = model_rope(cfg, positions, torch.bfloat16)
    cache_plain, cache_fused = cache.clone(), cache.clone()
    with torch.no_grad():
        assert fused._kernels_serve(x, cache_fused, slots)
        want = plain(x, cos, sin, ctx, cache_plain)
        got = fused(x, cos, sin, ctx, cache_fused)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(cache_fused.float(), cache_plain.float(), **BF16_STEP)
    assert torch.equal(cache_fused[1], cache_plain[1])  # v copied as it is


def generator_trainer_gaps(cfg, each=lambda gen, fused: None) -> dict[bool, torch.Tensor]:
    """|generator - trainer| log-prob of each sampled token, a CUDA generator with fused kernels (True) and
    without (False), against the trainer's fp32 forward on CPU (random weights of `cfg`); each(gen, fused) runs after
    each generation. Prints the gaps' mean and max."""
    from monorl.generate.generator import Generator, GeneratorConfig
    from monorl.generate.sampling import SamplingParams
    from monorl.model.decoder import build_model
    from monorl.train.packing import TrainSequence
    from tests.test_families import prompts_of, trainer_logprobs

    on_cpu = build_model(cfg, seed=None).init_weights(7, std=0.2)  # the trainer's reference: fp32, on CPU
    model = build_model(cfg, seed=None).init_weights(7, std=0.2).cuda()
    prompts = prompts_of([3, 21, 10, 30], cfg.vocab_size, seed=3)
    sp = SamplingParams(max_new_tokens=24, temperature=0.9, seed=2)
    gaps = {}
    for fused in (True, False):
        gen = Generator(model, GeneratorConfig(max_num_seqs=8, max_model_len=128, block_size=4,
                                               fused_kernels=fused), eos_token_ids=())
        out = gen.generate(prompts, sp, n=2)
        each(gen, fused)
        seqs = [TrainSequence(p, list(c.token_ids), list(c.logprobs), 0.0) for p, cs in zip(prompts, out, strict=True)
                for c in cs]
        ref = trainer_logprobs(on_cpu, seqs, 0.9)
        gaps[fused] = torch.cat([(torch.tensor(s.old_logprobs) - r).abs() for s, r in zip(seqs, ref, strict=True)])
    print(f"|generator - trainer| log-prob, mean / max: fused {gaps[True].mean():.4f} / {gaps[True].max():.4f}, "
          f"eager {gaps[False].mean():.4f} / {gaps[False].max():.4f}")
    return gaps


def test_a_converted_cuda_generator_is_as_close_to_the_trainer_as_the_eager_one(monkeypatch):
    from monorl.model import qwen3_5
    from tests.test_recurrent_state import HYBRID

    calls = []
    op = qwen3_5.offset_qk_norm_rope_write_kv
    monkeypatch.setattr(qwen3_5, "offset_qk_norm_rope_write_kv", lambda *a: calls.append(1) or op(*a))

    def ran_the_kernels(gen, fused):
        assert bool(calls) == fused  # the converted copy's attention layers ran the kernels
        calls.clear()

    gaps = generator_trainer_gaps(HYBRID.replace(head_dim=32), ran_the_kernels)  # rotary_dim 8
    assert gaps[True].mean() <= 1.5 * gaps[False].mean() + 2e-3
