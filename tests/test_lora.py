"""LoRA (`monorl.model.lora`): against PEFT on HF transformers' Qwen3 (the oracle), the PEFT adapter format both
ways, merged checkpoints, weight sync into the generator's fused copy, and batch-invariant conversion. CPU, fp32."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from monorl.distributed.weight_sync import sync_weights_, weight_pairs
from monorl.model.attention import VarlenContext
from monorl.model.batch_invariant import BatchInvariantLinear, BatchInvariantLoRALinear, make_batch_invariant_
from monorl.model.config import ModelConfig
from monorl.model.decoder import build_model
from monorl.model.hf_checkpoint import load_checkpoint
from monorl.model.lora import (
    LoRAConfig,
    LoRALinear,
    apply_lora_,
    is_lora,
    load_adapter_,
    load_adapter_config,
    lora_parameters,
    lora_state_dict,
    save_adapter,
    save_merged_checkpoint,
)

CFG = LoRAConfig(rank=4, alpha=8.0)  # scale 2
TINY = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False)
LENGTHS = [9, 16, 4]


def seqs_of(vocab: int, lengths=LENGTHS, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def our_logits(model, seqs) -> torch.Tensor:
    ctx = VarlenContext.from_lengths([len(s) for s in seqs], "cpu")
    with torch.no_grad():
        return model.compute_logits(model(torch.cat(seqs), ctx.positions, ctx))


def hf_logits(model, seqs) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(s[None]).logits[0] for s in seqs])


@torch.no_grad()
def randomize_b_(model, seed: int = 1, std: float = 0.1):
    """B is zero after init (the adapter a no-op): make it non-zero so every comparison is a real one."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * std)
    return model


def lora_model(path, cfg: LoRAConfig = CFG, seed: int = 0):
    """Our model of an HF checkpoint with adapters (non-zero B)."""
    return randomize_b_(apply_lora_(load_checkpoint(path), cfg, seed=seed))


def one_line_error(fn, *args, exc=ValueError) -> str:
    with pytest.raises(exc) as e:
        fn(*args)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


# ---- config and conversion -------------------------------------------------------------------------

def test_config():
    assert not LoRAConfig().enabled and LoRAConfig().scale == 0.0
    assert LoRAConfig(rank=8, alpha=16).scale == 2.0 and LoRAConfig(rank=8).enabled
    assert LoRAConfig(rank=8).modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert LoRAConfig(rank=2, targets=("down", "q_proj", "q")).modules == ("q_proj", "down_proj")
    assert LoRAConfig(rank=2, targets="v,o").modules == ("v_proj", "o_proj")  # a CLI string
    assert LoRAConfig(rank=2, targets=["v"]).targets == ("v",)  # JSON has no tuples
    for kw, msg in [(dict(rank=-1), "lora.rank"), (dict(rank=True), "lora.rank"), (dict(rank=1.5), "lora.rank"),
                    (dict(alpha=0), "lora.alpha"), (dict(alpha=float("nan")), "lora.alpha"),
                    (dict(targets=("q", "lm_head")), "unknown ['lm_head']"), (dict(targets=()), "empty")]:
        assert msg in one_line_error(lambda kw=kw: LoRAConfig(**kw))


