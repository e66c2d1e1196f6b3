"""Qwen3-MoE (`monorl.model.moe`) against transformers' Qwen3MoeForCausalLM on the same checkpoint: logits, the
per-expert checkpoint names in and out, the expert paths against each other, and the load-balancing loss.
Tiny configs on CPU in fp32."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from monorl.model.attention import VarlenContext
from monorl.model.config import ModelConfig, model_shape
from monorl.model.decoder import build_model
from monorl.model.hf_checkpoint import load_checkpoint, load_config, save_checkpoint
from monorl.model.mlp import MLP
from monorl.model.moe import (
    SparseMoeBlock,
    experts_every_expert,
    experts_gathered,
    experts_grouped_mm,
    experts_loop,
    moe_blocks,
    route,
)
from monorl.plan_params import active_param_count, param_counts
from tests.test_model_parity import hf_logits, random_seqs
from tests.test_model_parity import our_logits as packed_logits

transformers = pytest.importorskip("transformers")

# HF config keywords for a tiny Qwen3-MoE (8 experts, top-2) beside make_hf_checkpoint's tiny attention
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, hidden_size=32, intermediate_size=48)
HF_CASES = {
    "norm-topk": dict(norm_topk_prob=True),
    "no-norm-topk": dict(norm_topk_prob=False),
    "dense-layer-0": dict(norm_topk_prob=True, mlp_only_layers=[0]),
    "sparse-step-2": dict(decoder_sparse_step=2, num_hidden_layers=3),
    "top-1-of-4": dict(num_experts=4, num_experts_per_tok=1),
}



@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_logits_match_hf(make_hf_checkpoint, load_hf_model, case):
    path = make_hf_checkpoint(family="qwen3_moe", **{**MOE, **HF_CASES[case]})
    ours, ref = load_checkpoint(path), load_hf_model(path)
    assert type(ref).__name__ == "Qwen3MoeForCausalLM"
    cfg = ours.config
    for i, (a, b) in enumerate(zip(ours.model.layers, ref.model.layers, strict=True)):
        assert isinstance(a.mlp, SparseMoeBlock) == (type(b.mlp).__name__ == "Qwen3MoeSparseMoeBlock"), i
        assert cfg.sparse_layer(i) == isinstance(a.mlp, SparseMoeBlock)
    assert any(isinstance(layer.mlp, MLP) for layer in ours.model.layers) == (case in ("dense-layer-0",
                                                                                      "sparse-step-2"))
    seqs = random_seqs([40, 7], cfg.vocab_size)
    a, b = packed_logits(ours, seqs), hf_logits(ref, seqs)
    assert b.std() > 0.3  # logits are O(1), so the tolerance below is a real check
    assert (a - b).abs().max().item() < 1e-4


def test_experts_receiving_no_tokens(make_hf_checkpoint, load_hf_model):
    """3 tokens x top-2 over 8 experts: at least 2 experts get no token in every layer; HF still agrees (and the
    per-expert slices skip the empty ones)."""
    from monorl.model.moe_routing import RouterTap

    path = make_hf_checkpoint(family="qwen3_moe", **MOE, norm_topk_prob=True)
    ours, ref = load_checkpoint(path), load_hf_model(path)
    seqs = random_seqs([3], ours.config.vocab_size, seed=1)
    with RouterTap(ours) as tap:
        a = packed_logits(ours, seqs)
    assert all(layer.unique().numel() <= 6 for layer in tap.experts())
    assert (a - hf_logits(ref, seqs)).abs().max().item() < 1e-4


def test_save_load_round_trip_uses_per_expert_names(make_hf_checkpoint, load_hf_model, tmp_path):
    path = make_hf_checkpoint(family="qwen3_moe", **MOE, norm_topk_prob=True, mlp_only_layers=[1])
    ours = load_checkpoint(path)  # a transformers save_pretrained: experts one by one
    out = save_checkpoint(ours, tmp_path / "saved")
    hf = json.loads((out / "config.json").read_text())
    assert (hf["model_type"], hf["architectures"], hf["num_experts"]) == ("qwen3_moe", ["Qwen3MoeForCausalLM"], 8)
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.layers.0.mlp.experts.7.gate_proj.weight").get_shape() == [24, 32]
        assert f.get_slice("model.layers.0.mlp.experts.7.down_proj.weight").get_shape() == [32, 24]
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in names)
    assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense layer keeps its MLP's names
    with safe_open(path / "model.safetensors", "pt") as f:
        assert names == set(f.keys())  # exactly transformers' own names
    assert load_config(out) == ours.config
    again, ref = load_checkpoint(out), load_hf_model(out)  # transformers loads monorl's export
    seqs = random_seqs([33], ours.config.vocab_size, seed=3)
    a = packed_logits(ours, seqs)
    assert torch.equal(packed_logits(again, seqs), a)
    assert (hf_logits(ref, seqs) - a).abs().max().item() < 1e-4


def test_stacked_expert_names_load_too(tmp_path):
    """A checkpoint with transformers' in-memory (stacked) expert names loads as well."""
    from safetensors.torch import save_file

    model = build_model(model_shape("tiny-moe"), seed=2)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text(json.dumps(model.config.to_hf("float32")))
    save_file({n: t.contiguous() for n, t in model.state_dict().items()}, tmp_path / "c" / "model.safetensors")
    again = load_checkpoint(tmp_path / "c")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values(),
                                                 strict=True))


