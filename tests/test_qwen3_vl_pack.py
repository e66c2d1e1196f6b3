"""The trainer's view of a vision-language pack (`monorl.model.qwen3_vl.pack_inputs`): sequences of prompt (with
images) + completion tokens packed into one forward give each token transformers' logits; a completion token's
M-RoPE position continues its prompt's (the decode rule); the trainer's static pack (its images made ready on the
device at pack time) gives transformers' log-probs and gradients; LoRA adapts the language model only and
`freeze_vision_` keeps gradients out of the tower."""

from __future__ import annotations

import pytest
import torch

from monorl.model.attention import VarlenContext
from monorl.model.hf_checkpoint import load_checkpoint
from monorl.model.lora import LoRAConfig, apply_lora_, lora_parameters
from monorl.model.mrope import mrope_positions
from monorl.model.qwen3_vl import freeze_vision_, hf_name, pack_inputs, sequence_positions
from monorl.model.vision_prompt import encode_with_images
from monorl.train.packing import TrainSequence
from monorl.train.trainer import Trainer, TrainerConfig
from tests.conftest import randomize_hf_model
from tests.test_qwen3_vl import END, IMAGE, PROCESSOR, START, images, tiny_hf_config

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.Qwen3VLForConditionalGeneration(tiny_hf_config()).eval()
    with torch.no_grad():
        randomize_hf_model(hf, seed=2)
    path = tmp_path_factory.mktemp("qwen3_vl_pack")
    hf.save_pretrained(path)
    return hf, path


def vl_sequences(model):
    """Two prompts with images (one pad each, expanded by encode_with_images) + completions, one text-only."""
    vision = model.config.vision
    seqs, inputs = [], []
    for k, sizes in enumerate([[(16, 24)], [(24, 16), (9, 30)]]):
        prompt = [3 + k, START, IMAGE, END, 7] * len(sizes) + [11, 12]
        ids, im = encode_with_images(prompt, images(k, sizes), vision, PROCESSOR)
        seqs.append(ids + [20 + k, 30, 40, 50])  # the "completion"
        inputs.append(im)
    seqs.append([5, 6, 7, 8, 9])
    inputs.append(None)
    return seqs, inputs


def test_pack_logits_equal_transformers(checkpoint):
    hf, path = checkpoint
    model = load_checkpoint(path, dtype=torch.float32)
    seqs, inputs = vl_sequences(model)
    with torch.no_grad():
        embeds, positions, deepstack = pack_inputs(model, seqs, inputs)
        ctx = VarlenContext.from_lengths([len(s) for s in seqs], "cpu", "sdpa")
        ids = torch.tensor([t for s in seqs for t in s])
        logits = model.compute_logits(model(ids, positions, ctx, inputs_embeds=embeds, deepstack=deepstack))
        ref = []
        for s, im in zip(seqs, inputs, strict=True):
            input_ids = torch.tensor([s])
            kw = {} if im is None else dict(pixel_values=im.pixel_values, image_grid_thw=im.grid_thw,
                                             mm_token_type_ids=(input_ids == IMAGE).int())
            ref.append(hf(input_ids=input_ids, **kw).logits[0])
    diff = (logits - torch.cat(ref)).abs().max().item()
    print(f"pack max |logit diff| vs transformers: {diff:.3g}")
    assert diff <= 1e-4


def test_completion_positions_continue_the_prompt(checkpoint):
    hf, path = checkpoint
    model = load_checkpoint(path, dtype=torch.float32)
    seqs, inputs = vl_sequences(model)
    for s, im in zip(seqs[:2], inputs[:2], strict=True):
        full, _ = mrope_positions(s, im.grid_thw.tolist(), IMAGE, 2)
        ours = sequence_positions(im, len(s))
        assert torch.equal(ours, full)
        input_ids = torch.tensor([s])
        ref, _ = hf.model.get_rope_index(input_ids, (input_ids == IMAGE).int(), im.grid_thw)
        assert torch.equal(ours, ref[:, 0])
        assert ours[:, -1].tolist() == [im.next_position + len(s) - im.length - 1] * 3


