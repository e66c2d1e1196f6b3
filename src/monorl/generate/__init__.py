"""The generation engine: paged KV cache, prefix sharing, continuous batching, CUDA-graphed decode; multi-turn
episodes that keep their KV cache between turns (`EpisodeEngine`)."""

from monorl.generate.engine import Completion, Generator, GeneratorConfig
from monorl.generate.episodes import ContextOverflowError, Episode, EpisodeEngine, TurnEvent, run_episodes
from monorl.generate.sampling import SamplingParams

__all__ = ["Completion", "ContextOverflowError", "Episode", "EpisodeEngine", "Generator", "GeneratorConfig",
           "SamplingParams", "TurnEvent", "run_episodes"]
