"""Where the hybrid generator's log-probs leave the trainer's: `tests/test_qwen3_5_gpu.py`'s generator scenario (the
tiny hybrid, std 0.2 weights, 7 prompts x 2 samples, 90 new tokens) for each dtype and path (fla on or off in
prefill, the in-place decode kernels on or off), each sample's log-probs against the trainer's eager forward; for the
worst samples, both sides against a float64 CPU forward of the same weights, which says which side drifted.

    python3 benchmarks/check_hybrid_generator.py [--device cuda] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from monorl.generate import Generator, GeneratorConfig, SamplingParams  # noqa: E402
from monorl.model import build_model  # noqa: E402
from monorl.ops import gated_delta, gated_delta_decode  # noqa: E402
from tests.conftest import full_forward_logprobs  # noqa: E402
from tests.test_recurrent_state import HYBRID  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--std", type=float, default=0.2)
    ap.add_argument("--variants", default="all", choices=["all", "few"],
                    help="few: bf16 on fla and the kernels, bf16 on the plain paths, fp32 on the kernels alone")
    ap.add_argument("--out")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, HYBRID.vocab_size, (n,), generator=g).tolist() for n in (5, 64, 130, 17, 200, 9, 77)]
    sp = SamplingParams(max_new_tokens=90, temperature=1.0, seed=7, ignore_eos=True)
    base = build_model(HYBRID, device="cpu", dtype=torch.float32, seed=None).init_weights(3, std=args.std)
    ref64 = build_model(HYBRID, device="cpu", dtype=torch.float64, seed=None)
    ref64.load_state_dict({k: v.double() for k, v in base.state_dict().items()})
    rows = []
    variants = [(torch.bfloat16, True, True), (torch.bfloat16, False, False), (torch.float32, True, True),
                (torch.float32, False, False), (torch.float32, True, False), (torch.float32, False, True)]
    if args.variants == "few":
        variants = [variants[0], variants[1], variants[5]]
    for dtype, fla, kernels in variants:
        gated_delta.FLA_ENABLED, gated_delta_decode.ENABLED = fla, kernels
        model = build_model(HYBRID, device=args.device, dtype=dtype, seed=None)
        model.load_state_dict(base.state_dict())
        gcfg = GeneratorConfig(max_num_seqs=6, max_model_len=512, dtype=str(dtype).split(".")[-1])  # else bf16 on CUDA
        out = Generator(model, gcfg).generate(prompts, sp, n=2)
        worst = []
        for i, (p, comps) in enumerate(zip(prompts, out, strict=True)):
            for j, c in enumerate(comps):
                trainer = full_forward_logprobs(model, p, c.token_ids, 1.0, args.device).double()
                diff = (torch.tensor(c.logprobs, dtype=torch.float64) - trainer).abs()
                worst.append((diff.max().item(), diff.mean().item(), i, j, diff.argmax().item(), c, trainer))
        worst.sort(key=lambda w: -w[0])
        checked = []
        for m, mean, i, j, t, c, trainer in worst[:3]:
            exact = full_forward_logprobs(ref64, prompts[i], c.token_ids, 1.0, "cpu")
            gen = torch.tensor(c.logprobs, dtype=torch.float64)
            checked.append({"prompt_len": len(prompts[i]), "sample": j, "position": t, "max_diff": m, "mean_diff": mean,
                            "generator_vs_fp64_max": (gen - exact).abs().max().item(),
                            "trainer_vs_fp64_max": (trainer - exact).abs().max().item(),
                            "logprob_at_worst": c.logprobs[t]})
        row = {"dtype": str(dtype).split(".")[-1], "fla": fla, "kernels": kernels, "max_diff": worst[0][0],
               "mean_diff": sum(w[1] for w in worst) / len(worst), "worst": checked}
        rows.append(row)
        w = checked[0]
        print(f"{row['dtype']:9s} fla {fla!s:5s} kernels {kernels!s:5s} max {row['max_diff']:.4f} mean "
              f"{row['mean_diff']:.5f} | worst (prompt {w['prompt_len']}, sample {w['sample']}, pos {w['position']}, "
              f"logprob {w['logprob_at_worst']:.2f}): generator vs fp64 {w['generator_vs_fp64_max']:.4f}, trainer vs "
              f"fp64 {w['trainer_vs_fp64_max']:.4f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"std": args.std, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
