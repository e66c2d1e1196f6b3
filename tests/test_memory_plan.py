"""The memory plan: its rows equal what a run allocates (weights, gradients, optimizer state, generator copy, KV
cache), its activation model is within a stated tolerance of what autograd saves, a run that cannot fit is refused
before any work, and `monorl plan` answers without a GPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import monorl.plan as plan_mod
from monorl.cli import main
from monorl.cliargs import run_config
from monorl.model.attention import VarlenContext
from monorl.model.config import ModelConfig, model_shape
from monorl.model.decoder import build_model
from monorl.model.lora import LoRAConfig, apply_lora_
from monorl.plan import GiB, advise, plan_memory
from monorl.plan_activations import ACTIVATION_COEFFS
from monorl.plan_params import lora_param_count
from monorl.presets import preset
from monorl.run.grpo import GRPORun
from tests.test_resume import small_cfg


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("lora,invariant,merge", [(False, False, True), (True, False, True), (True, True, True),
                                                  (True, False, False)])
def test_plan_rows_equal_what_the_run_allocates(tmp_path: Path, lora: bool, invariant: bool, merge: bool) -> None:
    extra = {"lora.rank": "4"} if lora else {}
    if invariant:
        extra["batch_invariant"] = "true"
    if not merge:
        extra["generator.merge_lora"] = "false"
    run = GRPORun(small_cfg(tmp_path / "run", **extra), progress=False)
    plan = run.plan
    assert plan.row("policy weights").bytes == _nbytes(run.policy.parameters())
    trainable = [p for p in run.policy.parameters() if p.requires_grad]
    assert plan.row("gradients").bytes == _nbytes(trainable)
    policy = {p.data_ptr() for p in run.policy.parameters()}
    own = [p for p in run.generator.model.parameters() if p.data_ptr() not in policy]
    # a batch-invariant LoRA run's generator, or one with generator.merge_lora off, runs the policy's own base
    # tensors (share_frozen_): only adapters
    assert (len(own) < len(list(run.generator.model.parameters()))) == (invariant or not merge)
    assert plan.row("generator weights").bytes == _nbytes(own)
    run.warm_up()
    run.size_kv_cache()
    assert plan.row("KV cache").bytes == _nbytes([run.generator.cache.kv])
    run.step(0)  # one optimizer step: AdamW's moments exist now
    moments = [v for st in run.trainer.optimizer.state.values() for k, v in st.items() if k != "step"]
    assert plan.row("optimizer state").bytes == _nbytes(moments)


def _saved_activation_bytes(m: ModelConfig, tokens: int) -> int:
    """Bytes autograd saves for one packed forward of `tokens` tokens through the layers (unique storages,
    parameters excluded): what the activation rows model."""
    model = build_model(m, "cpu", torch.float32, seed=0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ctx = VarlenContext.from_lengths([tokens // 2, tokens - tokens // 2], torch.device("cpu"), "sdpa")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, m.vocab_size, (tokens,)), ctx.positions, ctx)
    return sum(v for k, v in seen.items() if k not in params)


def test_activation_model_against_saved_tensors() -> None:
    """A shape other than the ones the float32 coefficients were measured on: within 20% (CPU, fp32)."""
    m = ModelConfig(vocab_size=512, hidden_size=192, intermediate_size=640, num_layers=3, num_heads=6,
                    num_kv_heads=2, head_dim=32)
    small, large = (_saved_activation_bytes(m, t) for t in (128, 512))
    measured = (large - small) / (512 - 128) / m.num_layers  # per token and layer
    planned = ACTIVATION_COEFFS["float32"].per_token_layer(m)
    assert abs(planned - measured) / measured < 0.2, (planned, measured)


def test_checkpointing_and_lora_shrink_the_plan() -> None:
    cfg = preset("qwen3_0_6b_sum_digits")
    m = model_shape("qwen3-4b")
    full = plan_memory(cfg, m, 160, 140 * GiB, activation_checkpointing=False)
    ac = plan_memory(cfg, m, 160, 140 * GiB, activation_checkpointing=True)
    assert ac.row("trainer activations").bytes < full.row("trainer activations").bytes / 2
    cfg.lora = LoRAConfig(rank=16)
    lora = plan_memory(cfg, m, 160, 140 * GiB, activation_checkpointing=True)
    assert lora.row("optimizer state").bytes < full.row("optimizer state").bytes / 50
    # the frozen base once, in bf16, not as fp32 masters
    assert lora.row("policy weights").bytes < full.row("policy weights").bytes * 0.52


def test_advice_is_the_cheapest_change_that_fits() -> None:
    cfg = preset("qwen3_0_6b_sum_digits")
    m = model_shape("qwen3-8b")
    assert not plan_memory(cfg, m, 160, int(140 * GiB)).fits  # 8B full fine-tuning: 122 GiB before anything else
    advice = advise(cfg, m, 160, int(140 * GiB))
    assert advice[0].startswith("--lora.rank 16 ")
    m = model_shape("qwen3-4b")
    advice = advise(cfg, m, 160, int(130 * GiB))  # checkpointing alone fits 4B in 130 GiB
    assert advice[0].startswith("--trainer.activation_checkpointing true ")
    # with 8 prompt groups per step the work divides over GPUs: 2 of them (FSDP2) come before changing the method
    cfg.rollout.prompts_per_step = 8
    advice = advise(cfg, model_shape("qwen3-8b"), 160, int(140 * GiB))
    assert advice[0].startswith("--nproc 2 ")


def test_plan_verb_plans_one_gpu_of_several(capsys) -> None:
    base = ["plan", "--preset", "qwen3_0_6b_sum_digits", "--model.shape", "qwen3-8b", "--gpu_memory_gb", "140.4"]
    assert main([*base, "--rollout.prompts_per_step", "8"]) == 1  # 8B full fine-tuning: not on one H200
    assert "cheapest change that fits: --nproc 2" in capsys.readouterr().out
    assert main([*base, "--rollout.prompts_per_step", "8", "--nproc", "2"]) == 0
    out = capsys.readouterr().out
    assert "one GPU of 2 (FSDP2)" in out and "(1/2: sharded)" in out and "fits" in out
    assert main([*base, "--nproc", "2"]) == 2  # 5 prompt groups do not divide over 2 GPUs
    assert "does not divide over 2 ranks" in capsys.readouterr().err


def test_a_run_that_cannot_fit_is_refused_before_work(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(plan_mod, "device_memory_bytes", lambda device: 64 << 20)  # a 64 MiB "GPU"
    run_dir = tmp_path / "run"
    args = ["train", "--steps", "1", "--device", "cpu", "--warm_start.steps", "0", "--run_dir", str(run_dir)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("monorl: error:")]
    assert len(errors) == 1 and "does not fit" in errors[0] and "cheapest change that fits" in errors[0]
    assert not run_dir.exists()


def test_plan_verb(capsys) -> None:
    assert main(["plan", "--preset", "qwen3_0_6b_sum_digits", "--model.shape", "qwen3-8b",
                 "--gpu_memory_gb", "140"]) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "cheapest change that fits: --lora.rank 16" in out
    assert main(["plan", "--preset", "qwen3_0_6b_sum_digits", "--model.shape", "qwen3-8b", "--lora.rank", "16",
                 "--gpu_memory_gb", "140"]) == 0
    assert "fits" in capsys.readouterr().out
    assert main(["plan", "--preset", "tiny", "--gpu_memory_gb", "0"]) == 2  # one-line error


def test_plan_verb_without_the_task_data(tmp_path: Path, monkeypatch, capsys) -> None:
    """`monorl plan --preset qwen3_0_6b_gsm8k` where ../shared/data is not: planned from the prompt length GSM8K
    declares, saying so (a plan needs shapes, not the data); a dataset task declares none: the config's bound."""
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--preset", "qwen3_0_6b_gsm8k", "--model.shape", "qwen3-0.6b", "--gpu_memory_gb", "79.6"]) == 0
    out = capsys.readouterr().out
    assert ("task data not read (GSM8K file not found: ../shared/data/gsm8k/train.jsonl): planned from prompts of 256 "
            "tokens (the longest prompt task 'gsm8k' declares) and 512 new tokens") in out.splitlines()
    assert main(["plan", "--preset", "qwen3_0_6b_gsm8k_dapo", "--model.shape", "qwen3-0.6b",
                 "--gpu_memory_gb", "79.6"]) == 0
    out = capsys.readouterr().out
    assert "prompts of 3584 tokens (generator.max_model_len 4096 - rollout.max_new_tokens 512)" in out
    assert main(["train", "--preset", "qwen3_0_6b_gsm8k", "--model.shape", "qwen3-0.6b", "--device", "cpu"]) == 2
    assert "GSM8K file not found" in capsys.readouterr().err  # a run still needs its data