def test_apply_lora_freezes_the_base_and_adds_fp32_adapters():
    cfg = LoRAConfig(rank=4, alpha=8.0, targets=("q", "v", "down"))
    base = build_model(TINY, seed=0)
    model = apply_lora_(copy.deepcopy(base), cfg, seed=3, base_dtype=torch.bfloat16)
    assert is_lora(model) and not is_lora(base)
    names = {n for n, _ in model.named_parameters()}
    assert {"model.layers.1.self_attn.q_proj.lora_A.weight", "model.layers.1.mlp.down_proj.lora_B.weight",
            "model.layers.1.self_attn.q_proj.weight"} <= names
    assert not any("k_proj.lora" in n or "o_proj.lora" in n or "up_proj.lora" in n for n in names)
    adapters = [n for n in names if ".lora_" in n]
    assert len(adapters) == 2 * 3 * model.config.num_layers
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(adapters) == set(lora_state_dict(model))
    assert [id(p) for p in lora_parameters(model)] == [id(model.get_parameter(n)) for n in lora_state_dict(model)]
    for n, p in model.named_parameters():
        assert p.dtype == (torch.float32 if ".lora_" in n else torch.bfloat16), n
    q = model.model.layers[0].self_attn.q_proj
    assert q.lora_A.weight.shape == (4, 64) and q.lora_B.weight.shape == (q.out_features, 4) and q.scale == 2.0
    assert torch.count_nonzero(q.lora_B.weight) == 0
    assert 0 < q.lora_A.weight.abs().max() <= 64 ** -0.5  # PEFT's kaiming_uniform(a=sqrt(5)): U(+-1/sqrt(in))
    # deterministic for a seed, different across seeds
    again = apply_lora_(copy.deepcopy(base), cfg, seed=3)
    other = apply_lora_(copy.deepcopy(base), cfg, seed=4)
    assert torch.equal(again.model.layers[0].self_attn.q_proj.lora_A.weight, q.lora_A.weight)
    assert not torch.equal(other.model.layers[0].self_attn.q_proj.lora_A.weight, q.lora_A.weight)
    # B = 0: the adapted model is the base model, exactly
    seqs = seqs_of(base.config.vocab_size)
    assert torch.equal(our_logits(again, seqs), our_logits(base, seqs))
    # a bf16 base runs without autocast (adapters cast to the input's dtype) and under autocast
    assert our_logits(model, seqs).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert our_logits(randomize_b_(again), seqs).dtype == torch.bfloat16


def test_apply_lora_refusals():
    base = build_model(TINY, seed=0)
    lora = apply_lora_(copy.deepcopy(base), CFG)
    assert "already has LoRA" in one_line_error(apply_lora_, lora, CFG)
    assert "rank is 0" in one_line_error(apply_lora_, copy.deepcopy(base), LoRAConfig())
    assert "fused" in one_line_error(apply_lora_, build_model(base.config, fused=True), CFG)
    assert "before make_batch_invariant_" in one_line_error(apply_lora_, make_batch_invariant_(copy.deepcopy(base)),
                                                            CFG)
    assert "DecoderForCausalLM" in one_line_error(apply_lora_, torch.nn.Linear(2, 2), CFG, exc=TypeError)


def test_gradients_reach_only_the_adapters(make_hf_checkpoint):
    model = apply_lora_(load_checkpoint(make_hf_checkpoint()), CFG)
    model.train()

    def backward():
        model.zero_grad(set_to_none=True)
        seqs = seqs_of(model.config.vocab_size)
        ctx = VarlenContext.from_lengths([len(s) for s in seqs], "cpu")
        logits = model.compute_logits(model(torch.cat(seqs), ctx.positions, ctx))
        torch.log_softmax(logits, -1)[:, 3].mean().backward()

    backward()
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)
    for m in model.modules():
        if isinstance(m, LoRALinear):  # B = 0 at init: A gets no gradient yet, B does
            assert torch.count_nonzero(m.lora_A.weight.grad) == 0
            assert m.lora_B.weight.grad.abs().max() > 0
    randomize_b_(model)
    backward()
    assert all(m.lora_A.weight.grad.abs().max() > 0 for m in model.modules() if isinstance(m, LoRALinear))


def test_forward_compiles_without_graph_breaks():
    torch.manual_seed(0)
    model = randomize_b_(apply_lora_(build_model(TINY, seed=0), CFG))
    layer = model.model.layers[0]
    x = torch.randn(5, 64)
    compiled = torch.compile(layer.mlp, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), layer.mlp(x), rtol=0, atol=0)


# ---- PEFT interoperability -------------------------------------------------------------------------

def test_peft_loads_our_adapter(make_hf_checkpoint, load_hf_model, tmp_path):
    import peft

    path = make_hf_checkpoint(tie_word_embeddings=True)
    base, ours = load_checkpoint(path), lora_model(path)
    seqs = seqs_of(ours.config.vocab_size)
    a = our_logits(ours, seqs)
    assert (a - our_logits(base, seqs)).abs().max() > 0.05  # the adapters change the logits a lot
    out = save_adapter(ours, tmp_path / "adapter", base_model_name_or_path=str(path))
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    written = json.loads((out / "adapter_config.json").read_text())
    assert written["r"] == 4 and written["lora_alpha"] == 8.0 and written["peft_type"] == "LORA"
    assert written["target_modules"] == list(CFG.modules)
    ref = peft.PeftModel.from_pretrained(load_hf_model(path), out).eval()
    b = hf_logits(ref, seqs)
    assert (a - b).abs().max().item() < 1e-4


