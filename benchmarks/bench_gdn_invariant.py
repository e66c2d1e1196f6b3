"""The cost of batch-invariant mode on a hybrid (Qwen3.5's Gated DeltaNet, `monorl.ops.gated_delta_invariant`)
against the default mode, on CPU (the reference paths both sides run there): a decode step of --rows sequences
(prefilled with --prompt tokens; the step's time is (generate N tokens - generate 1) / (N - 1), median of --repeats)
and a trainer step (forward + backward of the response log-probs of --rows sequences of --prompt + --new tokens,
one pack; median of --repeats after a warm-up). One thread. Prints one table.

  OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_gdn_invariant.py
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from monorl.generate import Generator, GeneratorConfig, SamplingParams
from monorl.model.batch_invariant import is_batch_invariant, make_batch_invariant_
from monorl.model.config import ModelConfig
from monorl.model.decoder import build_model
from monorl.train.packing import TrainSequence, make_micro_batches
from monorl.train.trainer import Trainer, TrainerConfig

SHAPE = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=2,
                    head_dim=64, rope_theta=10000.0, max_position_embeddings=2048).with_family("qwen3_5_text").replace(
    layer_types=("linear_attention", "linear_attention", "linear_attention", "full_attention"),
    partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=32, linear_value_head_dim=32)


def decode_step_s(model, rows: int, prompt: int, new: int, repeats: int) -> float:
    gen = Generator(model, GeneratorConfig(max_num_seqs=rows, max_model_len=prompt + new + 8, block_size=16),
                    eos_token_ids=())
    if is_batch_invariant(model):  # the copy converted too, as the RL loop's `build_generator` does
        make_batch_invariant_(gen.model)
    prompts = [[(7 * i + j) % 500 + 2 for j in range(prompt)] for i in range(rows)]

    def run(n: int) -> float:
        sp = SamplingParams(max_new_tokens=n, temperature=1.0, seed=0, ignore_eos=True)
        t = time.perf_counter()
        gen.generate(prompts, sp)
        return time.perf_counter() - t

    return statistics.median((run(new) - run(1)) / (new - 1) for _ in range(repeats))


def trainer_step_s(model, rows: int, prompt: int, new: int, repeats: int) -> float:
    seqs = [TrainSequence([(3 * i + j) % 500 + 2 for j in range(prompt)], [(5 * i + j) % 500 + 2 for j in range(new)],
                          [-1.0] * new, 1.0) for i in range(rows)]
    (mb,) = make_micro_batches(seqs, rows * (prompt + new), "cpu")
    tr = Trainer(model, TrainerConfig(micro_batch_tokens=rows * (prompt + new)), total_steps=1)

    def run() -> float:
        t = time.perf_counter()
        tr.response_logprobs(model, mb, 1.0).sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    run()
    return statistics.median(run() for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--new", type=int, default=17)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    plain = build_model(SHAPE, seed=0)
    invariant = make_batch_invariant_(copy.deepcopy(plain))
    print(f"hybrid {SHAPE.hidden_size}d x {SHAPE.num_layers} layers (3 Gated DeltaNet), {a.rows} rows, "
          f"prompt {a.prompt}, CPU, 1 thread")
    print(f"{'mode':>10} {'decode step ms':>15} {'trainer step ms':>16}")
    for name, m in (("default", plain), ("invariant", invariant)):
        d = decode_step_s(m, a.rows, a.prompt, a.new, a.repeats)
        t = trainer_step_s(m, a.rows, a.prompt, a.new, a.repeats)
        print(f"{name:>10} {d * 1e3:15.1f} {t * 1e3:16.1f}")


if __name__ == "__main__":
    main()