@pytest.mark.parametrize("preset_name,shape,gpu_gb", [
    ("qwen3_0_6b_sum_digits", "qwen3-8b", 79.6),  # --lora.rank 16
    ("qwen3_0_6b_sum_digits", "qwen3-8b", 48),  # --compile.trainer_cuda_graphs false --lora.rank 16
    ("qwen3_0_6b_gsm8k", "qwen3-8b", 40),  # --nproc 4 --lora.rank 16, from the task's declared lengths
])
def test_advice_applied_plans_the_peak_it_quotes(preset_name: str, shape: str, gpu_gb: float, tmp_path: Path,
                                                 monkeypatch, capsys) -> None:
    """The advised change, passed to `monorl plan` as printed, plans the peak the advice quoted: each candidate is
    resolved as the changed run resolves it (`--lora.rank 16` turns batch_invariant auto off, so the generator's
    copy is its own: the advice had planned it shared with the policy, 43.0 GiB against the 58.13 the changed run
    planned for Qwen3-8B on 79.6 GiB)."""
    monkeypatch.chdir(tmp_path)
    base = ["plan", "--preset", preset_name, "--model.shape", shape, "--gpu_memory_gb", str(gpu_gb)]
    assert main(base) == 1
    advice = re.search(r"cheapest change that fits: (.+?)  \(peak ([\d.]+) GiB", capsys.readouterr().out)
    assert advice is not None
    assert main([*base, *advice.group(1).split()]) == 0
    assert re.search(r"peak \(planned\)\s+([\d.]+)", capsys.readouterr().out).group(1) == advice.group(2)


