"""The generation engine: one request-level engine (`Engine`: continuous batching, prompt groups sharing their
prefill, turns that pause holding their cache, in-flight weight updates) over a cache interface (`cache.Cache`: paged
KV today), a CUDA-graphed model runner, and `Generator.generate` for a batch of prompts as a thin function over it."""

from monorl.generate.engine import Engine
from monorl.generate.episodes import run_episodes
from monorl.generate.generator import Generator, GeneratorConfig
from monorl.generate.requests import Completion, ContextOverflowError, Request, TurnEvent
from monorl.generate.sampling import SamplingParams

__all__ = ["Completion", "ContextOverflowError", "Engine", "Generator", "GeneratorConfig", "Request",
           "SamplingParams", "TurnEvent", "run_episodes"]
