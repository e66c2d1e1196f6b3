"""Qwen3.5 (`monorl.model.qwen3_5`, model_type qwen3_5_text) against transformers' `Qwen3_5ForCausalLM`, its MoE
(qwen3_5_moe_text: every MLP a `monorl.model.moe.SparseMoeBlock` with a shared expert) against
`Qwen3_5MoeForCausalLM`, and the gated delta rule's references (`monorl.ops.gated_delta`) against each other. Tiny
configs, CPU, fp32."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from monorl.model.config import ModelConfig
from monorl.model.hf_checkpoint import load_checkpoint, save_checkpoint
from monorl.ops.gated_delta import causal_conv, chunk_gated_delta_rule, recurrent_gated_delta_rule
from tests.conftest import HF_FAMILY_CLASSES
from tests.test_model_parity import hf_logits, our_logits, random_seqs

transformers = pytest.importorskip("transformers")

# two Gated DeltaNet shapes (conv width, key / value head sizes, value heads per key head) and both layer kinds; the
# MoE family (8 experts, top-2, a shared expert of another width) on the first shape
MOE = dict(family="qwen3_5_moe_text", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)
CASES = {
    "k4-gva": dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=16,
                   linear_num_key_heads=2, linear_num_value_heads=4),
    "k2-tied": dict(linear_conv_kernel_dim=2, linear_key_head_dim=16, linear_value_head_dim=8,
                    linear_num_key_heads=2, linear_num_value_heads=2, tie_word_embeddings=True,
                    layer_types=["full_attention", "linear_attention", "linear_attention"], num_hidden_layers=3),
}
CASES["moe-k4-gva"] = {**CASES["k4-gva"], **MOE}
CASES["moe-k2-tied"] = {**CASES["k2-tied"], **MOE}


@pytest.fixture
def qwen3_5(make_hf_checkpoint):
    def make(case: str):
        kw = {"num_hidden_layers": 4, "head_dim": 16, "family": "qwen3_5_text", **CASES[case]}
        return make_hf_checkpoint(**kw)
    return make


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf(qwen3_5, load_hf_model, case):
    path = qwen3_5(case)
    ours, ref = load_checkpoint(path), load_hf_model(path)
    assert type(ref).__name__ == HF_FAMILY_CLASSES[CASES[case].get("family", "qwen3_5_text")][1]
    cfg = ours.config
    assert set(cfg.layer_types) == {"linear_attention", "full_attention"}
    assert cfg.rotary_dim == 4  # a quarter of head_dim 16
    seqs = random_seqs([70, 7, 130], cfg.vocab_size)  # several chunks of 64, a partial one, a short sequence
    a, b = our_logits(ours, seqs), hf_logits(ref, seqs)
    assert b.std() > 0.3
    assert (a - b).abs().max().item() < 1e-4


def test_a_pack_equals_each_sequence_alone(qwen3_5):
    """The pack's conv and delta-rule states start from zero at each sequence start."""
    ours = load_checkpoint(qwen3_5("k4-gva"))
    seqs = random_seqs([9, 70, 3], ours.config.vocab_size, seed=1)
    packed = our_logits(ours, seqs)
    alone = torch.cat([our_logits(ours, [s]) for s in seqs])
    assert (packed - alone).abs().max().item() < 1e-3  # GEMMs of other row counts round differently


@pytest.mark.parametrize("case", ["k2-tied", "moe-k2-tied"])
def test_save_then_transformers_loads(qwen3_5, tmp_path, case):
    ours = load_checkpoint(qwen3_5(case))
    save_checkpoint(ours, tmp_path / "out")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(ref).__name__ == HF_FAMILY_CLASSES[CASES[case].get("family", "qwen3_5_text")][1]
    seqs = random_seqs([33], ours.config.vocab_size)
    assert (our_logits(ours, seqs) - hf_logits(ref, seqs)).abs().max().item() < 1e-4
    assert ModelConfig.from_hf(json.loads((tmp_path / "out" / "config.json").read_text())) == ours.config


@pytest.mark.parametrize("case,outer", [("k4-gva", "qwen3_5"), ("moe-k4-gva", "qwen3_5_moe")])
def test_vision_language_checkpoint_loads_its_language_model(qwen3_5, tmp_path, case, outer):
    """A `Qwen3_5(Moe)ForConditionalGeneration` directory: text_config nested, weights under
    model.language_model.*, a vision tower and an MTP head read past."""
    path = qwen3_5(case)
    text = json.loads((path / "config.json").read_text())
    out = tmp_path / "vl"
    out.mkdir()
    arch = "Qwen3_5MoeForConditionalGeneration" if outer == "qwen3_5_moe" else "Qwen3_5ForConditionalGeneration"
    (out / "config.json").write_text(json.dumps({
        "architectures": [arch], "model_type": outer, "text_config": text,
        "vision_config": {"depth": 1}, "tie_word_embeddings": False}))
    state = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
             for k, v in load_file(path / "model.safetensors").items()}
    state["model.visual.patch_embed.weight"] = torch.zeros(2)
    state["mtp.fc.weight"] = torch.zeros(2)
    save_file(state, out / "model.safetensors")
    seqs = random_seqs([20], text["vocab_size"])
    assert torch.equal(our_logits(load_checkpoint(out), seqs), our_logits(load_checkpoint(path), seqs))


