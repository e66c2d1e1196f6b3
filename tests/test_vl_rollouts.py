"""Images through the generator and the trainer (#59): on a tiny random Qwen3-VL (CPU, fp32), each sampled token's
generator log-prob equals the trainer's log-prob of that token (its packed forward, prompts shared or not), with
1-3 images of different sizes per prompt, groups of n samples sharing a prompt (the tower run once per group), a
text-only prompt in the same batch, and decode slots that move (more samples than slots)."""

from __future__ import annotations

import pytest
import torch

from monorl.generate import Generator, GeneratorConfig, SamplingParams
from monorl.model.batch_invariant import is_batch_invariant, make_batch_invariant_
from monorl.model.config import ModelConfig
from monorl.model.decoder import build_model
from monorl.model.vision_prompt import encode_with_images
from monorl.train.packing import TrainSequence, make_micro_batches
from monorl.train.trainer import Trainer
from monorl.train.trainer_config import TrainerConfig
from tests.conftest import randomize_hf_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")

from tests.test_qwen3_vl import END, IMAGE, PROCESSOR, START, images, tiny_hf_config  # noqa: E402

EOS = 1
SIZES = [[(16, 24)], [(24, 16), (9, 30)], [(8, 8), (20, 12), (12, 28)], []]  # the last prompt: text only


def tiny_vl(seed: int = 3):
    cfg = ModelConfig.from_hf(tiny_hf_config().to_dict())
    model = build_model(cfg, seed=None)
    with torch.no_grad():
        randomize_hf_model(model, seed=seed)  # O(1) logits: sampling is not near-uniform
    return model.eval()


def vl_prompts(model):
    """(token ids, ImageInputs or None) per prompt: text around each image's placeholder, the chat's last tokens
    text."""
    out = []
    for k, sizes in enumerate(SIZES):
        ids = [3 + k, 4, 5]
        for _ in sizes:
            ids += [START, IMAGE, END, 7 + k]
        ids += [11, 12 + k]
        if sizes:
            ids, im = encode_with_images(ids, images(k, sizes), model.config.vision, PROCESSOR)
        else:
            im = None
        out.append((ids, im))
    return out


def generate(model, prompts, n: int, max_num_seqs: int = 16, seed: int = 0):
    gen = Generator(model, GeneratorConfig(max_num_seqs=max_num_seqs, max_model_len=256, block_size=4),
                    eos_token_ids=(EOS,))
    if is_batch_invariant(model):  # the generator's copy converted too, as the RL loop does
        make_batch_invariant_(gen.model)
    # turns of unequal lengths: rows finish at different steps, so live rows move down the slots
    sampling = [SamplingParams(max_new_tokens=10 - 2 * (i % 3), temperature=1.0, seed=seed)
                for i in range(len(prompts))]
    return gen.generate([p for p, _ in prompts], sampling, n=n, images=[im for _, im in prompts])


def train_sequences(prompts, outs) -> list[TrainSequence]:
    return [TrainSequence(p, c.token_ids, c.logprobs, 1.0, group=i, images=im)
            for i, ((p, im), comps) in enumerate(zip(prompts, outs, strict=True)) for c in comps]


def trainer_logprobs(model, seqs, share_prompts: bool) -> list[torch.Tensor]:
    trainer = Trainer(model, TrainerConfig(share_prompts=share_prompts), total_steps=1)
    out: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for mb in make_micro_batches(seqs, 4096, "cpu", share_prompts=share_prompts):
            lp = trainer.response_logprobs(model, mb, 1.0)
            for i in sorted(set(mb.seq_ids.tolist())):
                out[i] = lp[mb.seq_ids == i]
    return [out[i] for i in range(len(seqs))]


@pytest.mark.parametrize("max_num_seqs", [16, 5], ids=["all-slots", "slots-move"])
def test_generator_logprobs_equal_trainer_logprobs(max_num_seqs):
    model = tiny_vl()
    prompts = vl_prompts(model)
    n = 3
    outs = generate(model, prompts, n, max_num_seqs)
    seqs = train_sequences(prompts, outs)
    lengths = [len(s.completion_ids) for s in seqs]
    assert sum(lengths) > 3 * len(seqs)  # not degenerate: most samples run several tokens
    # the same prompt's samples differ (sampled, not copies)
    assert all(len({tuple(c.token_ids) for c in comps}) > 1 for comps in outs)
    worst = 0.0
    for share in (True, False):
        got = trainer_logprobs(model, seqs, share)
        for s, lp in zip(seqs, got, strict=True):
            worst = max(worst, (lp - torch.tensor(s.old_logprobs)).abs().max().item())
    print(f"max |generator - trainer| log-prob: {worst:.3g} over {sum(lengths)} tokens")
    assert worst <= 1e-5


def test_images_change_the_samples():
    """The images reach the model: other pictures behind the same tokens change the log-probs."""
    model = tiny_vl()
    prompts = vl_prompts(model)[:2]
    other = [(p, encode_with_images(_unexpanded(p), images(9 + k, SIZES[k]), model.config.vision, PROCESSOR)[1])
             for k, (p, _) in enumerate(prompts)]
    a, b = generate(model, prompts, 2), generate(model, other, 2)
    assert any(abs(x.logprobs[0] - y.logprobs[0]) > 1e-4 for ca, cb in zip(a, b, strict=True)
               for x, y in zip(ca, cb, strict=True) if x.token_ids[0] == y.token_ids[0])


def _unexpanded(ids: list[int]) -> list[int]:
    """A prompt's tokens with each image's placeholder run back to one pad."""
    return [t for i, t in enumerate(ids) if t != IMAGE or ids[i - 1] != IMAGE]


def test_text_model_refuses_images(make_hf_checkpoint):
    from monorl.model.hf_checkpoint import load_checkpoint

    vl = tiny_vl()
    [(ids, im)] = vl_prompts(vl)[:1]
    text = load_checkpoint(make_hf_checkpoint(vocab_size=160, num_hidden_layers=1))
    gen = Generator(text, GeneratorConfig(max_num_seqs=2, max_model_len=256, block_size=4), eos_token_ids=(EOS,))
    with pytest.raises(ValueError, match="has images; the model has no vision tower"):
        gen.generate([ids], SamplingParams(max_new_tokens=2), images=[im])


def test_generator_equals_trainer_bitwise_in_batch_invariant_mode():
    """The invariant conversion covers the tower's projections (its LayerNorms and per-image attention see the same
    rows on both sides) and M-RoPE is one op on both: bit for bit."""
    model = make_batch_invariant_(tiny_vl())
    prompts = vl_prompts(model)
    seqs = train_sequences(prompts, generate(model, prompts, 3, max_num_seqs=5))
    for share in (True, False):
        for s, lp in zip(seqs, trainer_logprobs(model, seqs, share), strict=True):
            assert torch.equal(lp, torch.tensor(s.old_logprobs, dtype=torch.float32))