def test_peft_saved_adapter_loads_into_ours(make_hf_checkpoint, load_hf_model, tmp_path):
    import peft

    path = make_hf_checkpoint()
    lcfg = peft.LoraConfig(r=3, lora_alpha=6, target_modules=["k_proj", "o_proj", "up_proj"], lora_dropout=0.0,
                           init_lora_weights=False, task_type="CAUSAL_LM")  # False: B random too
    torch.manual_seed(0)
    ref = peft.get_peft_model(load_hf_model(path), lcfg).eval()
    ref.save_pretrained(tmp_path / "peft")
    cfg = load_adapter_config(tmp_path / "peft")
    assert (cfg.rank, cfg.scale, cfg.modules) == (3, 2.0, ("k_proj", "o_proj", "up_proj"))
    ours = load_adapter_(apply_lora_(load_checkpoint(path), cfg, seed=9), tmp_path / "peft")
    seqs = seqs_of(ours.config.vocab_size, seed=2)
    assert (our_logits(ours, seqs) - hf_logits(ref, seqs)).abs().max().item() < 1e-4


@pytest.mark.parametrize("tied", [False, True])
def test_merged_checkpoint_loads_in_transformers(make_hf_checkpoint, tmp_path, tied):
    import transformers

    path = make_hf_checkpoint(tie_word_embeddings=tied)
    ours = lora_model(path)
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    seqs = seqs_of(ours.config.vocab_size, seed=1)
    a = our_logits(ours, seqs)
    save_merged_checkpoint(ours, tmp_path / "merged")
    assert is_lora(ours) and all(torch.equal(before[n], p) for n, p in ours.named_parameters())  # untouched
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert (a - hf_logits(ref, seqs)).abs().max().item() < 1e-4
    plain = load_checkpoint(tmp_path / "merged")
    assert not is_lora(plain) and (our_logits(plain, seqs) - a).abs().max().item() < 1e-4
    save_merged_checkpoint(ours, tmp_path / "merged16", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in load_checkpoint(tmp_path / "merged16").parameters())


