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
        for mb in make_micro_batches(seqs, 4096, "cpu", share_prompts=share_prompts, vision=model.config.vision):
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


def dataset_with_images(tmp_path):
    """(tokenizer, tiny VL model, a dataset task of 3 prompts -- two images, one, none --, those prompts, a generator
    with PROCESSOR)."""
    import json

    from tokenizers import AddedToken

    from monorl.model.hf_checkpoint import load_tokenizer
    from monorl.tasks.dataset import DatasetTask
    from tests.test_tokenizer import write_tokenizer_dir
    from tests.test_vision_dataset import VISION_SPECIALS, picture

    tok = load_tokenizer(write_tokenizer_dir(tmp_path / "tok"))
    tok._tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_SPECIALS])
    hf = tiny_hf_config().to_dict()
    hf["text_config"]["vocab_size"] = max(tok._tok.get_vocab_size(), 160)
    for key, name in (("image_token_id", "<|image_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
                      ("vision_end_token_id", "<|vision_end|>")):
        hf[key] = tok.token_to_id(name)
    model = build_model(ModelConfig.from_hf(hf), seed=None)
    with torch.no_grad():
        randomize_hf_model(model, seed=4)
    for i, (h, w) in enumerate([(16, 24), (9, 30)]):
        picture(h, w, (40 * i, 90, 200)).save(tmp_path / f"{i}.png")
    rows = [{"prompt": "How many?", "images": ["0.png", "1.png"], "answer": "2"},
            {"prompt": "Colour?", "images": ["1.png"], "answer": "red"},
            {"prompt": "No picture", "images": [], "answer": "x"}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = DatasetTask(path=tmp_path / "data.jsonl", reward="format")
    stream = task.train_prompts(seed=0)
    prompts = [next(stream) for _ in range(3)]
    gen = Generator(model, GeneratorConfig(max_num_seqs=8, max_model_len=512, block_size=4))
    gen.image_processor = PROCESSOR
    return tok, model, task, prompts, gen


def test_rollouts_carry_images_to_a_trainer_step(tmp_path):
    """A dataset task's prompts with images, through `generate_rollouts` (placeholders expanded by the generator's
    image processor) to `Rollout.train_sequence`: the trainer's log-probs equal the generator's, and a step with the
    tower frozen (`freeze_vision_`, what --model.freeze_vision does) changes the language model, not the tower."""
    from monorl.generate.sampling import SamplingParams as SP
    from monorl.model.qwen3_vl import freeze_vision_
    from monorl.rl.rollouts.rollout import generate_rollouts

    tok, model, task, prompts, gen = dataset_with_images(tmp_path)
    groups = generate_rollouts(gen, tok, task, prompts, SP(max_new_tokens=6, temperature=1.0, seed=0), n=2,
                               max_len=512)
    assert [g[0].images is not None for g in groups] == [bool(p.meta.get("images")) for p in prompts]
    assert sum(g[0].images is not None for g in groups) == 2
    seqs = [r.train_sequence(group=i) for i, g in enumerate(groups) for r in g]
    got = trainer_logprobs(model, seqs, share_prompts=True)
    assert max((lp - torch.tensor(s.old_logprobs)).abs().max().item() for s, lp in zip(seqs, got, strict=True)) <= 1e-5

    for s, sign in zip(seqs, [1.0, -1.0] * len(seqs), strict=False):
        s.advantage = sign
    freeze_vision_(model)
    tower = {n: p.detach().clone() for n, p in model.model.visual.named_parameters()}
    text = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("model.visual.")}
    trainer = Trainer(model.train(), TrainerConfig(lr=1e-3, warmup_steps=0), total_steps=1)
    trainer.step(seqs)
    assert all(torch.equal(p, tower[n]) for n, p in model.model.visual.named_parameters())
    assert any(not torch.equal(p, text[n]) for n, p in model.named_parameters() if n in text)


def test_images_made_ahead_are_what_generation_takes(tmp_path, monkeypatch):
    """`generation_inputs` (what `RolloutProducer.encode_ahead` makes while the GPU trains) processes a batch's
    images; `generate_rollouts` given them processes none, and its rollouts are those it makes unaided."""
    from monorl.distributed.world import SINGLE
    from monorl.generate.sampling import SamplingParams as SP
    from monorl.model import image_processing
    from monorl.rl.rollouts.rollout import encode_prompts, generate_rollouts, generation_inputs

    tok, model, task, prompts, gen = dataset_with_images(tmp_path)
    sp = SP(max_new_tokens=6, temperature=1.0, seed=0)
    unaided = generate_rollouts(gen, tok, task, prompts, sp, n=2, max_len=512)
    inputs = generation_inputs(gen, SINGLE, *encode_prompts(task, tok, prompts, 512, 6, images=True))
    assert [im is not None for im in inputs.images] == [bool(p.meta.get("images")) for p in prompts]
    assert sum(im is not None for im in inputs.images) == 2
    calls = []
    real = image_processing.ImageProcessor.__call__
    monkeypatch.setattr(image_processing.ImageProcessor, "__call__",
                        lambda self, images: calls.append(len(images)) or real(self, images))
    ahead = generate_rollouts(gen, tok, task, prompts, sp, n=2, max_len=512, inputs=inputs)
    assert calls == []
    assert [[(r.prompt_ids, r.completion_ids, r.logprobs) for r in g] for g in ahead] == \
        [[(r.prompt_ids, r.completion_ids, r.logprobs) for r in g] for g in unaided]


def test_the_tower_runs_once_per_prompt_group(monkeypatch):
    """A group's n samples share its prompt's prefill, the tower's output included: each image goes through the
    tower once, however many samples its prompt has."""
    model = tiny_vl()
    prompts = vl_prompts(model)
    gen = Generator(model, GeneratorConfig(max_num_seqs=16, max_model_len=256, block_size=4), eos_token_ids=(EOS,))
    seen: list[int] = []
    visual = gen.model.model.visual
    orig = visual.forward
    monkeypatch.setattr(visual, "forward", lambda inputs: seen.append(len(inputs.grids)) or orig(inputs))
    gen.generate([p for p, _ in prompts], SamplingParams(max_new_tokens=4, seed=0), n=4,
                 images=[im for _, im in prompts])
    assert sum(seen) == sum(len(s) for s in SIZES)  # 6 images, not 4 x 6


def test_a_resumed_turn_continues_the_image_prompts_positions():
    """An episode over a prompt with images: its second turn's inserted tokens are prefilled over the cached prefix
    at M-RoPE positions continuing the prompt's (`prefill_cached`'s offsets); every sampled token's log-prob equals
    the trainer's of the whole conversation (inserted tokens context only)."""
    from monorl.generate.engine import Engine

    model = tiny_vl()
    prompts = vl_prompts(model)[1:3]
    gen = Generator(model, GeneratorConfig(max_num_seqs=4, max_model_len=256, block_size=4), eos_token_ids=(EOS,))
    engine = Engine(gen, max_tokens=200)
    sp = SamplingParams(max_new_tokens=5, temperature=1.0, seed=0)
    for i, (ids, im) in enumerate(prompts):
        engine.add((i, 0), ids, sp, images=im)
    turns = 0
    while engine.has_work():
        for ev in engine.step():
            if ev.turn == 0:
                engine.resume(ev.request_id, [13, 14, 15, 16, 17, 18, 19])  # a tool's output
                turns += 1
    assert turns == 2
    seqs = []
    for i, (ids, im) in enumerate(prompts):
        req = engine.finish((i, 0))
        k = len(ids)
        seqs.append(TrainSequence(ids, req.tokens[k:], req.logprobs[k:], 1.0, images=im,
                                  completion_mask=[int(s) for s in req.sampled[k:]]))
    for s, lp in zip(seqs, trainer_logprobs(model, seqs, share_prompts=False), strict=True):
        keep = torch.tensor(s.completion_mask, dtype=torch.bool)
        assert (lp[keep] - torch.tensor(s.old_logprobs)[keep]).abs().max().item() <= 1e-5
