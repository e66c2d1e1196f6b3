"""The generation engine: paged KV cache, prefix sharing, continuous batching, CUDA-graphed decode."""

from monorl.generate.engine import Completion, Generator, GeneratorConfig
from monorl.generate.sampling import SamplingParams

__all__ = ["Completion", "Generator", "GeneratorConfig", "SamplingParams"]