def test_adapter_round_trip_and_errors(make_hf_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_hf_checkpoint()
    ours = lora_model(path)
    d = save_adapter(ours, tmp_path / "a", CFG)
    fresh = apply_lora_(load_checkpoint(path), CFG, seed=5)
    load_adapter_(fresh, d)
    want = lora_state_dict(ours)
    got = lora_state_dict(fresh)
    assert got.keys() == want.keys() and all(torch.equal(t, want[n]) for n, t in got.items())

    def load_err(p, model=None) -> str:
        return one_line_error(load_adapter_, model or apply_lora_(load_checkpoint(path), CFG), p)

    assert "does not exist" in load_err(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    assert "adapter_config.json not found" in load_err(tmp_path / "empty")
    assert "no LoRA adapters" in load_err(d, load_checkpoint(path))
    assert "rank 2" in load_err(d, apply_lora_(load_checkpoint(path), LoRAConfig(rank=2, alpha=4.0)))
    assert "targets ['q_proj']" in load_err(d, apply_lora_(load_checkpoint(path), LoRAConfig(rank=4, targets="q")))
    assert "rank 4" in one_line_error(save_adapter, ours, tmp_path / "b", LoRAConfig(rank=4, alpha=4.0))

    def edited(name: str, conf=None, tensors=None):
        e = tmp_path / name
        e.mkdir()
        c = json.loads((d / "adapter_config.json").read_text())
        (e / "adapter_config.json").write_text(json.dumps({**c, **(conf or {})}))
        w = load_file(d / "adapter_model.safetensors")
        save_file(tensors(w) if tensors else w, e / "adapter_model.safetensors")
        return e

    assert "use_dora=True is not supported" in load_err(edited("dora", {"use_dora": True}))
    assert "peft_type is 'IA3'" in load_err(edited("ia3", {"peft_type": "IA3"}))
    assert "target_modules should be a list" in load_err(edited("regex", {"target_modules": ".*proj"}))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    missing = edited("missing", tensors=lambda w: {k: v for k, v in w.items() if k != key})
    assert "lacks 1 adapter tensors" in load_err(missing)
    extra = edited("extra", tensors=lambda w: {**w, "base_model.model.x.weight": w[key].clone()})
    assert "no place for" in load_err(extra)
    assert "has shape [4, 32]" in load_err(edited("shape", tensors=lambda w: {**w, key: w[key][:, :32].clone()}))
    bad = edited("corrupt")
    (bad / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    assert "cannot read" in load_err(bad)


# ---- weight sync and batch-invariant mode ------------------------------------------------------------

def test_sync_into_the_fused_generator_copy_merges(make_hf_checkpoint):
    ours = lora_model(make_hf_checkpoint())
    fused = build_model(ours.config, seed=None, fused=True)
    ptrs = [p.data_ptr() for p in fused.parameters()]
    sync_weights_(fused, ours)
    assert [p.data_ptr() for p in fused.parameters()] == ptrs  # in place
    pairs = weight_pairs(fused, ours)
    assert not any(".lora_" in n for n, _, _ in pairs)  # the adapters have no place of their own
    for name, view, s in pairs:
        m = ours.get_submodule(name.rpartition(".")[0])
        want = m.merged_weight() if isinstance(m, LoRALinear) else ours.get_parameter(name)
        assert torch.equal(view, want) and torch.equal(s, want), name
    q = ours.model.layers[1].self_attn.q_proj
    torch.testing.assert_close(q.merged_weight(), q.weight + q.scale * q.lora_B.weight @ q.lora_A.weight)
    seqs = seqs_of(ours.config.vocab_size)
    torch.testing.assert_close(our_logits(fused, seqs), our_logits(ours, seqs), atol=1e-5, rtol=1e-5)
    # a bf16 copy gets the fp32 merged weight cast once; a bf16 base merges in fp32 too
    fused16 = build_model(ours.config, seed=None, fused=True, dtype=torch.bfloat16)
    sync_weights_(fused16, ours)
    for name, view, s in weight_pairs(fused16, ours):
        assert torch.equal(view, s.to(torch.bfloat16)), name


def test_sync_into_an_unmerged_lora_copy(make_hf_checkpoint):
    ours = lora_model(make_hf_checkpoint())
    dst = apply_lora_(build_model(ours.config, seed=None), CFG)
    sync_weights_(dst, ours)
    assert all(torch.equal(p, ours.get_parameter(n)) for n, p in dst.named_parameters())
    seqs = seqs_of(ours.config.vocab_size)
    assert torch.equal(our_logits(dst, seqs), our_logits(ours, seqs))
    other = apply_lora_(build_model(ours.config, seed=None), LoRAConfig(rank=4, alpha=16.0))
    msg = one_line_error(sync_weights_, other, ours)
    assert msg.startswith("weight sync: ") and "LoRA scale 2, the destination's 4" in msg
    msg = one_line_error(sync_weights_, dst, load_checkpoint(make_hf_checkpoint()))  # adapters with no source
    assert "no source parameter for the destination's model.layers.0.self_attn.q_proj.lora_A.weight" in msg


def test_batch_invariant_lora(make_hf_checkpoint):
    ours = lora_model(make_hf_checkpoint())
    inv = make_batch_invariant_(copy.deepcopy(ours))
    q = inv.model.layers[0].self_attn.q_proj
    assert type(q) is BatchInvariantLoRALinear and type(q.lora_A) is BatchInvariantLinear
    assert type(inv.model.layers[0].self_attn.k_proj) is BatchInvariantLoRALinear
    seqs = seqs_of(ours.config.vocab_size)
    packed = our_logits(inv, seqs)
    torch.testing.assert_close(packed, our_logits(ours, seqs), atol=1e-4, rtol=1e-4)
    # invariant: a sequence alone gives the bits it gets packed with others
    assert torch.equal(our_logits(inv, seqs[1:2]), packed[LENGTHS[0]:LENGTHS[0] + LENGTHS[1]])
    # the converted model still trains its adapters, and an unmerged invariant copy synced from it is bitwise equal
    ctx = VarlenContext.from_lengths([len(s) for s in seqs], "cpu")
    inv.compute_logits(inv(torch.cat(seqs), ctx.positions, ctx)).logsumexp(-1).mean().backward()
    assert q.lora_A.weight.grad.abs().max() > 0 and q.weight.grad is None
    gen = make_batch_invariant_(apply_lora_(build_model(ours.config, seed=None), CFG))
    sync_weights_(gen, inv)
    assert torch.equal(our_logits(gen, seqs), packed)
