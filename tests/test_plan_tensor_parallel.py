"""The memory plan and its advice cover tensor-parallel generation (issue #45, item 4) as they cover --nproc and
LoRA: with `generator.tensor_parallel_size N` a GPU holds 1/N of the generator's projections, head and KV cache
(the embedding and norms whole), and a run whose generator copy does not fit is told the TP degree that does."""

from __future__ import annotations

import pytest
import torch

from monorl.distributed.world import World
from monorl.distributed.world_fit import check_world
from monorl.generate.tensor_parallel import TensorParallel, build_tensor_parallel_model
from monorl.model.config import ModelConfig, model_shape
from monorl.plan import GiB, advise, auto_checkpointing, plan_memory
from monorl.plan_params import tensor_parallel_copy_params
from monorl.plan_report import plan_report
from monorl.presets import preset


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int) -> ModelConfig:
    """A released Qwen3 config.json (the keys the plan reads)."""
    return ModelConfig.from_hf({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
        "rope_theta": 1000000, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 151643,
        "eos_token_id": 151645})


QWEN3_14B = _qwen3(5120, 17408, 40, 40)
QWEN3_32B = _qwen3(5120, 25600, 64, 64)
H100, H200 = int(79.2 * GiB), int(139.8 * GiB)


def _cfg(tp: int = 1, lora: int = 0):
    cfg = preset("qwen3_0_6b_sum_digits")
    cfg.rollout.prompts_per_step = 8
    cfg.batch_invariant = False  # as `resolve_config` decides for LoRA (the plan reads the resolved config)
    cfg.lora.rank = lora
    cfg.generator.tensor_parallel_size = tp
    return cfg


def _plan(cfg, m: ModelConfig, device_bytes: int, ranks: int = 4):
    ac = auto_checkpointing(cfg, m, 160, device_bytes, ranks=ranks)
    return plan_memory(cfg, m, 160, device_bytes, activation_checkpointing=ac, ranks=ranks)


@pytest.mark.parametrize("m", [model_shape("tiny"),  # tied head: its own V/N rows
                               model_shape("tiny").replace(tie_word_embeddings=False).with_family(
                                   "llama", attention_bias=True)])  # o_proj's bias whole on every rank
def test_copy_params_are_those_of_a_tp_shard(m: ModelConfig) -> None:
    shard = build_tensor_parallel_model(m, TensorParallel(size=2), "meta", torch.bfloat16)
    assert tensor_parallel_copy_params(m, 2) == sum(p.numel() for p in shard.parameters())


def test_tp_divides_the_generator_copy_and_kv_cache() -> None:
    one, four = (plan_memory(_cfg(tp), QWEN3_14B, 160, None, ranks=4) for tp in (1, 4))  # no GPU size: no sizing
    assert four.row("KV cache").bytes * 4 == one.row("KV cache").bytes  # each rank its 2 of the 8 kv heads
    gen1, gen4 = one.row("generator weights").bytes, four.row("generator weights").bytes
    embed_and_norms = (151936 * 5120 + 40 * (2 * 5120 + 2 * 128) + 5120) * 2
    assert gen4 - embed_and_norms == (gen1 - embed_and_norms) // 4
    assert "1/4: tensor-parallel" in four.row("generator weights").note
    # the trainer's side is FSDP's over all 4 ranks either way
    assert four.row("optimizer state").bytes == one.row("optimizer state").bytes


def test_advice_suggests_a_tp_degree_when_the_generator_copy_does_not_fit() -> None:
    # Qwen3-32B LoRA on 4 H100: the frozen base is sharded, but a whole bf16 generator copy (61 GiB) does not fit
    plan = _plan(_cfg(lora=16), QWEN3_32B, H100)
    assert not plan.fits
    assert advise(_cfg(lora=16), QWEN3_32B, 160, H100, 4)[0].startswith("--generator.tensor_parallel_size 2 ")
    assert _plan(_cfg(tp=2, lora=16), QWEN3_32B, H100).fits
    # full fine-tuning of 32B on 4 H100: the trainer's state alone exceeds them: TP and LoRA together
    assert advise(_cfg(), QWEN3_32B, 160, H100, 4)[0].startswith(
        "--generator.tensor_parallel_size 2 --lora.rank 16 ")
    # a TP degree is made of the run's ranks: on one GPU it comes with --nproc
    assert not advise(_cfg(lora=16), QWEN3_32B, 160, H100, 1)[0].startswith("--generator.tensor_parallel_size")


def test_qwen3_14b_full_fine_tuning_plans_on_4_h200() -> None:
    assert _plan(_cfg(), QWEN3_14B, H200).fits
    assert _plan(_cfg(tp=2), QWEN3_14B, H200).peak_bytes < _plan(_cfg(), QWEN3_14B, H200).peak_bytes


def test_tp_that_does_not_divide_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's num_heads=64"):
        plan_memory(_cfg(tp=3), QWEN3_32B, 160, H100, ranks=3)
    with pytest.raises(ValueError, match="does not divide the run's 1 rank"):
        check_world(_cfg(tp=2), World())
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide the 2 ranks"):
        plan_memory(_cfg(tp=4), QWEN3_32B, 160, H100, ranks=2)


def test_plan_report_names_the_tp_groups() -> None:
    cfg = _cfg(tp=2, lora=16)
    cfg.model.shape = "qwen3-8b"
    text, fits = plan_report(cfg, H100, ranks=4)
    assert fits and "generator: tensor-parallel over 2 GPUs (2 group(s) of 2" in text, text
    assert "1/2: tensor-parallel" in text