def test_config_json_errors_are_one_line():
    base = dict(ModelConfig.from_hf({"model_type": "qwen3_5_text", "num_hidden_layers": 4}).to_hf())
    with pytest.raises(ValueError, match="linear_num_value_heads .* multiple of linear_num_key_heads"):
        ModelConfig.from_hf({**base, "linear_num_key_heads": 3, "linear_num_value_heads": 4})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_hf({**base, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 2.0}})
    cfg = ModelConfig.from_hf({"model_type": "qwen3_5_text", "num_hidden_layers": 8})
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + (
        "full_attention",)  # HF's full_attention_interval 4
    assert cfg.partial_rotary_factor == 0.25


def test_moe_config_reads_as_transformers_and_refuses_what_it_does_not_run():
    """An empty qwen3_5_moe_text config.json resolves to Qwen3_5MoeTextConfig's values; the routing keys its class
    ignores (every layer sparse, top-k renormalised) are refused in one line when they say otherwise."""
    cfg, hf = ModelConfig.from_hf({"model_type": "qwen3_5_moe_text"}), transformers.Qwen3_5MoeTextConfig()
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size,
            cfg.num_layers, cfg.hidden_size, cfg.router_aux_loss_coef) == (
        hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.shared_expert_intermediate_size,
        hf.num_hidden_layers, hf.hidden_size, hf.router_aux_loss_coef)
    assert cfg.layer_types == tuple(hf.layer_types) and cfg.norm_topk_prob
    assert all(cfg.sparse_layer(i) for i in range(cfg.num_layers))
    base = cfg.to_hf()
    assert ModelConfig.from_hf(base) == cfg
    # what Qwen3-Next-style config.json files state, and transformers' behaviour: accepted
    assert ModelConfig.from_hf({**base, "mlp_only_layers": [], "decoder_sparse_step": 1, "norm_topk_prob": True}) == cfg
    for key, value in (("mlp_only_layers", [0]), ("decoder_sparse_step", 2), ("norm_topk_prob", False)):
        with pytest.raises(ValueError, match=f"unsupported {key}=.* must be") as e:
            ModelConfig.from_hf({**base, key: value})
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size must be a positive integer"):
        ModelConfig.from_hf({**base, "shared_expert_intermediate_size": 0})
    with pytest.raises(ValueError, match="routes every layer's MLP"):  # a config no Qwen3_5MoeForCausalLM holds
        cfg.replace(mlp_only_layers=(1,)).to_hf()


# ---- the kernels' references --------------------------------------------------------------------------------

def _inputs(lengths: list[int], hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k = torch.randn(T, hk, dk, generator=g), torch.randn(T, hk, dk, generator=g)
    v = torch.randn(T, hv, dv, generator=g)
    decay = -torch.nn.functional.softplus(torch.randn(T, hv, generator=g))
    beta = torch.rand(T, hv, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    state = torch.randn(len(lengths), hv, dk, dv, generator=g)
    return q, k, v, decay, beta, cu, state


@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent_on_a_pack(with_state):
    q, k, v, g, beta, cu, state = _inputs([1, 70, 0, 130, 64])
    init = state if with_state else None
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, cu, init)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, cu, init)
    assert (o_c - o_r).abs().max().item() < 1e-4
    assert (s_c - s_r).abs().max().item() < 1e-4
    if with_state:  # the state is read: a pack continued from it differs from one from zeros
        assert (o_c - chunk_gated_delta_rule(q, k, v, g, beta, cu)[0]).abs().max() > 1e-2


def test_chunked_continues_from_its_final_state():
    """A sequence in two pieces, the second from the first's final state, equals it whole (a turn boundary)."""
    q, k, v, g, beta, _, _ = _inputs([100], seed=2)
    whole, s_whole = chunk_gated_delta_rule(q, k, v, g, beta, torch.tensor([0, 100]))
    cut = 37
    a, s_a = chunk_gated_delta_rule(q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], torch.tensor([0, cut]))
    b, s_b = chunk_gated_delta_rule(q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:], torch.tensor([0, 100 - cut]),
                                    s_a)
    assert (torch.cat([a, b]) - whole).abs().max().item() < 1e-4
    assert (s_b - s_whole).abs().max().item() < 1e-4
    step, _ = recurrent_gated_delta_rule(q[cut:cut + 1], k[cut:cut + 1], v[cut:cut + 1], g[cut:cut + 1],
                                         beta[cut:cut + 1], torch.tensor([0, 1]), s_a)  # one decode step
    assert (step[0] - whole[cut]).abs().max().item() < 1e-4


