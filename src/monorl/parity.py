"""`monorl parity`: do the generator's log-probs equal the trainer's? A few prompts are sampled by the run's
generator and re-scored by the run's trainer (both built exactly as `monorl train` builds them: dtype, batch-invariant
conversion, LoRA, compile, pack layout), and the report says, as TorchTitan RL's bitwise test prints it: tokens
checked, tokens whose log-probs differ at all, max / mean |delta logprob|, PASS or FAIL.

PASS: max |delta| <= tolerance (default 0: bit for bit, what `--batch_invariant true` promises). Without the mode a
small difference is expected; `--tolerance` then says how much is acceptable.

A mixture-of-experts model (Qwen3-MoE) also reports its routing: the same sampled sequences through the generator's
copy and through the trainer's model (in its compute dtype), each router tapped (`monorl.model.moe_routing`), and
the share of tokens sent to a different set of experts in any layer. Both forwards are eager and lay the tokens out
alike (each sequence whole); in the mode the routers are batch-invariant, so the decode steps that sampled the
tokens routed them as these forwards do. At tolerance 0 a routing difference fails the check too.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import tempfile
from argparse import Namespace
from dataclasses import dataclass
from typing import Any

import torch

from monorl.config import RunConfig
from monorl.model.moe_routing import RoutingMismatch, generator_trainer_routing
from monorl.train.packing import TrainSequence, make_micro_batches


@dataclass(frozen=True)
class ParityReport:
    tokens_checked: int
    tokens_different: int  # tokens whose generator and trainer log-probs are not bitwise equal
    max_abs_diff: float
    mean_abs_diff: float
    sequences: int
    tolerance: float
    batch_invariant: bool
    routing: RoutingMismatch | None = None  # a mixture-of-experts model's: generator copy against trainer

    @property
    def passed(self) -> bool:
        # NaN fails: `not (nan <= tol)`
        routed_alike = self.routing is None or self.tolerance > 0 or self.routing.tokens_different == 0
        return self.tokens_checked > 0 and self.max_abs_diff <= self.tolerance and routed_alike

    def text(self) -> str:
        mode = "batch_invariant=true" if self.batch_invariant else "batch_invariant=false"
        verdict = "PASS" if self.passed else "FAIL"
        bound = "bitwise" if self.tolerance == 0 else f"max |delta| <= {self.tolerance:g}"
        routing = "" if self.routing is None else f"\n{self.routing.text()}"
        return (f"parity ({mode}, {self.sequences} sequences): tokens checked {self.tokens_checked}, "
                f"tokens different {self.tokens_different}, max |delta logprob| {self.max_abs_diff:.3e}, "
                f"mean |delta logprob| {self.mean_abs_diff:.3e}{routing}\n{verdict} ({bound}){self.hint()}")

    def hint(self) -> str:
        """What to change after a bitwise FAIL without the mode, the expected outcome there (default kernels round
        the generator's and the trainer's sums differently, on CPU as on GPU)."""
        if self.passed or self.batch_invariant or self.tolerance > 0 or self.tokens_checked == 0:
            return ""
        accept = ""
        if math.isfinite(self.max_abs_diff) and self.max_abs_diff > 0:
            accept = f"; or accept this much with --tolerance {10 ** math.ceil(math.log10(self.max_abs_diff)):g}"
        return f": expected without the mode, as bit-for-bit equality needs --batch_invariant true{accept}"


def compare_logprobs(generator: list[torch.Tensor], trainer: list[torch.Tensor], tolerance: float = 0.0,
                     batch_invariant: bool = False) -> ParityReport:
    """The report for per-sequence log-prob tensors of the same tokens (generator's, trainer's)."""
    gen = torch.cat([g.float().reshape(-1) for g in generator]) if generator else torch.zeros(0)
    tr = torch.cat([t.float().reshape(-1).cpu() for t in trainer]) if trainer else torch.zeros(0)
    if gen.shape != tr.shape:
        raise ValueError(f"{gen.numel()} generator log-probs against {tr.numel()} trainer log-probs")
    diff = (gen - tr).abs()
    n = diff.numel()
    different = int((gen != tr).sum())
    max_diff = float(diff.max()) if n else 0.0
    mean_diff = float(diff.mean()) if n else 0.0
    if n and not torch.isfinite(diff).all():  # a NaN or inf on one side only: report it, never PASS
        max_diff = mean_diff = math.nan
    return ParityReport(n, different, max_diff, mean_diff, len(generator), tolerance, batch_invariant)


@torch.no_grad()
def trainer_logprobs(run, seqs: list[TrainSequence], temperature: float) -> list[torch.Tensor]:
    """The trainer's log-probs of each sequence's completion (in `seqs` order), packed as a training step packs."""
    tr = run.trainer
    out: dict[int, torch.Tensor] = {}
    for mb in make_micro_batches(seqs, tr.cfg.micro_batch_tokens, tr.device, tr.attn_backend,
                                 vision=tr.model.config.vision):
        lp, _ = tr.logprobs_entropy(mb, temperature)
        for i in mb.seq_ids.unique().tolist():
            out[i] = lp[mb.seq_ids == i]
    return [out[i] for i in range(len(seqs))]


def check_parity(cfg: RunConfig, num_prompts: int = 4, samples: int = 2, tolerance: float = 0.0) -> ParityReport:
    """Sample `samples` completions for each of the task's first `num_prompts` held-out prompts with the run's
    generator, re-score them with the run's trainer, and compare (see the module docstring). `cfg` is not changed;
    the run directory the loop writes goes to a temporary directory."""
    from monorl.rl.rollouts.rollout import generate_rollouts
    from monorl.rl.rollouts.sampling import rollout_sampling
    from monorl.run.grpo import GRPORun

    if num_prompts < 1 or samples < 1:
        raise ValueError(f"parity needs >= 1 prompt and >= 1 sample, got {num_prompts} and {samples}")
    cfg = copy.deepcopy(cfg)
    cfg.logging = type(cfg.logging)()  # a check, not a run: no TensorBoard / W&B run for it
    with tempfile.TemporaryDirectory(prefix="monorl-parity-") as tmp:
        cfg.run_dir = tmp
        run = GRPORun(cfg, progress=False)
        run.policy.train()  # as a training step runs it
        prompts = run.task.val_prompts(num_prompts)
        groups = generate_rollouts(run.generator, run.tokenizer, run.task, prompts, rollout_sampling(run.cfg, 0),
                                   samples, run.spec.max_len)
        seqs = [r.train_sequence() for g in groups for r in g if r.completion_ids]
        if not seqs:
            raise ValueError("parity: no prompt fits generator.max_model_len with rollout.max_new_tokens")
        trainer = trainer_logprobs(run, seqs, cfg.rollout.temperature)
        routing = None
        if run.policy.config.is_moe:
            routing = generator_trainer_routing(run.generator.model, run.policy, run.trainer.autocast_dtype,
                                                [list(s.prompt_ids) + list(s.completion_ids) for s in seqs])
    generator = [torch.tensor(s.old_logprobs, dtype=torch.float32) for s in seqs]
    report = compare_logprobs(generator, trainer, tolerance, run.cfg.batch_invariant is True)  # auto: resolved
    return report if routing is None else dataclasses.replace(report, routing=routing)


def parity_args(p: Any) -> None:
    """The `monorl parity` verb's own arguments (an argparse / jsonargparse parser)."""
    p.add_argument("--prompts", type=int, default=4, help="held-out prompts of the task to sample")
    p.add_argument("--samples", type=int, default=2, help="completions per prompt")
    p.add_argument("--tolerance", type=float, default=0.0,
                   help="PASS when max |delta logprob| <= this (default 0: bit for bit)")


def cmd_parity(cfg: RunConfig, args: Namespace) -> int:
    """The `monorl parity` verb: print the report; exit status 0 on PASS, 1 on FAIL."""
    if args.tolerance < 0:
        raise ValueError(f"--tolerance must be >= 0, got {args.tolerance}")
    report = check_parity(cfg, args.prompts, args.samples, args.tolerance)
    print(report.text(), flush=True)
    return 0 if report.passed else 1
