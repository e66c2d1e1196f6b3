"""Every model family (`monorl.model.families`: Qwen3, Llama, Qwen2) against transformers' own class on the same
checkpoint, through the shared pieces: the generator's fused copy, batch invariance, LoRA, checkpoints out and in,
the memory plan's parameter count. Tiny configs on CPU in fp32."""

from __future__ import annotations

import json

import pytest
import torch

from monorl.distributed.weight_sync import sync_weights_
from monorl.generate import Generator, GeneratorConfig, SamplingParams
from monorl.model.attention import VarlenContext
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import Llama3RopeScaling, ModelConfig, model_shape
from monorl.model.decoder import build_model
from monorl.model.hf_checkpoint import load_checkpoint, load_config, save_checkpoint
from monorl.model.lora import LoRAConfig, apply_lora_
from monorl.plan_params import param_counts
from monorl.train.packing import TrainSequence, pack, token_buckets
from monorl.train.trainer import Trainer, TrainerConfig
from tests.conftest import HF_FAMILY_CLASSES
from tests.test_model_parity import hf_logits, random_seqs
from tests.test_model_parity import our_logits as packed_logits

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# (family, config keywords for transformers' config class): each case a piece one family has that others lack
HF_CASES = {
    "qwen3-9q-3kv": ("qwen3", dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, head_dim=16)),
    # SmolLM2's shape in small: 9 / 3 heads, no head_dim in config.json (hidden / heads = 16), tied, theta 1e5
    "llama-smollm2": ("llama", dict(hidden_size=144, num_attention_heads=9, num_key_value_heads=3,
                                    tie_word_embeddings=True,
                                    rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    "llama-rope-llama3": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "llama-attention-bias": ("llama", dict(attention_bias=True)),
    "qwen2-biases": ("qwen2", dict()),
    "qwen2-tied-8q-1kv": ("qwen2", dict(tie_word_embeddings=True, num_attention_heads=8, num_key_value_heads=1,
                                        hidden_size=128)),
}



@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_logits_match_hf(make_hf_checkpoint, load_hf_model, case):
    family, kw = HF_CASES[case]
    path = make_hf_checkpoint(family=family, **kw)
    ours, ref = load_checkpoint(path), load_hf_model(path)
    assert type(ref).__name__ == HF_FAMILY_CLASSES[family][1]
    cfg = ours.config
    assert (cfg.model_type, cfg.num_heads, cfg.num_kv_heads) == (family, ref.config.num_attention_heads,
                                                                 ref.config.num_key_value_heads)
    assert cfg.head_dim == ref.model.layers[0].self_attn.head_dim
    assert (ours.lm_head is None) == ref.config.tie_word_embeddings
    attn = ours.model.layers[0].self_attn
    assert (attn.q_norm is not None) == (family == "qwen3")
    assert (attn.q_proj.bias is not None) == (ref.model.layers[0].self_attn.q_proj.bias is not None)
    assert (attn.o_proj.bias is not None) == (ref.model.layers[0].self_attn.o_proj.bias is not None)
    seqs = random_seqs([40, 7], cfg.vocab_size)  # past original_max_position_embeddings / high_freq_factor
    a, b = packed_logits(ours, seqs), hf_logits(ref, seqs)
    assert b.std() > 0.3  # logits are O(1), so the tolerance below is a real check
    assert (a - b).abs().max().item() < 1e-4


def test_llama3_rope_scaling_is_applied(make_hf_checkpoint):
    """The scaled frequencies change the logits (so the parity above checks the scaling, not just plain RoPE)."""
    ours = load_checkpoint(make_hf_checkpoint(family="llama", rope_parameters=LLAMA3_ROPE))
    assert ours.config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 64)
    unscaled = build_model(ours.config.replace(rope_scaling=None), seed=None)
    unscaled.load_state_dict(ours.state_dict())
    seqs = random_seqs([40], ours.config.vocab_size)
    assert (packed_logits(ours, seqs) - packed_logits(unscaled, seqs)).abs().max() > 1e-2


