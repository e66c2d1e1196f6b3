"""Batch-invariant mode with the trainer's real dtypes, on CPU: fp32 master weights under bf16 autocast (the trainer
on CUDA) against a bf16 copy of them (the generator's). The mode promises generator == trainer bit for bit after
every weight sync, so every parameter must enter the trainer's forward as its bf16 copy does. The CPU's other tests
run both sides in fp32, where a master used unrounded cannot show: a Gemma 3 270M run on an H100 (2026-12-07) had
logprob_diff 0 at step 1 and up to 2 after the first update ((1 + w) norms read the fp32 master; GPT-OSS's sinks
too). Both sides here run the trainer's packed forward, so only the weights' dtype differs between them."""

from __future__ import annotations

import copy

import pytest
import torch

from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import model_shape
from monorl.train.packing import TrainSequence, make_micro_batches
from monorl.train.trainer import Trainer, TrainerConfig
from tests.test_families import scaled_model
from tests.test_gemma3_generate import GEMMA_TINY
from tests.test_gpt_oss_generate import GPT_OSS_TINY
from tests.test_recurrent_state import HYBRID, HYBRID_MOE

SHAPES = {"qwen3": model_shape("tiny"), "qwen3_moe": model_shape("tiny-moe"), "gemma3": GEMMA_TINY,
          "qwen3_5": HYBRID, "qwen3_5_moe": HYBRID_MOE, "gpt_oss": GPT_OSS_TINY}


def off_the_grid(model: torch.nn.Module) -> torch.nn.Module:
    """Masters as after optimizer steps: not bf16 values (norm weights O(1) away from their identity)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if "norm" in name else 1e-3))
    return model


def logprobs(model: torch.nn.Module, compute_dtype: str) -> torch.Tensor:
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    seqs = [TrainSequence(torch.randint(2, vocab, (n,), generator=g).tolist(),
                          torch.randint(2, vocab, (7,), generator=g).tolist(), [0.0] * 7, 1.0) for n in (5, 11, 8)]
    (mb,) = make_micro_batches(seqs, 256, device.type)
    trainer = Trainer(model, TrainerConfig(micro_batch_tokens=256, compute_dtype=compute_dtype), total_steps=1)
    with torch.no_grad():
        return trainer.response_logprobs(model, mb, 1.0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")])])
@pytest.mark.parametrize("family", sorted(SHAPES))
def test_masters_enter_the_mode_as_their_bf16_copy(family: str, device: str) -> None:
    """On CUDA too: the Triton kernels and CUDA autocast's own op lists (not run on a GPU yet, 2026-12-07)."""
    masters = make_batch_invariant_(off_the_grid(scaled_model(SHAPES[family], 0)).to(device))
    copy_bf16 = make_batch_invariant_(copy.deepcopy(masters).to(torch.bfloat16))
    trainer, generator_weights = logprobs(masters, "bfloat16"), logprobs(copy_bf16, "float32")
    assert torch.isfinite(trainer).all()
    assert torch.equal(trainer, generator_weights), float((trainer - generator_weights).abs().max())


def test_the_default_mode_reads_the_unrounded_masters() -> None:
    """Negative control: outside the mode the (1 + w) norms compute with the fp32 master (transformers' rounding for
    an fp32 model), so the two sides differ: the check above can tell."""
    masters = off_the_grid(scaled_model(GEMMA_TINY, 0))
    copy_bf16 = copy.deepcopy(masters).to(torch.bfloat16)
    assert not torch.equal(logprobs(masters, "bfloat16"), logprobs(copy_bf16, "float32"))


def test_a_vision_language_models_masters_enter_the_mode_as_their_bf16_copy(tmp_path) -> None:
    """Qwen3-VL with images in the pack: the tower's parameters (LayerNorms with biases, the patch embedding, the
    merger) enter the mode's trainer forward as their bf16 copy too."""
    transformers = pytest.importorskip("transformers")
    from monorl.model.hf_checkpoint import load_checkpoint
    from tests.conftest import randomize_hf_model
    from tests.test_qwen3_vl import tiny_hf_config
    from tests.test_qwen3_vl_pack import vl_sequences

    hf = transformers.Qwen3VLForConditionalGeneration(tiny_hf_config())
    with torch.no_grad():
        randomize_hf_model(hf, seed=2)
    hf.save_pretrained(tmp_path)
    masters = make_batch_invariant_(off_the_grid(load_checkpoint(tmp_path, dtype=torch.float32)))
    copy_bf16 = make_batch_invariant_(copy.deepcopy(masters).to(torch.bfloat16))
    seqs, inputs = vl_sequences(masters)
    train = [TrainSequence(s[:-4], s[-4:], [0.0] * 4, 1.0, images=im) for s, im in zip(seqs, inputs, strict=True)]

    def vl_logprobs(model: torch.nn.Module, compute_dtype: str) -> torch.Tensor:
        trainer = Trainer(model, TrainerConfig(micro_batch_tokens=512, compute_dtype=compute_dtype), total_steps=1)
        (mb,) = trainer._micro_batches(train)
        assert mb.images is not None
        with torch.no_grad():
            return trainer.response_logprobs(model, mb, 1.0)[: mb.num_targets]

    trainer, generator_weights = vl_logprobs(masters, "bfloat16"), vl_logprobs(copy_bf16, "float32")
    assert torch.isfinite(trainer).all()
    assert torch.equal(trainer, generator_weights), float((trainer - generator_weights).abs().max())