def _grads(model, seqs, inputs):
    embeds, positions, deepstack = pack_inputs(model, seqs, inputs)
    ctx = VarlenContext.from_lengths([len(s) for s in seqs], "cpu", "sdpa")
    ids = torch.tensor([t for s in seqs for t in s])
    model.compute_logits(model(ids, positions, ctx, inputs_embeds=embeds, deepstack=deepstack)).square().mean() \
        .backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_lora_adapts_the_language_model_only(checkpoint):
    _, path = checkpoint
    model = load_checkpoint(path, dtype=torch.float32)
    apply_lora_(model, LoRAConfig(rank=4))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".lora_" in n and not n.startswith("model.visual.") for n in names)
    assert len(lora_parameters(model)) == len(names)
    grads = _grads(model, *vl_sequences(model))
    assert all(g is not None for g in grads.values())


def test_freeze_vision_keeps_gradients_out_of_the_tower(checkpoint):
    _, path = checkpoint
    model = load_checkpoint(path, dtype=torch.float32).train()
    seqs, inputs = vl_sequences(model)
    tower = _grads(model, seqs, inputs)
    assert any(g is not None and g.abs().sum() > 0 for n, g in tower.items() if n.startswith("model.visual."))
    model.zero_grad(set_to_none=True)
    assert freeze_vision_(model) > 0
    grads = _grads(model, seqs, inputs)
    assert not any(n.startswith("model.visual.") for n in grads)
    assert all(g is not None for g in grads.values())
    assert all(p.grad is None for p in model.model.visual.parameters())


def test_trainer_pack_logprobs_and_gradients_equal_transformers(checkpoint):
    """The trainer's own path: a static pack (shared prompts: each group's images once) of sequences with images,
    made ready on the device at pack time (`VisionInputs`), through `Trainer.response_logprobs` -- the completion
    tokens' log-probs and every parameter's gradient (the tower's included) equal transformers', one HF forward per
    sequence."""
    hf, path = checkpoint
    model = load_checkpoint(path, dtype=torch.float32).train()
    seqs, inputs = vl_sequences(model)
    train = [TrainSequence(s[:-4], s[-4:] if j == 0 else s[-4:-1] + [60 + k], [0.0] * 4, 1.0, group=k, images=im)
             for k, (s, im) in enumerate(zip(seqs, inputs, strict=True)) for j in range(2)]
    tr = Trainer(model, TrainerConfig(micro_batch_tokens=512), total_steps=1, static_shapes=True)
    (mb,) = tr._micro_batches(train)
    assert mb.images is not None and len(mb.images.grids) == 3 and mb.ctx.shared is not None
    lp = tr.response_logprobs(model, mb, 1.0)[: mb.num_targets]
    hf.zero_grad(set_to_none=True)
    ref = []
    for s in train:
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        kw = {} if s.images is None else dict(pixel_values=s.images.pixel_values, image_grid_thw=s.images.grid_thw,
                                               mm_token_type_ids=(ids == IMAGE).int())
        logits = hf(input_ids=ids, **kw).logits[0, len(s.prompt_ids) - 1:-1]
        ref.append(logits.log_softmax(-1).gather(1, torch.tensor(s.completion_ids)[:, None])[:, 0])
    ref = torch.cat(ref)
    assert (lp - ref).abs().max().item() <= 1e-4
    weights = torch.linspace(-1.0, 1.0, lp.numel())
    (lp * weights).sum().backward()
    (ref * weights).sum().backward()
    theirs = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        want = theirs[hf_name(name)].grad
        assert (p.grad - want).abs().max().item() <= 1e-4 * want.abs().max().item() + 1e-7, name
    assert any(n.startswith("model.visual.") and p.grad.abs().sum() > 0 for n, p in model.named_parameters())
