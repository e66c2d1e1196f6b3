"""Batch-invariant parity in every layout the run produces, on CPU: every decode batch size 1..64, prefix sharing on
and off, continuous batching with admissions mid-decode, every trainer pack size 1..64 and other pack layouts (static
CUDA-graph packs, shuffled order), LoRA, and compiled blocks (aot_eager). Each case compares the generator's
log-probs with the trainer's recomputation bit for bit (`torch.equal`); `test_batch_invariant.py` has the ops, the
default-mode negative control and the loop."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

from monorl.compile import CompileConfig, compile_blocks, compile_counters
from monorl.generate.generator import Generator, GeneratorConfig
from monorl.generate.sampling import SamplingParams
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.lora import LoRAConfig, apply_lora_, lora_parameters
from monorl.train.packing import TrainSequence, make_micro_batches, pack, token_buckets
from monorl.train.trainer import Trainer, TrainerConfig

TEMPERATURE = 0.9
NUM_SEQS = 64
# the tiny shape cut down (2 layers, width 32, GQA 2:1): the CPU path of the invariant matmul materialises every
# product before its tree sum, and the sweeps below push ~100k tokens through it
MICRO = dataclasses.replace(model_shape("tiny"), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                            num_kv_heads=1, head_dim=16)


def _prompts(n: int, seed: int, vocab: int, longest: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(2, longest))] for _ in range(n)]


def _generate(model, prompts, max_new: list[int], n: int = 1, max_num_seqs: int = NUM_SEQS,
              lora: LoRAConfig | None = None, compile: CompileConfig | None = None,
              decode_sizes: list[int] | None = None) -> list[TrainSequence]:
    """Rollouts from an invariant generator copy (as a batch-invariant run builds it: fused projections, unfused
    with LoRA); prompt i generates exactly max_new[i] tokens. decode_sizes: filled with the live batch size of
    every decode step."""
    gen = Generator(model, GeneratorConfig(max_num_seqs=max_num_seqs, max_model_len=128, block_size=4),
                    lora=lora, compile=compile)
    make_batch_invariant_(gen.model)
    if decode_sizes is not None:
        decode = gen.runner.decode

        def spy(live, *args):
            decode_sizes.append(live)
            return decode(live, *args)

        gen.runner.decode = spy
    sps = [SamplingParams(max_new_tokens=m, temperature=TEMPERATURE, ignore_eos=True, seed=7) for m in max_new]
    out = gen.generate(prompts, sps, n=n)
    return [TrainSequence(p, c.token_ids, c.logprobs, 0.0) for p, cs in zip(prompts, out, strict=True) for c in cs]


def _trainer(model) -> Trainer:
    return Trainer(model, TrainerConfig(micro_batch_tokens=4096), total_steps=1)


@torch.no_grad()
def _packed_logprobs(tr: Trainer, seqs: list[TrainSequence], groups: list[list[int]],
                     static: bool = False) -> dict[int, torch.Tensor]:
    """Trainer log-probs of each sequence, one micro-batch per group of indices (in the group's order)."""
    out: dict[int, torch.Tensor] = {}
    buckets = token_buckets(4096, 16)
    for idx in groups:
        mb = pack(seqs, idx, buckets, "cpu", static=static)
        lp = tr.response_logprobs(tr.model, mb, TEMPERATURE)
        for i in idx:
            out[i] = lp[(mb.seq_ids == i) & (mb.token_mask > 0)]
    return out


def _assert_bitwise(seqs: list[TrainSequence], got: dict[int, torch.Tensor] | list[torch.Tensor], what: str) -> None:
    for i, s in enumerate(seqs):
        assert torch.equal(got[i], torch.tensor(s.old_logprobs, dtype=torch.float32)), (what, i)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: these tensors are tiny, and on a shared CPU each parallel op can wait a scheduler
    quantum for its second thread (measured 8-40x slower with 2 threads on a loaded 2-core machine). The invariant
    ops' CPU path does not depend on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return make_batch_invariant_(build_model(MICRO, seed=5))


DECODE_SIZES: list[int] = []


@pytest.fixture(scope="module")
def sweep(model) -> list[TrainSequence]:
    """64 prompts, prompt i generating i + 2 tokens, all admitted at once (the first token is sampled at admission):
    one sequence finishes per decode step, so the decode batch runs through every size from 64 down to 1."""
    prompts = _prompts(NUM_SEQS, seed=0, vocab=model.config.vocab_size, longest=4)
    return _generate(model, prompts, [i + 2 for i in range(NUM_SEQS)], decode_sizes=DECODE_SIZES)


def test_every_decode_batch_size(model, sweep):
    assert [len(s.completion_ids) for s in sweep] == list(range(2, NUM_SEQS + 2))
    assert sorted(set(DECODE_SIZES)) == list(range(1, NUM_SEQS + 1))
    _assert_bitwise(sweep, _packed_logprobs(_trainer(model), sweep, [list(range(NUM_SEQS))]), "one pack")


@pytest.fixture(scope="module")
def short(model) -> list[TrainSequence]:
    """64 short rollouts (2 completion tokens each), for the trainer's pack-size sweep."""
    prompts = _prompts(NUM_SEQS, seed=6, vocab=model.config.vocab_size, longest=4)
    return _generate(model, prompts, [2] * NUM_SEQS)


def test_every_pack_size(model, short):
    """Micro-batches of b sequences, for every b in 1..64: each sequence is checked at every pack size."""
    tr = _trainer(model)
    for b in range(1, NUM_SEQS + 1):
        groups = [list(range(i, min(i + b, NUM_SEQS))) for i in range(0, NUM_SEQS, b)]
        _assert_bitwise(short, _packed_logprobs(tr, short, groups), f"packs of {b}")


def test_other_pack_layouts(model, sweep):
    """Shuffled order inside a pack, the static (CUDA-graph) layout with padded rows and sequence slots, and the
    trainer's own first-fit split at two token budgets (dynamic and static packs)."""
    tr = _trainer(model)
    order = list(range(NUM_SEQS))
    random.Random(1).shuffle(order)
    _assert_bitwise(sweep, _packed_logprobs(tr, sweep, [order[:40], order[40:]]), "shuffled")
    _assert_bitwise(sweep, _packed_logprobs(tr, sweep, [order[:23], order[23:]], static=True), "static")
    for budget, static in ((96, False), (700, True)):
        got: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            mbs = make_micro_batches(sweep, budget, "cpu", static=static)
            for mb in mbs:
                lp = tr.response_logprobs(model, mb, TEMPERATURE)
                got.update({i: lp[(mb.seq_ids == i) & (mb.token_mask > 0)] for i in mb.seq_ids.unique().tolist()})
        assert len(mbs) > 2
        _assert_bitwise(sweep, got, f"first-fit at {budget} tokens")


def test_prefix_sharing_on_and_off_and_admissions_mid_decode(model):
    """n = 3 samples share their prompt's prefill (on) or each prompt is given 3 times (off); with 5 decode slots
    and lengths 2..8, sequences are admitted while others are mid-decode."""
    prompts = _prompts(6, seed=2, vocab=model.config.vocab_size, longest=20)
    lengths = [2 + (5 * i) % 7 for i in range(6)]
    tr = _trainer(model)
    for max_num_seqs in (5, 64):
        sizes: list[int] = []
        shared = _generate(model, prompts, lengths, n=3, max_num_seqs=max_num_seqs, decode_sizes=sizes)
        if max_num_seqs == 5:  # slots are refilled while other sequences are mid-decode
            assert max(sizes) == 5 and len(set(sizes)) > 2
        alone = _generate(model, [p for p in prompts for _ in range(3)], [m for m in lengths for _ in range(3)],
                          max_num_seqs=max_num_seqs)
        for what, seqs in (("shared", shared), ("alone", alone)):
            _assert_bitwise(seqs, _packed_logprobs(tr, seqs, [list(range(len(seqs)))]), (what, max_num_seqs))


def test_lora(model):
    """A LoRA policy (adapters non-zero) and the generator's unmerged invariant copy, synced from it."""
    cfg = LoRAConfig(rank=4, alpha=8.0)
    policy = apply_lora_(build_model(MICRO, seed=5), cfg, seed=1)
    with torch.no_grad():
        for p in lora_parameters(policy):
            p.normal_(0.0, 0.05)  # lora_B starts at zero: make the adapters count
    make_batch_invariant_(policy)
    prompts = _prompts(12, seed=3, vocab=model.config.vocab_size)
    seqs = _generate(policy, prompts, [3 + i % 5 for i in range(12)], n=2, max_num_seqs=7, lora=cfg)
    tr = _trainer(policy)
    _assert_bitwise(seqs, _packed_logprobs(tr, seqs, [list(range(len(seqs)))]), "lora")
    _assert_bitwise(seqs, _packed_logprobs(tr, seqs, [[i] for i in range(len(seqs))]), "lora alone")


def test_compiled_blocks(model):
    """Regional compile (aot_eager on CPU) of the trainer's blocks and the generator's."""
    torch._dynamo.reset()
    cc = CompileConfig(backend="aot_eager")
    policy = copy.deepcopy(model)
    prompts = _prompts(6, seed=4, vocab=model.config.vocab_size)
    seqs = _generate(policy, prompts, [2 + i % 4 for i in range(6)], n=2, max_num_seqs=5, compile=cc)
    compile_blocks(policy, cc)
    tr = _trainer(policy)
    _assert_bitwise(seqs, _packed_logprobs(tr, seqs, [list(range(0, 12, 2)), list(range(1, 12, 2))]), "compiled")
    assert compile_counters()["frames_compiled"] > 0  # the blocks really ran compiled
