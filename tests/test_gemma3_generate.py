"""Gemma 3's sliding-window layers in the generator's cached prefill (CPU), and its tiny model; the tests it shares
with GPT-OSS (generator == trainer, turns past the window) are in tests/test_window_families_generate.py."""

from __future__ import annotations

import torch

from monorl.generate.cache import SequenceState, slot_mapping
from monorl.model.attention import VarlenContext
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import ModelConfig
from tests.test_episodes import generator
from tests.test_families import prompts_of, scaled_model

WINDOW = 5
GEMMA_TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                         num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=512,
                         tie_word_embeddings=True).with_family("gemma3_text").replace(
    layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=WINDOW,
    rope_local_theta=100.0, query_pre_attn_scalar=16.0)


def gemma_model(seed: int = 0) -> torch.nn.Module:
    return scaled_model(GEMMA_TINY, seed)


def test_cached_prefill_past_the_window_equals_prefill_bitwise():
    """The runner's piece: a prompt's last logits from one prefill, and from a prefill of its first part then of
    the rest over the cached prefix (which ends past the window), are equal bit for bit (invariant mode)."""
    gen = generator(make_batch_invariant_(gemma_model(seed=5)), block_size=4)
    runner, bs = gen.runner, gen.cache.block_size
    p = prompts_of([19], GEMMA_TINY.vocab_size, seed=6)[0]
    s1, s2 = SequenceState(), SequenceState()  # through `Cache`: a window kind maps its blocks to its rings
    t1, t2 = gen.cache.extend(s1, 5), gen.cache.extend(s2, 5)
    whole = runner.prefill([p], [slot_mapping(t1, 0, len(p), bs)])
    runner.prefill([p[:11]], [slot_mapping(t2, 0, 11, bs)])
    part = runner.prefill_cached([p[11:]], [11], [t2])
    assert torch.equal(whole, part)
    # and the window is in force there: the last logits differ from those of a model without it
    for layer in gen.model.model.layers:
        layer.self_attn.window = 0
    ctx = VarlenContext.from_lengths([len(p)], "cpu")
    with torch.no_grad():
        full = gen.model.compute_logits(gen.model(torch.tensor(p), ctx.positions, ctx))[-1]
    assert not torch.allclose(full, whole[0], atol=1e-3)
