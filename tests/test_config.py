import pytest

from monorl.cli import main
from monorl.cliargs import run_config
from monorl.presets import PRESETS, preset


def test_presets_build():
    for name in PRESETS:
        cfg = preset(name)
        assert cfg.preset == name
    ref = preset("qwen3_0_6b_sum_digits")
    assert (ref.steps, ref.rollout.prompts_per_step, ref.rollout.group_size) == (10, 5, 8)
    assert (ref.rollout.max_new_tokens, ref.rollout.temperature, ref.rollout.top_p) == (100, 0.8, 0.95)
    assert (ref.trainer.lr, ref.trainer.warmup_steps, ref.trainer.schedule) == (2e-6, 2, "linear")
    assert ref.validation.num_prompts == 20
    # batch-invariant mode: auto in the Qwen3 presets (on where its cost is under issue 14's 1.15x); tiny: off
    assert all(preset(n).batch_invariant == "auto" for n in PRESETS if n.startswith("qwen3"))
    assert preset("tiny").batch_invariant is False


def test_batch_invariant_auto_resolves_per_run():
    """auto: on for full fine-tuning on CUDA, off with LoRA (1.65x) and on CPU; an explicit value stays."""
    import torch

    from monorl.assembly import resolve_batch_invariant_

    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # device objects only: no GPU needed
    for device, lora, want in ((cuda, 0, True), (cuda, 16, False), (cpu, 0, False)):
        cfg = run_config("qwen3_0_6b_sum_digits", {"lora.rank": str(lora)})
        assert "batch_invariant auto" in resolve_batch_invariant_(cfg, device)
        assert cfg.batch_invariant is want, (device, lora)
    for value in ("true", "false"):
        cfg = run_config("qwen3_0_6b_sum_digits", {"batch_invariant": value})
        assert resolve_batch_invariant_(cfg, cuda) is None and cfg.batch_invariant is (value == "true")
    cfg = run_config("tiny", {"batch_invariant": "auto"})
    assert cfg.batch_invariant == "auto"
    # a hybrid (Gated DeltaNet layers): off on CUDA too, saying why; a dense model of the same family stays on
    from monorl.model.config import model_shape

    hybrid = model_shape("qwen3_5-0.8b")
    cfg = run_config("qwen3_0_6b_sum_digits", {})
    assert "Gated DeltaNet" in resolve_batch_invariant_(cfg, cuda, hybrid) and cfg.batch_invariant is False
    cfg = run_config("qwen3_0_6b_sum_digits", {})
    assert resolve_batch_invariant_(cfg, cuda, model_shape("qwen3-0.6b")) and cfg.batch_invariant is True


def test_overrides_typed():
    cfg = run_config("tiny", ["--trainer.lr", "1e-6", "--steps=3", "--model.random_init", "false", "--model.path",
                              "/x", "--trainer.loss.kind", "dapo", "--task.args.max_value", "5",
                              "--generator.max_model_len", "none"])
    assert cfg.trainer.lr == 1e-6 and cfg.steps == 3 and cfg.model.random_init is False
    assert cfg.model.path == "/x" and cfg.trainer.loss.kind == "dapo"
    assert cfg.task.args["max_value"] == 5 and cfg.generator.max_model_len is None
    assert cfg.task.args["max_digits"] == preset("tiny").task.args["max_digits"]  # the preset's other args stay
    # the same keys as {dotted key: value}, and a preset other than tiny, as `monorl train --preset NAME` reads them
    as_dict = run_config("tiny", {"trainer.lr": "1e-6", "steps": "3", "model.random_init": "false",
                                  "model.path": "/x", "trainer.loss.kind": "dapo", "task.args.max_value": "5",
                                  "generator.max_model_len": "none"})
    assert as_dict == cfg
    gsm = run_config("qwen3_0_6b_gsm8k", {"trainer.lr": "3e-6"})
    assert gsm.preset == "qwen3_0_6b_gsm8k" and gsm.trainer.lr == 3e-6 and gsm.task.name == "gsm8k"
    assert gsm.trainer.loss == preset("qwen3_0_6b_gsm8k").trainer.loss


@pytest.mark.parametrize("args, match", [
    (["--trainer.lrr", "1"], "unknown config key --trainer.lrr.*valid keys there"),
    (["--nope", "1"], "unknown config key --nope"),
    (["--trainer.lr", "fast"], "bad value 'fast' for --trainer.lr"),
    (["--trainer.lr", "-1"], "trainer.lr must be > 0"),
    (["--rollout.top_p", "1.5"], "top_p"),
    (["--model.random_init", "maybe"], "bad value 'maybe' for --model.random_init: expected bool"),
    (["--rollout.temperature", "nan"], "expected a finite number"),
    (["--trainer", "1"], "is a section"),
    (["--steps"], "missing value"),
])
def test_bad_overrides(args, match):
    with pytest.raises(ValueError, match=match):
        run_config("tiny", args)


def test_cli_errors_are_one_line(capsys):
    assert main(["train", "--preset", "nope"]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err
    assert main(["train", "--trainer.bogus", "1"]) == 2
    assert "unknown config key --trainer.bogus" in capsys.readouterr().err
    assert main(["presets"]) == 0
    assert "tiny" in capsys.readouterr().out
