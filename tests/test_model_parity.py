"""Our Qwen3 (loaded with `load_checkpoint`) against HF transformers' Qwen3ForCausalLM on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from monorl.model.attention import VarlenContext
from monorl.model.hf_checkpoint import load_checkpoint


def our_logits(model: torch.nn.Module, seqs: list[torch.Tensor]) -> torch.Tensor:
    """Logits [sum(len), V] of the sequences packed into one varlen forward."""
    ctx = VarlenContext.from_lengths([len(s) for s in seqs], "cpu")
    with torch.no_grad():
        return model.compute_logits(model(torch.cat(seqs), ctx.positions, ctx))


def hf_logits(model: torch.nn.Module, seqs: list[torch.Tensor]) -> torch.Tensor:
    """Each sequence alone through HF (no padding involved), concatenated."""
    with torch.no_grad():
        return torch.cat([model(s[None]).logits[0] for s in seqs])


def random_seqs(lengths: list[int], vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("tied, heads, kv_heads", [(True, 4, 4), (False, 4, 2), (False, 8, 1), (True, 8, 2)])
def test_logits_match_hf(make_hf_checkpoint, load_hf_model, tied, heads, kv_heads):
    path = make_hf_checkpoint(tie_word_embeddings=tied, num_attention_heads=heads, num_key_value_heads=kv_heads)
    ours, ref = load_checkpoint(path), load_hf_model(path)
    assert ours.config.num_heads == heads and ours.config.num_kv_heads == kv_heads
    assert (ours.lm_head is None) == tied
    seqs = random_seqs([24], ours.config.vocab_size)
    a, b = our_logits(ours, seqs), hf_logits(ref, seqs)
    assert b.std() > 0.3  # logits are O(1), so the tolerance below is a real check
    assert (a - b).abs().max().item() < 1e-4


def test_packed_batch_matches_each_sequence_alone(make_hf_checkpoint, load_hf_model):
    path = make_hf_checkpoint(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    ours, ref = load_checkpoint(path), load_hf_model(path)
    seqs = random_seqs([5, 17, 1, 9, 30], ours.config.vocab_size, seed=1)
    a, b = our_logits(ours, seqs), hf_logits(ref, seqs)
    assert a.shape == (sum(len(s) for s in seqs), ours.config.vocab_size)
    assert (a - b).abs().max().item() < 1e-4
    # packing must not leak across sequences: the same sequence alone gives the same logits
    alone = our_logits(ours, seqs[1:2])
    assert (alone - a[5:22]).abs().max().item() < 1e-4


def test_bf16_checkpoint(make_hf_checkpoint, load_hf_model):
    path = make_hf_checkpoint(dtype=torch.bfloat16, tie_word_embeddings=True)
    seqs = random_seqs([7, 12], 96, seed=2)
    ours = load_checkpoint(path)  # dtype=None keeps bf16
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    ref = load_hf_model(path, dtype=torch.bfloat16)
    a, b = our_logits(ours, seqs).float(), hf_logits(ref, seqs).float()
    assert b.abs().max() > 1.0 and (a - b).abs().max().item() < 0.05  # a few bf16 ulps at |logit| ~ 2
    # upcast at load time: bf16 weights computed in fp32 on both sides agree tightly
    ours32, ref32 = load_checkpoint(path, dtype=torch.float32), load_hf_model(path, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in ours32.parameters())
    assert (our_logits(ours32, seqs) - hf_logits(ref32, seqs)).abs().max().item() < 1e-4
