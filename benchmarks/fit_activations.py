"""Measure what one trainer micro-batch holds on a GPU, per model shape, eager and compiled, with and without
activation checkpointing: the data behind `monorl.plan_activations.ACTIVATION_COEFFS`.

For each Qwen3 config (random weights, fp32 masters, bf16 autocast, flash attention, no trainer graphs), the
trainer's own warm-up (forward + backward of the step's packs, no optimizer step) runs on packs of ~4k and ~11k
tokens; the transient is peak allocated minus allocated afterwards, as the RL loop measures it. Printed per row:
the transient, and per token and layer what is left after the LM-head chunk, the final hidden states and the fp32
gradients; then the plan's prediction of the same transient.

  python benchmarks/fit_activations.py --model-dir .models [--shapes qwen3-0.6b,qwen3-1.7b] --out fit.json
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from monorl.compile import CompileConfig, compile_blocks, setup_compile_cache
from monorl.model.decoder import build_model
from monorl.model.hf_checkpoint import load_config
from monorl.plan import GiB
from monorl.plan_activations import trainer_activation_bytes
from monorl.train.trainer import Trainer, TrainerConfig

PROMPT, COMPLETION = 150, 100


def measure(trainer: Trainer, num_seqs: int, vocab: int) -> tuple[int, int]:
    """(transient bytes of the warm-up, the largest pack's tokens)."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (PROMPT,), generator=gen).tolist()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    trainer.warm_up(prompt, num_seqs, COMPLETION)
    torch.cuda.synchronize()
    transient = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
    return transient, min(trainer.cfg.micro_batch_tokens, num_seqs * (PROMPT + COMPLETION))  # unpadded packs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=".models")
    ap.add_argument("--shapes", default="qwen3-0.6b,qwen3-1.7b,qwen3-4b,qwen3-8b")
    ap.add_argument("--seqs", default="16,40", help="rollouts per warm-up (x250 tokens each)")
    ap.add_argument("--out", default="fit_activations.json")
    args = ap.parse_args()
    setup_compile_cache(CompileConfig(backend="inductor"))
    rows = []
    for shape in args.shapes.split(","):
        m = load_config(Path(args.model_dir) / shape)
        model = build_model(m, "cuda", torch.float32, seed=0)
        grads = sum(p.numel() for p in model.parameters()) * 4
        copy_params = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2)
        for backend in ("none", "inductor"):  # eager first: compiling wraps the blocks in place
            if backend == "inductor":
                compile_blocks(model, CompileConfig(backend="inductor"))
            for ac in (False, True):
                model.activation_checkpointing = ac
                trainer = Trainer(model, TrainerConfig(micro_batch_tokens=16384), total_steps=10,
                                  attn_backend="flash", cuda_graphs=False)
                for n in map(int, args.seqs.split(",")):
                    try:
                        transient, tokens = measure(trainer, n, m.vocab_size)
                    except torch.OutOfMemoryError:  # 8B without checkpointing at 10k tokens: 139 GiB is not enough
                        print(f"{shape:11s} {backend:8s} ac={ac!s:5s} {n} rollouts: out of memory", flush=True)
                        rows.append({"shape": shape, "backend": backend, "ac": ac, "seqs": n, "oom": True})
                        trainer.model.zero_grad(set_to_none=True)
                        continue
                    planned = trainer_activation_bytes(m, tokens, "bfloat16", ac, 1024, copy_params) + grads
                    rest = transient - grads - 16 * min(1024, tokens) * m.vocab_size - 8 * m.hidden_size * tokens
                    row = {"shape": shape, "backend": backend, "ac": ac, "tokens": tokens,
                           "transient_gib": transient / GiB, "planned_gib": planned / GiB,
                           "per_token_layer_bytes": rest / tokens / m.num_layers}
                    rows.append(row)
                    print(f"{shape:11s} {backend:8s} ac={ac!s:5s} tokens={tokens:6d} transient {transient / GiB:6.2f} "
                          f"GiB (plan {planned / GiB:6.2f}) -> {row['per_token_layer_bytes']:9.0f} B/token/layer",
                          flush=True)
                del trainer
        del model
        gc.collect()
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
