"""Memory defaults that run (issue #45, item 2): when the default KV cache (`max_num_seqs x max_model_len`) is what
keeps a plan from fitting, the plan gives the cache what is left of the GPU -- as the run's start-up does once
training is measured -- and refuses only when even one step's rollouts (`step_kv_need`) do not fit beside the rest."""

from __future__ import annotations

import pytest
import torch

import monorl.plan as plan_mod
from monorl.model.config import ModelConfig
from monorl.plan import (
    GiB,
    MemoryPlanError,
    advise,
    auto_checkpointing,
    largest_prefill,
    plan_memory,
    run_memory_plan,
    step_kv_need,
)
from monorl.plan_report import plan_report
from monorl.presets import preset

# Qwen3-8B's released config.json (the keys the plan reads)
QWEN3_8B = ModelConfig.from_hf({
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645})
H100 = int(79.2 * GiB)  # what torch reports for an H100 80GB


def _cfg():
    cfg = preset("qwen3_0_6b_sum_digits")
    cfg.rollout.prompts_per_step = 8  # a multiple of 4 ranks (bench_scale's 8b row)
    return cfg


def _plan(cfg, device_bytes: int, ranks: int = 4):
    ac = auto_checkpointing(cfg, QWEN3_8B, 160, device_bytes, ranks=ranks)
    return plan_memory(cfg, QWEN3_8B, 160, device_bytes, activation_checkpointing=ac, ranks=ranks)


def test_qwen3_8b_full_fine_tuning_on_4_h100_is_planned() -> None:
    cfg = _cfg()
    seqs, length, least = step_kv_need(cfg, QWEN3_8B, 160, 4, torch.bfloat16)
    assert (seqs, length) == (16, 260)  # a rank's 2 prompt groups x 8, every completion live at once
    default = plan_mod.kv_cache_bytes_needed(QWEN3_8B, 64, 2048, 16, torch.bfloat16)
    plan = _plan(cfg, H100)
    assert plan.fits
    kv = plan.row("KV cache")
    assert least <= kv.bytes < default  # what is left of the GPU, at least the step's sequences
    assert plan.peak_bytes + plan.reserve_bytes > H100 - 16 * 147456  # the whole GPU, to a KV block
    assert "what is left of the GPU" in kv.note and "16 seqs x 260 tokens" in kv.note


def test_the_gsm8k_preset_fits_qwen3_8b_on_4_h100() -> None:
    """The issue's case with the preset's own defaults: 8 prompts x 8 and 100 validation prompts, the longest of
    170 tokens (GSM8K's first 32 through the Qwen3 chat template)."""
    cfg = preset("qwen3_0_6b_gsm8k")
    ac = auto_checkpointing(cfg, QWEN3_8B, 170, H100, ranks=4)
    plan = plan_memory(cfg, QWEN3_8B, 170, H100, activation_checkpointing=ac, ranks=4)
    assert plan.fits, plan.table()
    # a rank prefills its 25 of the 100 validation prompts at most (each group's prompt once), not 8192 tokens
    assert plan.row("generator prefill").note == "4250 tokens"


def test_largest_prefill_is_a_ranks_share_of_what_the_slots_hold() -> None:
    cfg = preset("qwen3_0_6b_gsm8k")  # 8 x 8 a step, 100 validation prompts x 1, 64 slots, 8192 tokens a prefill
    assert largest_prefill(cfg, 170, 1) == 8192  # validation: 64 greedy prompts, packed up to 8192 tokens
    assert largest_prefill(cfg, 170, 4) == 25 * 170  # a rank's 25 of them
    assert largest_prefill(cfg, 10_000, 4) == 10_000  # a prompt longer than a packed prefill runs alone
    cfg.validation.num_prompts = 0
    assert largest_prefill(cfg, 170, 4) == 2 * 170  # a rank's 2 of the step's 8 groups
    cfg.rollout.max_staleness = 1  # async: the next batches' groups are admitted while one decodes
    assert largest_prefill(cfg, 170, 4) == 8 * 170  # the 64 slots hold 8 groups of 8
    assert largest_prefill(cfg, 2000, 4) == 8192  # 8 groups' prompts, packed up to 8192 tokens


def test_a_colocated_fsdp_plan_holds_the_weight_syncs_gather() -> None:
    """Between the trainer's step and the next generation the sync holds a 256 MiB bucket and its 1/N sent; with LoRA
    the root FSDP unit (embedding and LM head) and a merged weight; one rank and disaggregated trainers hold none."""
    cfg = _cfg()
    row = _plan(cfg, H100).row("weight sync")
    assert not row.persistent and row.bytes == (256 << 20) * 5 // 4
    cfg.lora.rank = 16
    assert _plan(cfg, H100).row("weight sync").bytes > 2 * 151936 * 4096 * 2  # bf16 embedding and LM head
    assert "weight sync" not in [r.name for r in _plan(cfg, H100, ranks=1).rows]


