"""`monorl` as one rank of a bench_async.py job, with a long-tailed forced stop: every sampled completion stops after
its own length, drawn per SAMPLE from a seeded lognormal clipped to [min, rollout.max_new_tokens].

Random weights rarely emit EOS, so without this every sample runs to max_new_tokens. The draw wraps
`Generator.generate` and `ContinuousBatches.sample_sampling` (nothing in src/ changes): a call for P prompts x n
samples becomes one call for P * n prompts x 1 sample, each with its own SamplingParams (`Generator.generate` takes
one per prompt: same sampler, different lengths), and the results are regrouped [prompt][sample]; continuous batches
give each sample its drawn length as they add it. A sample's length is keyed by its prompt's token ids and its index
in the group (and the seed), so every configuration -- colocated or not, any rank count or staleness -- draws the
same lengths for the same prompts. The cost: in the wrapped `generate` a group's samples no longer share their
prompt's KV blocks (a prompt of tens of tokens against completions of hundreds; continuous batches still share
them), and the sampling noise keys differ from an unwrapped run's (the
same in every configuration of the benchmark).

Episodes (`--workload episodes`: multi-turn, `monorl.rl.rollouts.episodes.EpisodeRunner`): there the drawn length is
each EPISODE's budget of tokens (its sampled and inserted tokens after the prompt, the runner's `max_new_tokens`),
keyed by its prompt (text, answer, index: a task's prompts may share their text) and its index in the group, and every
turn is cut after TURN_TOKENS_ENV sampled tokens (the environment then answers and the episode goes on), so on random
weights an episode takes about budget / (turn + answer) turns: a long tail of turns. The task's environment must
answer any text and not end the episode first (guess_number with a large max_turns does: an unparsable guess gets
"Please answer with one integer").

The distribution comes in the environment variable FORCED_LENGTHS_ENV (JSON: median, sigma, min, seed), the turn
length in TURN_TOKENS_ENV; unset, this is plain `monorl`. Run under torchrun as a script:

    python -m torch.distributed.run --standalone --nproc_per_node 4 benchmarks/async_worker.py train --preset ...
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import statistics
import sys
from typing import Any

FORCED_LENGTHS_ENV = "MONORL_BENCH_FORCED_LENGTHS"
TURN_TOKENS_ENV = "MONORL_BENCH_TURN_TOKENS"
_NORMAL = statistics.NormalDist()


@dataclasses.dataclass(frozen=True)
class LengthDraw:
    """Lognormal completion lengths: exp(N(ln median, sigma)), rounded, clipped to [min_len, the call's max]."""

    median: float
    sigma: float
    min_len: int
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.median >= 1 and self.sigma >= 0 and self.min_len >= 1):
            raise ValueError(f"forced lengths need median >= 1, sigma >= 0, min >= 1; got {self}")

    def length(self, prompt_ids: list[int], sample: int, max_len: int) -> int:
        """The length of sample `sample` of the prompt `prompt_ids` (a pure function of them and the seed)."""
        h = hashlib.blake2b(f"{self.seed}|{sample}|{','.join(map(str, prompt_ids))}".encode(), digest_size=8)
        u = (int.from_bytes(h.digest(), "big") + 0.5) / 2**64  # uniform in (0, 1)
        raw = math.exp(math.log(self.median) + self.sigma * _NORMAL.inv_cdf(u))
        return max(min(self.min_len, max_len), min(max_len, round(raw)))

    def quantile(self, q: float, max_len: int) -> int:
        """The clipped distribution's q-quantile (the clip is monotone, so it maps quantiles to quantiles)."""
        raw = math.exp(math.log(self.median) + self.sigma * _NORMAL.inv_cdf(q))
        return max(min(self.min_len, max_len), min(max_len, round(raw)))

    def describe(self, max_len: int, n: int = 20000) -> dict[str, Any]:
        """What the benchmark's JSON says of the distribution: its parameters, quantiles and (sampled) mean."""
        draws = [self.length([i], 0, max_len) for i in range(n)]
        return {"kind": "lognormal, per sample, clipped", "median_param": self.median, "sigma": self.sigma,
                "min": min(self.min_len, max_len), "max": max_len, "seed": self.seed,
                "p50": self.quantile(0.5, max_len), "p90": self.quantile(0.9, max_len),
                "p99": self.quantile(0.99, max_len), "mean": sum(draws) / n,
                "share_at_max": sum(d == max_len for d in draws) / n}

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls, text: str) -> LengthDraw:
        return cls(**json.loads(text))


