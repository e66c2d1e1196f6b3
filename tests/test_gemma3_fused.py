"""Gemma 3's layers on fused kernels in the generator's copy (`monorl.model.gemma3_fused`, converted by
`use_fused_norms_` on CUDA): on CPU the ops run their eager math, so a converted copy must generate exactly what an
unconverted one does -- through the pending (h, m, w) hand-over between layers, the KV writes moved into the q/k
kernel (window rings and full layers), the window views mapped once a step, and a resumed turn's window copy -- and the
batch-invariant mode must take the conversion back. The kernels themselves: tests/test_offset_rmsnorm.py
(interpreter) and tests/test_gemma3_fused_gpu.py."""

from __future__ import annotations

import pytest
import torch

from monorl.generate.engine import Engine
from monorl.generate.episodes import run_episodes
from monorl.generate.generator import Generator, GeneratorConfig
from monorl.generate.sampling import SamplingParams
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.fused_kernels import use_fused_norms_
from monorl.model.gemma3_fused import FUSED_GEMMA3, FusedGemma3Block, FusedGemma3FinalNorm
from monorl.train.packing import TrainSequence
from tests.test_families import prompts_of, scaled_model, trainer_logprobs
from tests.test_window_recycling import BS, CFG, long_inserts


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is faster on a shared CPU (tests/test_parity_everywhere.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def gemma(seed: int) -> torch.nn.Module:
    """The tiny Gemma 3 with every (1 + w) norm's weight drawn too (each norm tells: swapping two shows)."""
    model = scaled_model(CFG, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def make_generator(model, convert: bool, invariant: bool = False, **kw) -> Generator:
    gen = Generator(model, GeneratorConfig(max_num_seqs=4, max_model_len=128, block_size=BS, **kw),
                    eos_token_ids=())
    if convert:
        use_fused_norms_(gen.model)  # what the CUDA copy does (`Generator.__init__`)
        assert sum(type(m) is FusedGemma3Block for m in gen.model.modules()) == CFG.num_layers
        assert type(gen.model.model.norm) is FusedGemma3FinalNorm
    if invariant:
        make_batch_invariant_(gen.model)
    return gen


def decode(gen: Generator, prompts, sp, n) -> dict:
    engine = Engine(gen)
    for i, p in enumerate(prompts):
        for j in range(n):
            engine.add((i, j), p, sp, one_turn=True, group=i)
    out = {}
    while engine.has_work():
        for ev in engine.step():
            out[ev.request_id] = ev
    return out


def test_a_converted_copy_decodes_as_the_plain_one_past_the_window():
    model = gemma(3)
    prompts = prompts_of([3, 21, 10], CFG.vocab_size, seed=2)  # 21: a group's prompt past the window
    sp = SamplingParams(max_new_tokens=40, temperature=0.9, seed=1)
    plain = decode(make_generator(model, False), prompts, sp, 2)
    fused = decode(make_generator(model, True), prompts, sp, 2)
    assert min(len(ev.token_ids) for ev in plain.values()) > 3 * CFG.sliding_window
    for key, ev in plain.items():
        assert fused[key].token_ids == ev.token_ids, key
        torch.testing.assert_close(torch.tensor(fused[key].logprobs), torch.tensor(ev.logprobs), rtol=0, atol=1e-6)
    # and the generated log-probs are the trainer's (the plain model, unconverted; packed otherwise than the decode
    # rows, so fp32 rounding apart)
    seqs = [TrainSequence(prompts[i], list(fused[(i, j)].token_ids), list(fused[(i, j)].logprobs), 0.0)
            for i in range(len(prompts)) for j in range(2)]
    for s, lp in zip(seqs, trainer_logprobs(model, seqs, 0.9), strict=True):
        torch.testing.assert_close(torch.tensor(s.old_logprobs, dtype=torch.float32), lp, atol=1e-4, rtol=0)


def test_resumed_turns_past_the_ring_are_the_plain_copys():
    """Episodes whose environment turns are longer than a ring: their cached prefills run the window copy
    (`TurnWindow`), where the converted attention leaves the KV writes to it."""
    model = gemma(4)
    prompts, inserts = long_inserts(range(3), seed=1)
    sp = SamplingParams(max_new_tokens=10, temperature=0.9, seed=5, stop_token_ids=tuple(range(2, 24)))

    def episodes(convert: bool) -> dict:
        engine = Engine(make_generator(model, convert, stop_check_interval=8), max_tokens=128)
        return run_episodes(engine, prompts, sp,
                            lambda ep, ev: inserts[ep.id][ev.turn] if ev.turn < len(inserts[ep.id]) else None)

    plain, fused = episodes(False), episodes(True)
    assert sum(len(ep.tokens) for ep in plain.values()) > 3 * 40
    for i, ep in plain.items():
        assert fused[i].tokens == ep.tokens, i
        torch.testing.assert_close(torch.tensor(fused[i].logprobs), torch.tensor(ep.logprobs), rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_mode_takes_the_conversion_back_and_stays_bitwise(seed):
    model = make_batch_invariant_(gemma(seed))
    gen = make_generator(model, True, invariant=True)
    fused_types = set(FUSED_GEMMA3.values()) | {FusedGemma3FinalNorm}
    assert not any(type(m) in fused_types for m in gen.model.modules())
    prompts = prompts_of([5, 17], CFG.vocab_size, seed=seed)
    out = decode(gen, prompts, SamplingParams(max_new_tokens=24, temperature=0.9, seed=seed), 2)
    seqs = [TrainSequence(prompts[i], list(out[(i, j)].token_ids), list(out[(i, j)].logprobs), 0.0)
            for i in range(len(prompts)) for j in range(2)]
    for s, lp in zip(seqs, trainer_logprobs(model, seqs, 0.9), strict=True):
        assert torch.equal(torch.tensor(s.old_logprobs, dtype=torch.float32), lp)


def test_a_copy_without_fused_projections_keeps_its_layers():
    model = gemma(0)  # the trainer's layout: separate q, k, v and gate, up
    use_fused_norms_(model)
    assert not any(type(m) in set(FUSED_GEMMA3.values()) for m in model.modules())