def test_plan_report_states_the_kv_cache_chosen() -> None:
    cfg = _cfg()
    cfg.model.shape = "qwen3-8b"
    text, fits = plan_report(cfg, H100, ranks=4)
    assert fits, text
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("KV cache"))
    assert "what is left of the GPU" in line and "64 seqs x 2048 tokens" in line, line


def test_refused_when_even_the_steps_kv_cache_does_not_fit(monkeypatch) -> None:
    cfg = _cfg()
    small = int(50 * GiB)
    plan = _plan(cfg, small)
    assert plan.fits is False
    assert plan.row("KV cache").bytes == step_kv_need(cfg, QWEN3_8B, 160, 4, torch.bfloat16)[2]  # at its least
    monkeypatch.setattr(plan_mod, "device_memory_bytes", lambda device: small)
    with pytest.raises(MemoryPlanError) as err:
        run_memory_plan(cfg, QWEN3_8B, 160, torch.device("cuda"), ranks=4)
    assert "\n" not in str(err.value) and "does not fit" in str(err.value)


def test_an_explicit_kv_budget_is_kept_and_advice_names_its_removal() -> None:
    cfg = _cfg()
    cfg.generator.kv_cache_bytes = 18 * GiB
    plan = _plan(cfg, H100)
    assert plan.row("KV cache").bytes == 18 * GiB and plan.fits is False
    assert advise(cfg, QWEN3_8B, 160, H100, 4)[0].startswith("--generator.kv_cache_bytes null ")


def test_a_trainer_rank_that_does_not_fit_is_planned_without_kv_sizing() -> None:
    """A disaggregated trainer's plan has no KV cache row: when it does not fit (the question auto activation
    checkpointing asks), it says so instead of failing to find the row to shrink."""
    cfg = _cfg()
    plan = plan_memory(cfg, QWEN3_8B, 160, H100, activation_checkpointing=False, ranks=1, role="trainer")
    assert not plan.fits and all(r.name != "KV cache" for r in plan.rows)
    assert auto_checkpointing(cfg, QWEN3_8B, 160, H100, ranks=1, role="trainer")


def test_a_window_model_whose_default_cache_does_not_fit_is_planned(capsys) -> None:
    """A model with recycled sliding-window layers sizes its rows (each sequence's rings) with the generator's block
    size when the cache is fitted to the room left: `monorl plan` of GPT-OSS-20B with LoRA on one H100 (its rows
    were once divided by a block size of 0). It does not fit there (exit 1), and the plan says so."""
    from monorl.cli import main

    rc = main(["plan", "--preset", "qwen3_0_6b_sum_digits", "--model.shape", "gpt-oss-20b", "--model.path", "",
               "--lora.rank", "16", "--device", "cuda", "--gpu_memory_gb", "79.2"])
    out = capsys.readouterr().out
    assert rc == 1 and "one step's rollouts, the least a run takes" in out and "does not fit" in out


def test_a_prefills_logits_are_its_sequences_last_rows_not_every_token() -> None:
    """The engine computes logits only at each prefilled sequence's last token (`ModelRunner._prefill_forward`), so
    the prefill row's logits grow with the slots, not the tokens: GPT-OSS-20B's 201,088-word vocabulary over a
    3,240-token prefill counted 2.4 GiB of fp32 logits that never exist (its plan stood 17.6% above the measured
    peak on an H100, 2026-12-07)."""
    from monorl.model.config import model_shape
    from monorl.plan_activations import PREFILL_BYTES_PER_TOKEN_LAYER_WIDTH, activation_shape

    cfg = preset("qwen3_0_6b_sum_digits")
    m = model_shape("gpt-oss-20b")
    plan = plan_memory(cfg, m, 160, H100, activation_checkpointing=True)
    row = plan.row("generator prefill")
    tokens = int(row.note.split()[0])
    layers = PREFILL_BYTES_PER_TOKEN_LAYER_WIDTH * tokens * (m.hidden_size + activation_shape(m).intermediate_size)
    assert row.bytes - layers == 3 * 4 * min(tokens, cfg.generator.max_num_seqs) * m.vocab_size
    assert row.bytes - layers < 4 * tokens * m.vocab_size / 10