def test_causal_conv_carries_its_state():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(30, 6, generator=g), torch.randn(6, 4, generator=g)
    F = torch.nn.functional
    ref = F.silu(F.conv1d(x.t()[None], w[:, None], padding=3, groups=6)[0, :, :30].t())
    whole, final = causal_conv(x, w, torch.tensor([0, 30]), None)
    assert (whole - ref).abs().max().item() < 1e-5
    a, s = causal_conv(x[:2], w, torch.tensor([0, 2]), None)  # shorter than the state: zeros kept in it
    b, s = causal_conv(x[2:], w, torch.tensor([0, 28]), s)
    assert (torch.cat([a, b]) - whole).abs().max().item() < 1e-6
    assert torch.equal(s, final) and torch.equal(final[0], x[-3:])
    # a pack of several (and an empty) sequence: each from its own state
    packed, _ = causal_conv(x, w, torch.tensor([0, 2, 2, 30]), None)
    alone = causal_conv(x[2:], w, torch.tensor([0, 28]), None)[0]
    assert torch.equal(packed[:2], a) and (packed[2:] - alone).abs().max() < 1e-6


def _conv_by_one_gather(x, weight, cu_seqlens, initial):
    """The conv as one [T, K] gather of x and the states (how causal_conv computed it before #58's session 20):
    the same products, added in the same order."""
    T, C = x.shape
    K, N = weight.shape[1], cu_seqlens.shape[0] - 1
    src = torch.cat([x, initial.to(x.dtype).reshape(N * (K - 1), C)])
    cu = cu_seqlens.long()
    t = torch.arange(T)
    seq = torch.searchsorted(cu, t, right=True) - 1
    p = (t - cu[seq])[:, None] - torch.arange(K - 1, -1, -1)
    idx = torch.where(p >= 0, t[:, None] - torch.arange(K - 1, -1, -1), T + seq[:, None] * (K - 1) + (K - 1) + p)
    taps = src[idx] * weight.t().to(x.dtype)
    out = taps[:, 0]
    for i in range(1, K):
        out = out + taps[:, i]
    n = cu[1:] - cu[:-1]
    q = n[:, None] - (K - 1) + torch.arange(K - 1)
    fidx = torch.where(q >= 0, cu[:-1, None] + q, T + torch.arange(N)[:, None] * (K - 1) + (K - 1) + q)
    return torch.nn.functional.silu(out), src[fidx]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv_by_taps_equals_one_gather_bitwise(dtype):
    """causal_conv's laid-out taps (each a gather of distinct rows: a cheap backward) give the one-gather form's
    outputs and final states bit for bit (same products, same order of sums; batch-invariant mode's generator and
    trainer both rely on that order), and its gradients, on a pack with states, an empty and a 1-token sequence."""
    g = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 1, 1, 9, 40])
    x = torch.randn(40, 12, generator=g).to(dtype)
    w = torch.randn(12, 4, generator=g)
    init = torch.randn(4, 3, 12, generator=g).to(dtype)
    leaves = [[t.clone().requires_grad_() for t in (x, w, init)] for _ in range(2)]
    got = causal_conv(*leaves[0][:2], cu, leaves[0][2])
    want = _conv_by_one_gather(*leaves[1][:2], cu, leaves[1][2])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    up = torch.randn(40, 12, generator=g).to(dtype), torch.randn(4, 3, 12, generator=g).to(dtype)
    for out in (got, want):
        ((out[0].float() * up[0].float()).sum() + (out[1].float() * up[1].float()).sum()).backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(leaves[0], leaves[1], strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=tol, rtol=tol)


def test_a_trainer_pack_has_one_layout_per_forward():
    """Every Gated DeltaNet layer of one trainer forward shares the first layer's layout (and with it the one set of
    fla bounds a forward makes: fla memoizes its chunk indices by their identity); a context whose bounds tensor
    was replaced gets a new one, never the old pack's."""
    from types import SimpleNamespace

    from monorl.model.qwen3_5 import layout_of

    ctx = SimpleNamespace(cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32))
    first = layout_of(ctx, None)
    assert layout_of(ctx, None) is first and first.rows is None
    assert first.bounds() is None  # off CUDA (or without fla) the references read the bounds themselves
    ctx.cu_seqlens = torch.tensor([0, 5], dtype=torch.int32)
    again = layout_of(ctx, None)
    assert again is not first and again.cu_seqlens is ctx.cu_seqlens