@pytest.mark.parametrize("case", ["llama-smollm2", "llama-rope-llama3", "qwen2-biases", "qwen3-9q-3kv"])
def test_save_load_round_trip_keeps_the_family(make_hf_checkpoint, load_hf_model, tmp_path, case):
    family, kw = HF_CASES[case]
    ours = load_checkpoint(make_hf_checkpoint(family=family, **kw))
    out = save_checkpoint(ours, tmp_path / "saved")
    hf = json.loads((out / "config.json").read_text())
    assert (hf["model_type"], hf["architectures"]) == (family, [HF_FAMILY_CLASSES[family][1]])
    assert load_config(out) == ours.config
    again, ref = load_checkpoint(out), load_hf_model(out)  # transformers reads monorl's config.json as the family
    assert type(ref).__name__ == HF_FAMILY_CLASSES[family][1]
    seqs = random_seqs([33], ours.config.vocab_size, seed=3)
    a = packed_logits(ours, seqs)
    assert torch.equal(packed_logits(again, seqs), a)
    assert (hf_logits(ref, seqs) - a).abs().max().item() < 1e-4


# ---- the shared pieces, on monorl-built models of each family --------------------------------------------------

# the tiny shape (head_dim 32: the fused block kernels' path) as each family, and a 9 / 3 head llama (SmolLM2's
# head counts, head_dim 16)
SHAPES = {
    "qwen3": model_shape("tiny"),
    "llama": model_shape("tiny").with_family("llama"),
    "llama-9q-3kv": model_shape("tiny").replace(num_heads=9, num_kv_heads=3, head_dim=16).with_family("llama"),
    "llama-bias-llama3": model_shape("tiny").replace(rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 16),
                                                     rope_theta=5e5).with_family("llama", attention_bias=True),
    "qwen2": model_shape("tiny").with_family("qwen2"),
}


def family_model(name: str, seed: int = 0) -> torch.nn.Module:
    return scaled_model(SHAPES[name], seed)


