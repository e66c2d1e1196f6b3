"""Where a trainer step's time goes: Qwen3-0.6B shapes (random init), 40 rollouts of ~110 prompt + 100
completion tokens, bf16 autocast, flash varlen. Times eager vs regionally compiled steps with CUDA events
(median of 5 after 2 warm-ups) and prints the profiler's top CUDA kernels of one compiled step.

  python benchmarks/profile_train_step.py
"""

from __future__ import annotations

import statistics

import torch

from monorl.compile import CompileConfig, compile_blocks, setup_compile_cache
from monorl.model.config import model_shape
from monorl.model.qwen3 import build_model
from monorl.train.packing import TrainSequence
from monorl.train.trainer import Trainer, TrainerConfig


def seqs(g: torch.Generator) -> list[TrainSequence]:
    out = []
    for i in range(40):
        p = torch.randint(0, 150000, (110,), generator=g).tolist()
        c = torch.randint(0, 150000, (100,), generator=g).tolist()
        out.append(TrainSequence(p, c, [-1.0] * 100, advantage=float(i % 3 - 1)))
    return out


def timed(tr: Trainer, batches: list[list[TrainSequence]]) -> list[float]:
    ts = []
    for b in batches:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        tr.step(b)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return ts


def main() -> None:
    g = torch.Generator().manual_seed(0)
    batches = [seqs(g) for _ in range(7)]
    res = {}
    for name in ("eager", "compiled"):
        model = build_model(model_shape("qwen3-0.6b"), "cuda", torch.float32, seed=0)
        if name == "compiled":
            cc = CompileConfig(backend="inductor")
            setup_compile_cache(cc)
            compile_blocks(model, cc)
        tr = Trainer(model, TrainerConfig(lr=1e-6, micro_batch_tokens=8192), total_steps=100, attn_backend="flash")
        ts = timed(tr, batches)
        res[name] = statistics.median(ts[2:])
        print(name, "step times", [round(t, 3) for t in ts], flush=True)
        if name == "compiled":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                tr.step(batches[0])
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
        del tr, model
        torch.cuda.empty_cache()
    tokens = sum(len(s) for s in batches[0])
    flops = 6 * 0.44e9 * tokens + 6 * 1024 * 151936 * 4000  # blocks + LM head on completion rows
    print(f"| trainer step ({tokens} tokens) | eager {res['eager']:.3f}s | compiled {res['compiled']:.3f}s | "
          f"floor ~{flops / 790e12:.3f}s at 790 TFLOP/s |")


if __name__ == "__main__":
    main()
