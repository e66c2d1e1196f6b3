"""Where model load goes on a fresh process: CUDA context, meta build + to_empty, random init."""
import time

import torch

from monorl.model.config import model_shape
from monorl.model.decoder import build_model

t = time.perf_counter()
torch.zeros(1, device="cuda")
t1 = time.perf_counter()
m = build_model(model_shape("qwen3-0.6b"), "cuda", torch.float32, seed=None)
torch.cuda.synchronize()
t2 = time.perf_counter()
m.init_weights(0)
torch.cuda.synchronize()
t3 = time.perf_counter()
print(f"cuda init {t1 - t:.2f}s | build (meta -> cuda) {t2 - t1:.2f}s | init_weights {t3 - t2:.2f}s")

import cProfile  # noqa: E402
import pstats  # noqa: E402

del m
torch.cuda.empty_cache()
prof = cProfile.Profile()
prof.enable()
m = build_model(model_shape("qwen3-0.6b"), "cuda", torch.float32, seed=None)
torch.cuda.synchronize()
prof.disable()
pstats.Stats(prof).sort_stats("cumulative").print_stats(14)
