"""Gemma 3 (`monorl.model.gemma3`, model_type gemma3_text) against transformers' Gemma3ForCausalLM on tiny random
checkpoints with both layer kinds and a window shorter than the sequences (fp32, CPU, eager attention), its
config.json both ways, and packed sequences against each alone."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from monorl.model.attention import VarlenContext
from monorl.model.config import ModelConfig
from monorl.model.hf_checkpoint import load_checkpoint, save_checkpoint
from tests.conftest import randomize_hf_model
from tests.test_model_parity import hf_logits, random_seqs
from tests.test_model_parity import our_logits as packed_logits

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            query_pre_attn_scalar=16, bos_token_id=2, eos_token_id=1, pad_token_id=0,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})
CASES = {
    "window-5-tied": dict(),
    # another attention scale, untied head, biases, one kv head, window 3
    "scalar-24-untied-bias": dict(query_pre_attn_scalar=24, tie_word_embeddings=False, attention_bias=True,
                                  num_key_value_heads=1, sliding_window=3),
    # transformers 4 style keys (top-level rope_theta / rope_local_base_freq, no layer_types: the pattern of 6)
    "legacy-keys": dict(rope_parameters=None, rope_theta=20000.0, rope_local_base_freq=300.0, layer_types=None,
                        num_hidden_layers=7),
}


def hf_config(**kw) -> transformers.Gemma3TextConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.Gemma3TextConfig(**{**BASE, **kw})


def make_gemma3(path: Path, seed: int = 0, **kw) -> Path:
    """A random transformers Gemma3ForCausalLM saved to `path` (norm weights 1 + 0.2 noise: (1 + w) ~ 2)."""
    legacy = {k: kw.pop(k) for k in ("rope_theta", "rope_local_base_freq") if k in kw}
    model = transformers.Gemma3ForCausalLM(hf_config(**kw, **legacy))
    with torch.no_grad():
        randomize_hf_model(model, seed)
    model.save_pretrained(path)
    if legacy:  # config.json as transformers 4 wrote it
        cfg = json.loads((path / "config.json").read_text())
        cfg.pop("rope_parameters", None)
        (path / "config.json").write_text(json.dumps({**cfg, **legacy, "rope_scaling": None}))
    return path


def load_hf(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf(tmp_path, case):
    path = make_gemma3(tmp_path, **CASES[case])
    ours, ref = load_checkpoint(path), load_hf(path)
    assert type(ref).__name__ == "Gemma3ForCausalLM"
    cfg = ours.config
    assert cfg.layer_types == tuple(ref.config.layer_types) and "full_attention" in cfg.layer_types
    assert cfg.sliding_window == ref.config.sliding_window
    assert cfg.rope_theta == ref.config.rope_parameters["full_attention"]["rope_theta"]
    assert cfg.rope_local_theta == ref.config.rope_parameters["sliding_attention"]["rope_theta"]
    seqs = random_seqs([24, 9, 17], cfg.vocab_size, seed=1)  # several sequences in one pack, all past the window
    a, b = packed_logits(ours, seqs), hf_logits(ref, seqs)
    assert b.std() > 0.3  # O(1) logits: the tolerance is a real check
    diff = (a - b).abs().max().item()
    print(f"{case}: max |monorl - transformers| = {diff:.2e}")
    assert diff <= 1e-4
    # the pack equals each sequence alone
    alone = torch.cat([packed_logits(ours, [s]) for s in seqs])
    assert (a - alone).abs().max().item() <= 1e-4  # (GEMMs of other row counts round differently)


def test_window_changes_the_logits(tmp_path):
    """The parity above is no accident of a window that never bites: without it the logits move."""
    path = make_gemma3(tmp_path)
    ours = load_checkpoint(path)
    seqs = random_seqs([24], ours.config.vocab_size, seed=1)
    windowed = packed_logits(ours, seqs)
    for layer in ours.model.layers:
        layer.self_attn.window = 0
    assert (packed_logits(ours, seqs) - windowed)[5:].abs().max().item() > 1e-2


def test_saved_checkpoint_loads_in_transformers(tmp_path):
    ours = load_checkpoint(make_gemma3(tmp_path / "hf", seed=3, **CASES["scalar-24-untied-bias"]))
    save_checkpoint(ours, tmp_path / "out", dtype=torch.float32)
    ref = load_hf(tmp_path / "out")
    assert ref.config.layer_types == list(ours.config.layer_types)
    seqs = random_seqs([20], ours.config.vocab_size, seed=2)
    assert (packed_logits(ours, seqs) - hf_logits(ref, seqs)).abs().max().item() <= 1e-4
    again = ModelConfig.from_hf(json.loads((tmp_path / "out" / "config.json").read_text()))
    assert again == ours.config


def test_random_init_is_the_identity_norm():
    from monorl.model.decoder import build_model

    cfg = ModelConfig.from_hf({**hf_config().to_dict(), "architectures": ["Gemma3ForCausalLM"]})
    model = build_model(cfg, seed=0)
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert len(norms) == 4 * 4 + 2 * 4 + 1 and all(bool((p == 0).all()) for p in norms)


@pytest.mark.parametrize("key,value,match", [
    ("final_logit_softcapping", 30.0, "final_logit_softcapping"),
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("hidden_activation", "gelu", "hidden_activation"),
    ("sliding_window", None, "sliding_window"),
    ("layer_types", ["chunked_attention"] * 4, "layer_types"),
])
def test_unsupported_gemma3_configs_are_refused_in_one_line(key, value, match):
    hf = {**hf_config().to_dict(), "architectures": ["Gemma3ForCausalLM"], key: value}
    with pytest.raises(ValueError, match=match) as e:
        ModelConfig.from_hf(hf)
    assert "\n" not in str(e.value)


def test_packed_context_applies_the_window_per_sequence():
    """The window counts positions within each packed sequence (sdpa against a dense reference)."""
    torch.manual_seed(0)
    lengths, W = [7, 3, 10], 4
    q, k, v = (torch.randn(sum(lengths), 2, 8) for _ in range(3))
    ctx = VarlenContext.from_lengths(lengths, "cpu")
    out = ctx.attend(q, k, v, window=W)
    start = 0
    for n in lengths:
        i = torch.arange(n)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - W)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[start:start + n].transpose(0, 1), k[start:start + n].transpose(0, 1), v[start:start + n].transpose(0, 1),
            attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(out[start:start + n], ref)
        inv = VarlenContext.from_lengths(lengths, "cpu").batch_invariant().attend(q, k, v, window=W)
        torch.testing.assert_close(inv[start:start + n], ref, atol=1e-5, rtol=0)
        start += n
