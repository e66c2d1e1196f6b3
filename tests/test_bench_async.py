"""benchmarks/bench_async.py's parts on CPU: the long-tailed forced stop (a pure draw per sample, and the wrapped
`Generator.generate` stopping every sample at its drawn length), the steady-window numbers a table row reports, and
the refusals of its arguments. The harness end to end (7 torchrun jobs) is `python benchmarks/bench_async.py --tiny`."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from async_worker import LengthDraw, install, install_episodes  # noqa: E402
from bench_async import parse_args, steady_row  # noqa: E402

DRAW = LengthDraw(median=16, sigma=1.0, min_len=4, seed=7)


def test_draw_is_keyed_by_prompt_sample_and_seed() -> None:
    lengths = [DRAW.length([3, 1, 4, i], j, 64) for i in range(400) for j in range(4)]
    assert lengths == [DRAW.length([3, 1, 4, i], j, 64) for i in range(400) for j in range(4)]
    assert min(lengths) >= 4 and max(lengths) == 64  # clipped: the long tail reaches the budget
    assert len(set(lengths)) > 20  # samples of one prompt differ, as do prompts
    assert len({DRAW.length([9], j, 64) for j in range(16)}) > 1
    other = LengthDraw(median=16, sigma=1.0, min_len=4, seed=8)
    assert [other.length([3, 1, 4, i], 0, 64) for i in range(50)] != lengths[::4][:50]
    assert abs(statistics.median(lengths) - DRAW.quantile(0.5, 64)) <= 2
    d = DRAW.describe(64, n=4000)
    assert d["p50"] == 16 and d["p50"] < d["p90"] < d["p99"] <= d["max"] == 64
    assert 0.06 < d["share_at_max"] < 0.11  # P(z > ln 4) = 0.083
    assert LengthDraw.from_env(DRAW.to_env()) == DRAW


def test_wrapped_generate_stops_each_sample_at_its_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    from monorl.generate import Generator, GeneratorConfig, SamplingParams
    from monorl.model import build_model, model_shape
    from monorl.rl.rollouts.continuous import ContinuousBatches

    monkeypatch.setattr(Generator, "generate", Generator.generate)  # undone after the test, as is the next
    monkeypatch.setattr(ContinuousBatches, "sample_sampling", ContinuousBatches.__dict__["sample_sampling"])
    install(DRAW)
    with pytest.raises(RuntimeError, match="already has forced lengths"):
        install(DRAW)
    model = build_model(model_shape("tiny"), "cpu", torch.float32, seed=0)
    gen = Generator(model, GeneratorConfig(max_num_seqs=16, max_model_len=96, block_size=8))
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=48, temperature=1.0, seed=1, ignore_eos=True), n=3,
                        first_prompt_index=2)
    got = [[len(c.token_ids) for c in cs] for cs in outs]
    assert got == [[DRAW.length(p, j, 48) for j in range(3)] for p in prompts]
    assert len({n for row in got for n in row}) > 1
    assert all(len(c.logprobs) == len(c.token_ids) for cs in outs for c in cs)
    # continuous batches give each sample the same draw as it is added
    sp = SamplingParams(max_new_tokens=48, temperature=1.0, seed=1, ignore_eos=True)
    assert [ContinuousBatches.sample_sampling(p, j, sp).max_new_tokens for p in prompts for j in range(3)] == \
        [n for row in got for n in row]


def _rows(k0: bool) -> list[dict]:
    rows = []
    for s in range(6):
        r = {"step": s, "num_tokens": 100 * (s + 1), "time/step_s": 2.0, "time/generate_s": 1.5,
             "time/train_s": 0.5, "time/sync_s": 0.0, "completions/mean_length": 10.0,
             "completions/max_length": 40.0}
        if not k0:
            r.update({"time/consumer_idle_s": 0.2, "time/producer_idle_s": 0.4, "staleness/mean": 0.5,
                      "staleness/max": 1, "async/buffer_depth": 1})
        rows.append(r)
    return rows


def test_steady_row_counts_the_window_only() -> None:
    sync = steady_row("sync", 4, _rows(k0=True), range(1, 4))
    assert sync["trained_tokens"] == 300 and sync["steady_wall_s"] == 6.0 and sync["tokens_per_s"] == 50.0
    # on-policy colocated: the trainer waits for the generation, the generator for the train step
    assert (sync["consumer_idle_share"], sync["producer_idle_share"], sync["gpu_wait_share"]) == (0.75, 0.25, 0.0)
    g1 = steady_row("g1_k1", 4, _rows(k0=False), range(1, 4))
    assert (g1["consumer_idle_share"], g1["producer_idle_share"]) == (pytest.approx(0.1), pytest.approx(0.2))
    assert g1["gpu_wait_share"] == pytest.approx((1 * 0.2 + 3 * 0.1) / 4)
    assert (g1["staleness_mean"], g1["staleness_max"], g1["trainer_ranks"]) == (0.5, 1, 3)
    with pytest.raises(ValueError, match="lacks step"):
        steady_row("sync", 4, _rows(k0=True)[:3], range(1, 4))


@pytest.mark.parametrize("argv, words", [
    (["--configs", "sync,nope"], "unknown configuration(s) nope"),
    (["--configs", "g2_k1", "--prompts", "63"], "g2_k1: 2 generator rank(s) need"),
    (["--configs", "g2_k1", "--nproc", "2"], "g2_k1: 2 generator rank(s) need"),
    (["--steps", "3"], "--steps 3 leaves no steady step"),
])
def test_bad_arguments_refused(argv: list[str], words: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert words in capsys.readouterr().err


def test_tiny_defaults_and_passthrough() -> None:
    a, rest = parse_args(["--tiny", "--configs", "sync,g2_k2", "--generator.block_size", "8"])
    assert (a.shape, a.device, a.nproc, a.steps, a.names) == ("tiny", "cpu", 4, 4, ["sync", "g2_k2"])
    assert rest == ["--generator.block_size", "8"]


def test_episodes_take_their_drawn_budget_in_cut_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """guess_number on random weights: every turn is cut at 6 sampled tokens, the environment answers, and the
    episode goes on until its drawn budget (sampled + inserted tokens) is spent."""
    import itertools

    import monorl.rl.rollouts.episodes as episodes
    from monorl.agent.envs import GuessNumberTask
    from monorl.generate import Generator, GeneratorConfig, SamplingParams
    from monorl.model import build_model, model_shape
    from monorl.model.tokenizer import CharTokenizer

    runner = episodes.EpisodeRunner
    for obj, name in ((runner, "_answer"), (runner, "_turn_ended"), (episodes, "_turn_sampling")):
        monkeypatch.setattr(obj, name, getattr(obj, name))  # undone after the test
    draw = LengthDraw(median=120, sigma=1.0, min_len=60, seed=3)
    install_episodes(draw, 6)
    task = GuessNumberTask(max_turns=1000)
    prompts = list(itertools.islice(task.train_prompts(0), 3))
    gen = Generator(build_model(model_shape("tiny"), "cpu", torch.float32, seed=0),
                    GeneratorConfig(max_num_seqs=8, max_model_len=512, block_size=16))
    played = episodes.EpisodeRunner(gen, CharTokenizer(), task, max_len=512).play(
        prompts, SamplingParams(max_new_tokens=300, temperature=1.0, seed=1, ignore_eos=True), n=2)
    budgets, turns = [], []
    for p, group in zip(prompts, played, strict=True):
        for j, (lv, record) in enumerate(group):
            budget = draw.length(list(f"{p.text}|{p.answer}|{p.meta.get('index')}".encode()), j, 300)
            assert len(lv.tokens) - lv.prompt_len <= budget
            sampled_runs = [len(list(run)) for bit, run in itertools.groupby(lv.mask) if bit]
            assert sampled_runs and max(sampled_runs) <= 6
            # the environment answered every turn but one the budget cut
            assert len(sampled_runs) - 1 <= record.turns <= len(sampled_runs)
            budgets.append(budget)
            turns.append(len(sampled_runs))
    assert len(set(budgets)) > 1 and max(turns) >= 2
