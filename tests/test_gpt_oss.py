"""GPT-OSS (`monorl.model.gpt_oss`, model_type gpt_oss) against transformers' GptOssForCausalLM on tiny random
checkpoints (fp32, CPU, eager attention): both layer kinds with a window shorter than the sequences, attention sinks,
several experts with top-k > 1, YaRN RoPE; its config.json both ways; packed sequences against each alone; and the
sink attention of each context against a dense reference."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from monorl.model.attention import VarlenContext
from monorl.model.config import ModelConfig, model_shape
from monorl.model.hf_checkpoint import load_checkpoint, save_checkpoint
from tests.conftest import randomize_hf_model
from tests.test_model_parity import hf_logits, random_seqs
from tests.test_model_parity import our_logits as packed_logits

transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16, "rope_theta": 1000.0}
BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=5,
            num_local_experts=6, num_experts_per_tok=3, rope_parameters=YARN, bos_token_id=2, eos_token_id=1,
            pad_token_id=0)
CASES = {
    "yarn-window-5": dict(),
    # the window on layer 1 and 2, one kv head, top-2 of 4, an explicit attention factor, truncated ramp, tied head
    "tied-yarn-truncate": dict(layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                            "full_attention"], num_key_value_heads=1, num_local_experts=4,
                               num_experts_per_tok=2, sliding_window=3, tie_word_embeddings=True,
                               rope_parameters={**YARN, "truncate": True, "attention_factor": 1.2}),
    # plain RoPE, transformers 4 style (rope_scaling / rope_theta at the top level), another clamp
    "default-rope-legacy": dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0}, swiglu_limit=1.5),
}


def hf_config(**kw) -> transformers.GptOssConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.GptOssConfig(**{**BASE, **kw})


def make_gpt_oss(path: Path, seed: int = 0, legacy: bool = False, **kw) -> Path:
    """A random transformers GptOssForCausalLM saved to `path` (std 0.1 weights, norms ~1; sinks O(1))."""
    model = transformers.GptOssForCausalLM(hf_config(**kw))
    with torch.no_grad():
        randomize_hf_model(model, seed)
        for layer in model.model.layers:  # sinks large enough to matter next to the scores
            layer.self_attn.sinks.mul_(20.0)
    model.save_pretrained(path)
    if legacy:  # config.json as transformers 4 wrote it
        cfg = json.loads((path / "config.json").read_text())
        rope = cfg.pop("rope_parameters")
        scaling = None if rope["rope_type"] == "default" else rope
        (path / "config.json").write_text(json.dumps({**cfg, "rope_theta": rope.pop("rope_theta"),
                                                      "rope_scaling": scaling}))
    return path


def load_hf(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf(tmp_path, case):
    path = make_gpt_oss(tmp_path, legacy=case.endswith("legacy"), **CASES[case])
    ours, ref = load_checkpoint(path), load_hf(path)
    assert type(ref).__name__ == "GptOssForCausalLM"
    cfg = ours.config
    assert cfg.layer_types == tuple(ref.config.layer_types) and len(set(cfg.layer_types)) == 2
    assert cfg.sliding_window == ref.config.sliding_window and cfg.num_experts_per_tok > 1
    seqs = random_seqs([24, 9, 17], cfg.vocab_size, seed=1)  # several sequences in one pack, all past the window
    a, b = packed_logits(ours, seqs), hf_logits(ref, seqs)
    assert b.std() > 0.3  # O(1) logits: the tolerance is a real check
    diff = (a - b).abs().max().item()
    print(f"{case}: max |monorl - transformers| = {diff:.2e}")
    assert diff <= 1e-4
    alone = torch.cat([packed_logits(ours, [s]) for s in seqs])
    assert (a - alone).abs().max().item() <= 1e-4


@pytest.mark.parametrize("piece", ["sinks", "window", "yarn", "clamp"])
def test_each_piece_changes_the_logits(tmp_path, piece):
    """The parity above is no accident of a piece that never bites: without it the logits move."""
    path = make_gpt_oss(tmp_path, swiglu_limit=0.5)
    ours = load_checkpoint(path)
    seqs = random_seqs([24], ours.config.vocab_size, seed=1)
    before = packed_logits(ours, seqs)
    if piece == "yarn":
        ours.config = ours.config.replace(rope_scaling=None)
    for layer in ours.model.layers:
        if piece == "sinks":
            layer.self_attn.sinks.data.fill_(-1e9)
        elif piece == "window":
            layer.self_attn.window = 0
        elif piece == "clamp":
            layer.mlp.limit = 1e9
    assert (packed_logits(ours, seqs) - before).abs().max().item() > 1e-2


def test_saved_checkpoint_loads_in_transformers(tmp_path):
    ours = load_checkpoint(make_gpt_oss(tmp_path / "hf", seed=3, **CASES["tied-yarn-truncate"]))
    save_checkpoint(ours, tmp_path / "out", dtype=torch.float32)
    ref = load_hf(tmp_path / "out")
    assert ref.config.layer_types == list(ours.config.layer_types)
    seqs = random_seqs([20], ours.config.vocab_size, seed=2)
    assert (packed_logits(ours, seqs) - hf_logits(ref, seqs)).abs().max().item() <= 1e-4
    again = ModelConfig.from_hf(json.loads((tmp_path / "out" / "config.json").read_text()))
    assert again == ours.config


def test_gpt_oss_20b_shape_is_the_released_config():
    cfg = model_shape("gpt-oss-20b")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = transformers.GptOssConfig(num_hidden_layers=24, num_local_experts=32)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_experts) == (2880, 64, 8, 64, 32)
    assert cfg.layer_types == tuple(ref.layer_types) and cfg.sliding_window == 128
    assert cfg.rope_scaling.factor == 32.0 and cfg.rope_theta == 150000.0


@pytest.mark.parametrize("key,value,match", [
    ("quantization_config", {"quant_method": "mxfp4"}, "quantized"),
    ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1.0}, "rope_type"),
    ("sliding_window", None, "sliding_window"),
    ("layer_types", ["chunked_attention"] * 4, "layer_types"),
    ("swiglu_limit", -1.0, "swiglu_limit"),
    ("hidden_act", "gelu", "hidden_act"),
])
def test_unsupported_gpt_oss_configs_are_refused_in_one_line(key, value, match):
    hf = {**hf_config().to_dict(), "architectures": ["GptOssForCausalLM"], key: value}
    with pytest.raises(ValueError, match=match) as e:
        ModelConfig.from_hf(hf)
    assert "\n" not in str(e.value)


def dense_sink_attention(q, k, v, sinks, window=0):
    """HF's eager attention with sinks, for one sequence: q [L, H, D], k/v [L, Hkv, D]."""
    L, H, D = q.shape
    g = H // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * D ** -0.5
    i = torch.arange(L)
    mask = (i[None, :] <= i[:, None]) & ((i[None, :] > i[:, None] - window) if window else True)
    s = torch.cat([s.masked_fill(~mask, float("-inf")), sinks[:, None, None].expand(H, L, 1)], -1)
    p = torch.softmax(s, -1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", p, vv)


@pytest.mark.parametrize("window", [0, 4])
def test_sink_attention_of_packed_contexts(window):
    """sdpa and the batch-invariant path attend with sinks as HF's eager attention does, sequence by sequence, and
    their sink gradients agree."""
    torch.manual_seed(0)
    lengths = [7, 3, 10]
    q = torch.randn(sum(lengths), 4, 8, requires_grad=True)
    k, v = torch.randn(sum(lengths), 2, 8), torch.randn(sum(lengths), 2, 8)
    sinks = torch.randn(4, requires_grad=True)
    ctx = VarlenContext.from_lengths(lengths, "cpu")
    outs = [ctx.attend(q, k, v, window=window, sinks=sinks), ctx.batch_invariant().attend(q, k, v, window=window,
                                                                                          sinks=sinks)]
    refs = torch.cat([dense_sink_attention(q[a:b], k[a:b], v[a:b], sinks, window)
                      for a, b in zip([0, 7, 10], [7, 10, 20], strict=True)])
    grad = torch.randn_like(refs)
    ref_grads = torch.autograd.grad((refs * grad).sum(), (q, sinks))
    for out in outs:
        torch.testing.assert_close(out, refs, atol=1e-5, rtol=0)
        for a, b in zip(torch.autograd.grad((out * grad).sum(), (q, sinks)), ref_grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_sink_grad_from_the_forwards_lse():
    """The CUDA backward's sink gradient (`sink_grad`: from the forward's output and log-sum-exp, which counts the
    sinks) equals the textbook backward's, window and GQA included."""
    from monorl.ops.attention.invariant import backward_padded, bi_varlen_attn, sink_grad

    g = torch.Generator().manual_seed(1)
    lengths, window = [7, 3, 10], 4
    q, grad = (torch.randn(20, 4, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(20, 2, 8, generator=g) for _ in range(2))
    sinks = 2 * torch.randn(4, generator=g)
    ctx = VarlenContext.from_lengths(lengths, "cpu")
    out, lse = bi_varlen_attn(q, k, v, ctx.cu_seqlens, ctx.pad_index, ctx.valid, window, sinks)
    ref = backward_padded(grad, q, k, v, ctx.pad_index, ctx.valid, window, sinks)[3]
    torch.testing.assert_close(sink_grad(grad, out, lse, sinks), ref, atol=1e-5, rtol=1e-5)


def gpt_oss_block(seed: int = 0, experts: int = 6):
    from monorl.model.gpt_oss import GptOssMoeBlock

    cfg = model_shape("gpt-oss-20b").replace(hidden_size=16, moe_intermediate_size=8, num_experts=experts,
                                            num_experts_per_tok=3, num_layers=1,
                                            layer_types=("full_attention",))
    torch.manual_seed(seed)
    block = GptOssMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return block


@pytest.mark.parametrize("T,dead", [(1, None), (9, None), (40, 2)])
def test_gpt_oss_grouped_experts_equal_the_loop_forward_and_backward(T, dead):
    """The grouped_mm path (no host read: what a CUDA-graph-captured trainer step runs on sm90+) against the
    per-expert loop, with biases, an expert that gets no token, and the padded rows between groups."""
    block = gpt_oss_block(seed=T)
    g = torch.Generator().manual_seed(T)
    x, logits = torch.randn(T, 16, generator=g, requires_grad=True), torch.randn(T, 6, generator=g)
    if dead is not None:
        logits[:, dead] = -1e4
    weights, experts = block.route(logits)
    outs, grads = [], []
    for path in (block.experts_loop, block.experts_grouped):
        block.zero_grad()
        x.grad = None
        out = path(x, weights, experts)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append([x.grad.clone()] + [p.grad.clone() for p in block.experts.parameters()])
    assert outs[0].abs().mean() > 0.1
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-5)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-4)