# ---- the expert paths ------------------------------------------------------------------------------------------

def block_inputs(T: int, seed: int = 0, dead_expert: int | None = None):
    g = torch.Generator().manual_seed(seed)
    E, H, inter, k = 6, 16, 8, 2
    gate_up, down = torch.randn(E, 2 * inter, H, generator=g), torch.randn(E, H, inter, generator=g)
    x, logits = torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)
    if dead_expert is not None:
        logits[:, dead_expert] = -1e4
    weights, experts = route(logits, k, True)
    return x, weights, experts, gate_up, down


def reference_experts(x, weights, experts, gate_up, down) -> torch.Tensor:
    """Token by token, slot by slot: the definition."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(experts[t].tolist()):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("path", [experts_loop, experts_grouped_mm, experts_gathered, experts_every_expert])
@pytest.mark.parametrize("T,dead", [(1, None), (5, None), (37, 3)])
def test_every_expert_path_computes_the_definition(path, T, dead):
    args = block_inputs(T, seed=T, dead_expert=dead)
    if dead is not None:
        assert not (args[2] == dead).any()
    torch.testing.assert_close(path(*args), reference_experts(*args), atol=1e-4, rtol=1e-5)


def test_grouped_mm_backward_equals_the_loops():
    args = [a.requires_grad_() if a.is_floating_point() else a for a in block_inputs(23, seed=4)]
    grads = []
    for path in (experts_loop, experts_grouped_mm):
        for a in args:
            a.grad = None
        path(*args).square().sum().backward()
        grads.append([a.grad.clone() for a in args if a.is_floating_point()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


# ---- the load-balancing loss, the plan -------------------------------------------------------------------------

def test_aux_loss_equals_transformers_load_balancing_loss():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from monorl.model.moe_routing import RouterTap, load_balancing_loss

    model = build_model(model_shape("tiny-moe").replace(num_layers=3), seed=1)
    seqs = random_seqs([12, 5, 9], 128, seed=2)
    ctx = VarlenContext.from_lengths([len(s) for s in seqs], "cpu")
    with RouterTap(model) as tap:
        model(torch.cat(seqs), ctx.positions, ctx)
    logits = tap.logits()
    assert len(logits) == 3 and all(t.shape == (26, 8) and t.requires_grad for t in logits)
    ours = load_balancing_loss(logits, 8, 2)
    ref = load_balancing_loss_func(tuple(logits), 8, 2)
    torch.testing.assert_close(ours, ref, atol=0, rtol=1e-6)
    ours.backward()  # a gradient reaches the routers
    assert all(b.gate.weight.grad.abs().sum() > 0 for b in moe_blocks(model).values())


def test_plan_counts_total_and_active_parameters():
    cfg = model_shape("tiny-moe").replace(num_layers=3, mlp_only_layers=(1,))
    model = build_model(cfg, device="meta", seed=None)
    assert sum(param_counts(cfg).values()) == sum(p.numel() for p in model.parameters())
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert param_counts(cfg)["experts"] == 2 * cfg.num_experts * per_expert
    assert active_param_count(cfg) == sum(param_counts(cfg).values()) - 2 * (cfg.num_experts - 2) * per_expert
    big = model_shape("qwen3-30b-a3b")
    assert 30.0e9 < sum(param_counts(big).values()) < 31.0e9 and 3.0e9 < active_param_count(big) < 3.5e9


@pytest.mark.parametrize("hf,match", [
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 5}, "1 <= num_experts_per_tok"),
    ({"model_type": "qwen3_moe", "decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer"),
    ({"model_type": "qwen3_moe", "num_hidden_layers": 2, "mlp_only_layers": [2]}, "mlp_only_layers"),
    ({"model_type": "qwen3_moe", "use_sliding_window": True}, "unsupported: use_sliding_window=true"),
])
def test_bad_moe_configs_are_refused_in_one_line(hf, match):
    with pytest.raises(ValueError, match=match) as e:
        ModelConfig.from_hf(hf)
    assert "\n" not in str(e.value)


# ---- LoRA ------------------------------------------------------------------------------------------------------

def test_lora_against_peft(make_hf_checkpoint, load_hf_model, tmp_path):
    """LoRA on the attention projections saved by monorl, loaded by PEFT onto transformers' model: the same logits,
    and the generator's fused copy gets the merged weights. MLP targets are refused on a MoE model: PEFT 0.21 reads
    gate_proj / up_proj / down_proj there as the experts too (its transformers-5 weight conversion), and monorl
    does not adapt experts."""
    import peft

    from monorl.distributed.weight_sync import sync_weights_
    from monorl.model.lora import LoRAConfig, LoRALinear, apply_lora_, save_adapter

    path = make_hf_checkpoint(family="qwen3_moe", **MOE, norm_topk_prob=True, mlp_only_layers=[0])
    with pytest.raises(ValueError, match=r"lora.targets \['gate_proj', 'up_proj'\] on a mixture-of-experts") as e:
        apply_lora_(load_checkpoint(path), LoRAConfig(rank=4, targets=("q", "gate", "up")))
    assert "\n" not in str(e.value)
    base, ours = load_checkpoint(path), apply_lora_(load_checkpoint(path), LoRAConfig(rank=4, alpha=8.0,
                                                                                       targets=("q", "k", "v", "o")))
    with torch.no_grad():
        for m in ours.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(m.in_features))
    adapted = {n.split(".", 3)[-1] for n, m in ours.named_modules() if isinstance(m, LoRALinear)}
    assert not any("experts" in n or n.endswith("mlp.gate") for n in adapted)
    seqs = random_seqs([19, 6], ours.config.vocab_size, seed=4)
    a = packed_logits(ours, seqs)
    assert (a - packed_logits(base, seqs)).abs().max() > 0.05  # the adapters change the logits
    out = save_adapter(ours, tmp_path / "adapter", base_model_name_or_path=str(path))
    ref = peft.PeftModel.from_pretrained(load_hf_model(path), out).eval()
    assert (a - hf_logits(ref, seqs)).abs().max().item() < 1e-4
    fused = build_model(ours.config, seed=None, fused=True)  # the generator's copy: adapters merged in
    sync_weights_(fused, ours)
    torch.testing.assert_close(packed_logits(fused, seqs), a, atol=1e-4, rtol=1e-5)


def test_plan_advises_attention_lora_for_a_moe():
    """The plan's advice must be a run monorl accepts: LoRA on a MoE model adapts the attention only."""
    from monorl.plan import GiB, advise
    from monorl.presets import preset

    cfg = preset("tiny")
    advice = advise(cfg, model_shape("qwen3-30b-a3b"), 56, 141 * GiB)
    assert advice[0].startswith("--lora.rank 16 --lora.targets q,k,v,o")
