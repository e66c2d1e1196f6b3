"""The whole loop on CPU (generate, reward, train, weight sync, checkpoint), shortened."""

import json
import math

import torch

from monorl.generate.generator import Generator, GeneratorConfig
from monorl.generate.sampling import SamplingParams
from monorl.model.hf_checkpoint import load_checkpoint
from monorl.presets import preset
from monorl.run.grpo import GRPORun
from tests.conftest import digits_cfg


def test_short_loop_end_to_end(tmp_path, capsys):
    cfg = digits_cfg(tmp_path)
    run = GRPORun(cfg, progress=False)
    before = [p.detach().clone() for p in run.policy.parameters()]
    result = run.run()
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-3] == "Summary:" and out[-2].startswith("  Pre:  mean_reward=") and out[-1].startswith("  Post: ")
    assert any(not torch.equal(a, b) for a, b in zip(before, run.policy.parameters(), strict=True))
    assert len(result.steps) == 3
    for row in result.steps:
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) and row["skipped"] == 0.0
        assert 0.0 <= row["reward"] <= 1.0 and 1 <= row["completions/mean_length"] <= 12
        assert row["logprob_diff_max"] < 1e-4  # fp32 generator vs trainer on the same weights
        assert row["time/generate_s"] > 0 and row["time/train_s"] > 0 and row["time/sync_s"] >= 0
    rd = tmp_path / "run"
    metrics = [json.loads(line) for line in (rd / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "step" in m] == [0, 1, 2]
    samples = [json.loads(line) for line in (rd / "samples.jsonl").read_text().splitlines()]
    assert samples and {"prompt", "completion", "rewards", "advantage"} <= set(samples[0])
    assert json.loads((rd / "config.json").read_text())["task"]["name"] == "tests.conftest:DigitsTask"
    final = load_checkpoint(rd / "checkpoints" / "final")  # the trained policy, in HF format
    for (name, p), q in zip(run.policy.named_parameters(), final.parameters(), strict=True):
        assert torch.equal(p.detach(), q), name


def test_prompts_encoded_ahead_change_nothing(tmp_path, monkeypatch):
    """The next step's prompts are tokenized during the trainer step (`RolloutProducer.encode_ahead`) and taken by
    the next step's rollouts instead of encoding there; the run's rollouts and metrics are those of a run without it."""
    import monorl.rl.rollouts.producer as producer_mod
    import monorl.rl.rollouts.rollout as rollouts_mod

    encodes = []
    real = rollouts_mod.encode_prompts
    for mod in (rollouts_mod, producer_mod):
        monkeypatch.setattr(mod, "encode_prompts", lambda *a, **k: encodes.append(1) or real(*a, **k))
    rows = {}
    for ahead in (True, False):
        cfg = digits_cfg(tmp_path / str(ahead))
        cfg.validation.every = 0
        run = GRPORun(cfg, progress=False)
        if not ahead:
            run.producer.encode_ahead = lambda step: None
        encodes.clear()
        result = run.run()
        # the validations' prompts once (the first validation's, reused by the last), then each step's: with it,
        # the first step's in its rollouts and every later step's ahead
        assert len(encodes) == 1 + cfg.steps
        assert run.producer.stream.position == cfg.steps * cfg.rollout.prompts_per_step
        samples = (tmp_path / str(ahead) / "run" / "samples.jsonl").read_text()
        rows[ahead] = ([{k: v for k, v in r.items() if not k.startswith("time/") and "per_s" not in k}
                        for r in result.steps], samples)
    assert rows[True] == rows[False]


def test_validation_renders_and_tokenizes_its_prompts_once(tmp_path, monkeypatch):
    """The held-out prompts are rendered and tokenized by the first validation and reused by every later one
    (#62: 200 of them before and after a run): two validations render each prompt once, and the second, with
    the same weights, scores as the first."""
    run = GRPORun(digits_cfg(tmp_path, steps=1), progress=False)
    task = run.producer.spec.task
    rendered, real = [], task.render
    monkeypatch.setattr(task, "render", lambda p, tok: rendered.append(p.text) or real(p, tok))
    first, second = run.producer.validate(), run.producer.validate()
    assert rendered == [p.text for p in run.producer.spec.val_prompts]
    assert first == second and not first.skipped


def test_generator_samples_from_the_updated_weights(tmp_path):
    """After a trainer step and the in-place sync, the generator's outputs are those of the new policy."""
    cfg = digits_cfg(tmp_path)
    run = GRPORun(cfg, progress=False)
    prompt = [run.tokenizer.encode("Say numbers 3")]
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, seed=7)
    old = run.generator.generate(prompt, sp, n=4)
    ptrs = [p.data_ptr() for p in run.generator.model.parameters()]
    run.step(0)  # trains and syncs
    assert [p.data_ptr() for p in run.generator.model.parameters()] == ptrs  # in place: graphs stay valid
    new = run.generator.generate(prompt, sp, n=4)
    fresh = Generator(run.policy, GeneratorConfig(max_model_len=128), eos_token_ids=run.generator.eos_token_ids)
    ref = fresh.generate(prompt, sp, n=4)
    assert [c.token_ids for c in new[0]] == [c.token_ids for c in ref[0]]
    torch.testing.assert_close([c.logprobs for c in new[0]], [c.logprobs for c in ref[0]], atol=1e-6, rtol=0)
    assert [c.logprobs for c in new[0]] != [c.logprobs for c in old[0]]


def test_kl_reference_is_the_policy_after_the_warm_start(tmp_path):
    """kl_coef > 0 with a warm start: the KL penalty holds the policy near where RL starts (after the warm
    start), not near the weights the run loaded before it."""
    cfg = preset("tiny")  # sum_digits: a task with reference solutions, for the warm start
    cfg.run_dir, cfg.steps, cfg.checkpoint.final = str(tmp_path / "run"), 1, False
    cfg.warm_start.steps, cfg.warm_start.batch_size = 2, 4
    cfg.validation.num_prompts = 2
    cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 2, 2, 4
    cfg.trainer.loss.kl_coef = 0.1
    run = GRPORun(cfg, progress=False)
    initial = {k: v.clone() for k, v in run.policy.state_dict().items()}
    after_warm_start = {}
    warm_start = run.warm_start

    def recording_warm_start():
        warm_start()
        after_warm_start.update({k: v.clone() for k, v in run.policy.state_dict().items()})

    run.driver.warm_start = recording_warm_start
    result = run.run()
    assert "kl" in result.steps[0]
    assert any(not torch.equal(after_warm_start[k], initial[k]) for k in initial)  # the warm start trained
    ref = run.trainer.ref_model.state_dict()
    for k, v in after_warm_start.items():
        assert torch.equal(ref[k], v), k