def install(draw: LengthDraw) -> None:
    """Wrap `Generator.generate` so every sample stops after its drawn length (module docstring)."""
    from monorl.generate.generator import Generator
    from monorl.generate.sampling import SamplingParams

    plain = Generator.generate
    if getattr(plain, "forced_lengths", None) is not None:
        raise RuntimeError("Generator.generate already has forced lengths")

    @functools.wraps(plain)
    def generate(self: Generator, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams],
                 n: int = 1, first_prompt_index: int = 0, between_chunks: Any = None) -> list[list[Any]]:
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != len(prompts):  # the engine's own check would see the expanded lists
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        flat_prompts, flat_params = [], []
        for p, sp in zip(prompts, params, strict=True):
            for j in range(n):
                flat_prompts.append(p)
                flat_params.append(dataclasses.replace(sp, max_new_tokens=draw.length(p, j, sp.max_new_tokens)))
        # sampling keys: prompt (first + i) sample j becomes prompt (first + i) * n + j, sample 0 -- distinct
        # across ranks, as the unwrapped keys are
        outs = plain(self, flat_prompts, flat_params, n=1, first_prompt_index=first_prompt_index * n,
                     between_chunks=between_chunks)
        return [[outs[i * n + j][0] for j in range(n)] for i in range(len(prompts))]

    generate.forced_lengths = draw  # type: ignore[attr-defined]
    Generator.generate = generate  # type: ignore[method-assign]
    # continuous batches (a disaggregated generator with in-flight updates) add each sample to the engine with its
    # own parameters: the same draw, keyed the same way
    from monorl.rl.rollouts.continuous import ContinuousBatches

    def sample_sampling(prompt_ids: list[int], sample: int, sampling: SamplingParams) -> SamplingParams:
        return dataclasses.replace(sampling, max_new_tokens=draw.length(prompt_ids, sample, sampling.max_new_tokens))

    ContinuousBatches.sample_sampling = staticmethod(sample_sampling)  # type: ignore[method-assign]


def install_episodes(draw: LengthDraw, turn_tokens: int) -> None:
    """Give every episode its drawn budget and cut every turn after `turn_tokens` (module docstring)."""
    import monorl.rl.rollouts.episodes as episodes

    if turn_tokens < 1:
        raise ValueError(f"turn tokens must be >= 1, got {turn_tokens}")
    runner = episodes.EpisodeRunner
    plain_answer, plain_turn_ended, plain_turn_sampling = runner._answer, runner._turn_ended, episodes._turn_sampling

    def budget_of(lv: Any, key: tuple[int, int], budget: int) -> int:
        p = lv.prompt
        return draw.length(list(f"{p.text}|{p.answer}|{p.meta.get('index')}".encode()), key[1], budget)

    def _answer(self: Any, key: tuple[int, int], lv: Any, turn: Any, sampling: Any, stop_ids: tuple[int, ...],
                budget: int) -> None:
        plain_answer(self, key, lv, turn, sampling, stop_ids, budget_of(lv, key, budget))

    def _turn_ended(self: Any, lv: Any, ev: Any, budget: int) -> None:
        plain_turn_ended(self, lv, ev, budget_of(lv, ev.request_id, budget))

    def _turn_sampling(sampling: Any, max_new: int, stop_ids: tuple[int, ...]) -> Any:
        return plain_turn_sampling(sampling, min(max_new, turn_tokens), stop_ids)

    runner._answer, runner._turn_ended = _answer, _turn_ended  # type: ignore[method-assign]
    episodes._turn_sampling = _turn_sampling


def main(argv: list[str]) -> int:
    if text := os.environ.get(FORCED_LENGTHS_ENV):
        draw = LengthDraw.from_env(text)
        install(draw)
        if turns := os.environ.get(TURN_TOKENS_ENV):
            install_episodes(draw, int(turns))
    from monorl.cli import main as monorl_main

    return monorl_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