def test_a_large_lora_run_is_advised_to_keep_its_generators_adapters_separate(capsys) -> None:
    """GPT-OSS-20B with LoRA on one 80 GB GPU: the merged generator copy (a second 39 GiB bf16 base) does not fit;
    the cheapest change is the adapters kept separate over the policy's own base, whose plan has no second base."""
    base = ["plan", "--preset", "tiny_arith", "--model.shape", "gpt-oss-20b", "--lora.rank", "16",
            "--gpu_memory_gb", "79.6"]
    assert main(base) == 1
    advice = re.search(r"cheapest change that fits: --generator.merge_lora false  \(peak ([\d.]+) GiB",
                       capsys.readouterr().out)
    assert advice is not None
    assert main([*base, "--generator.merge_lora", "false"]) == 0
    out = capsys.readouterr().out
    row = re.search(r"generator weights\s+([\d.]+)\s+adapters only: the base is shared with the policy", out)
    assert row is not None and float(row.group(1)) < 0.1
    assert re.search(r"peak \(planned\)\s+([\d.]+)", out).group(1) == advice.group(1)  # the peak it quoted


def test_lora_target_names() -> None:
    m = build_model(model_shape("tiny"), "cpu", torch.float32, seed=0)
    apply_lora_(m, LoRAConfig(rank=2, targets=("q", "v")))
    cfg = run_config("tiny", {"lora.rank": "2", "lora.targets": "q,v"})
    planned = lora_param_count(model_shape("tiny"), cfg.lora)
    assert planned == sum(p.numel() for p in m.parameters() if p.requires_grad)