def scaled_model(cfg, seed: int = 0) -> torch.nn.Module:
    """Weights x5 (biases too), so logits are O(1) and greedy decoding is not degenerate (a MoE's routing is
    decided by margins)."""
    model = build_model(cfg, seed=seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if not n.endswith("norm.weight"):
                p.mul_(5.0)
    return model.eval()


def prompts_of(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def trainer_logprobs(model, seqs: list[TrainSequence], temperature: float) -> list[torch.Tensor]:
    """Each sequence's response log-probs from one packed trainer forward."""
    tr = Trainer(model, TrainerConfig(micro_batch_tokens=4096), total_steps=1)
    idx = list(range(len(seqs)))
    mb = pack(seqs, idx, token_buckets(4096, 16), "cpu")
    with torch.no_grad():
        lp = tr.response_logprobs(model, mb, temperature)
    return [lp[(mb.seq_ids == i) & (mb.token_mask > 0)] for i in idx]


def rollouts(model, prompts, sp: SamplingParams, batch_invariant: bool = False) -> list[TrainSequence]:
    gen = Generator(model, GeneratorConfig(max_num_seqs=4, max_model_len=128, block_size=4), eos_token_ids=())
    if batch_invariant:
        make_batch_invariant_(gen.model)
    out = gen.generate(prompts, sp, n=2)
    return [TrainSequence(p, c.token_ids, c.logprobs, 0.0) for p, cs in zip(prompts, out, strict=True) for c in cs]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_generator_logprobs_equal_the_trainers(name):
    """The generator's fused copy (q/k/v biases fused with their weights) against the trainer's forward."""
    model = family_model(name)
    prompts = prompts_of([3, 17, 1], model.config.vocab_size, seed=1)  # 6 sequences through 4 slots
    sp = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=3)
    seqs = rollouts(model, prompts, sp)
    assert len({tuple(s.completion_ids) for s in seqs}) > 3  # not degenerate
    for s, lp in zip(seqs, trainer_logprobs(model, seqs, 0.9), strict=True):
        torch.testing.assert_close(torch.tensor(s.old_logprobs), lp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama-9q-3kv"])
def test_batch_invariant_generator_equals_the_trainer_bitwise(name):
    """Batch-invariant mode (the fused block kernels' path without a q/k norm, biases in the invariant linear)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see tests/test_parity_everywhere.py: tiny tensors, shared CPU
    try:
        model = make_batch_invariant_(family_model(name, seed=2))
        prompts = prompts_of([5, 9], model.config.vocab_size, seed=4)
        seqs = rollouts(model, prompts, SamplingParams(max_new_tokens=6, temperature=0.9, seed=1), batch_invariant=True)
        for s, lp in zip(seqs, trainer_logprobs(model, seqs, 0.9), strict=True):
            assert torch.equal(torch.tensor(s.old_logprobs, dtype=torch.float32), lp)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["qwen2", "llama-bias-llama3"])
def test_lora_keeps_the_biases(name):
    """A LoRA projection adds its base's bias; the merged sync into the fused copy carries the biases too."""
    plain = family_model(name)
    adapted = apply_lora_(family_model(name), LoRAConfig(rank=4))
    with torch.no_grad():  # a non-zero update, so the merge is exercised
        for n, p in adapted.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    seqs = [torch.tensor(p) for p in prompts_of([9, 4], plain.config.vocab_size)]
    fused = build_model(plain.config, seed=None, fused=True)
    sync_weights_(fused, adapted)
    a = packed_logits(adapted, seqs)
    assert (a - packed_logits(plain, seqs)).abs().max() > 1e-2  # the adapters change something
    torch.testing.assert_close(packed_logits(fused, seqs), a, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_plan_counts_every_parameter(name):
    model = build_model(SHAPES[name], device="meta", seed=None)
    assert sum(param_counts(model.config).values()) == sum(p.numel() for p in model.parameters())


# ---- what is refused -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("hf,match", [
    ({"model_type": "llama", "mlp_bias": True}, "unsupported: mlp_bias=true"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "unsupported: use_sliding_window=true"),
    ({"model_type": "qwen2", "attention_bias": True}, "unsupported: attention_bias=true"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_type 'yarn'"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope_scaling.low_freq_factor must be a positive number"),
    ({"model_type": "mistral"}, "unsupported architecture: model_type='mistral'"),
    ({"model_type": "llama", "architectures": ["Qwen2ForCausalLM"]}, "unsupported architecture"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "unsupported partial_rotary_factor 0.5"),
])
def test_unsupported_configs_are_refused_in_one_line(hf, match):
    with pytest.raises(ValueError, match=match) as e:
        ModelConfig.from_hf(hf)
    assert "\n" not in str(e.value)


def test_a_config_states_its_family_consistently():
    with pytest.raises(ValueError, match="qk_norm=True is not llama's"):
        model_shape("tiny").replace(model_type="llama")
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        model_shape("tiny").with_family("gpt2")
    qwen2 = model_shape("tiny").with_family("qwen2")
    assert (qwen2.qk_norm, qwen2.qkv_bias, qwen2.o_bias) == (False, True, False)


def test_rope_op_backward_is_the_rotations_transpose():
    """`rope` (the opaque RoPE of the no-q/k-norm families' fused-kernels block) has a hand-written backward."""
    from monorl.model.rope import apply_rope, rope, rope_cos_sin

    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 3, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(5, 1, 8, generator=g, dtype=torch.float64, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(5) * 3, 8, 100.0, torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: rope(a, b, cos, sin), (q, k))
    out_q, out_k = rope(q, k, cos, sin)
    assert torch.equal(out_q, apply_rope(q, cos, sin)) and torch.equal(out_k, apply_rope(k, cos, sin))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_parity_verb_on_a_family_checkpoint(tmp_path, family):
    """`monorl parity` (the RL loop's own trainer and generator) on a checkpoint of another family: bitwise."""
    from monorl.model.tokenizer import CharTokenizer
    from monorl.parity import check_parity
    from monorl.presets import preset

    model = build_model(model_shape("tiny").with_family(family), seed=1)
    save_checkpoint(model, tmp_path / "ckpt", tokenizer=CharTokenizer())
    cfg = preset("tiny")
    cfg.device, cfg.batch_invariant, cfg.model.path = "cpu", True, str(tmp_path / "ckpt")
    cfg.rollout.max_new_tokens, cfg.validation.num_prompts = 6, 2
    r = check_parity(cfg, num_prompts=2, samples=2)
    assert r.passed and r.tokens_checked > 0 and r.max_abs_diff == 0.0


def test_compiled_invariant_llama_equals_eager_bitwise():
    """The opaque `rope` op under torch.compile (its fake and autograd registrations): a compiled batch-invariant
    Llama forward and backward give eager's bits."""
    torch._dynamo.reset()
    model = make_batch_invariant_(family_model("llama", seed=4))
    seqs = [torch.tensor(p) for p in prompts_of([7, 4], model.config.vocab_size, seed=5)]

    def loss_and_grads(m) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        ctx = VarlenContext.from_lengths([len(s) for s in seqs], "cpu")
        loss = model.compute_logits(m(torch.cat(seqs), ctx.positions, ctx)).logsumexp(-1).sum()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    eager = loss_and_grads(model)
    compiled = loss_and_grads(torch.compile(model, backend="aot_eager"))
    assert torch.equal(compiled[0], eager[0])
    assert all(torch.equal(a, b) for a, b in zip(compiled[1], eager[1], strict=True))
