"""monorl against TRL's GRPOTrainer on one GPU: the same model, prompts, rewards and hyper-parameters (issue #43).

Both sides start from one preset (default `smollm2_135m_arith`, SmolLM2-135M-Instruct from a GGUF file;
`gemma3_270m_arith`: Gemma-3-270M, the base model, from its Q4_K_M GGUF, transformers 5.25's GGUF loader reads
`gemma3` too):

  monorl  `python -m monorl.cli train --preset P --model.path FILE.gguf --steps N ...` in a child process, timed
          whole (interpreter, imports, startup, validation before and after, the steps); reward per step from
          its run dir's metrics.jsonl, greedy pass@1 before / after from its summary.json.
  trl     a child process of this script (`--phase trl`): transformers loads the GGUF (dequantized to fp32),
          greedy pass@1 on the held-out prompts with transformers' generate, `GRPOTrainer.train()` for N steps
          on the training prompts monorl draws, in the same order (`shuffle_dataset=False`), with the task's own
          reward components as TRL reward functions (both sides score with `Task.reward`), then pass@1 again.
          Timed: `trainer.train()` alone and the whole phase.

The same prompt tokens on both sides, checked for every prompt before TRL starts (`trl_prompts`): a tokenizer
with a chat template (SmolLM2) gets the messages, which TRL renders with the file's template; one without (a base
model's plain few-shot prompt: Gemma-3-270M) gets the text monorl's `Task.render` writes less its BOS text, as TRL
tokenizes plain text with the tokenizer's special tokens (the BOS transformers adds is the one monorl writes).

The settings TRL gets are read from the preset (one source): per_device_train_batch_size = prompts x group,
num_generations = group, gradient_accumulation_steps 1 (one optimizer step per generation batch, on-policy),
lr, schedule, warmup, AdamW betas / eps / weight decay, max_grad_norm, temperature, top_p, top_k,
max_completion_length, seed, beta = kl_coef, scale_rewards from advantage_std_norm, and the loss: monorl's
token-mean kinds (token_grpo, dapo) are TRL's loss_type "dapo" (token-level, normalised by the active tokens of
the whole batch) with epsilon / epsilon_high = clip_low / clip_high; monorl's grpo (one ratio per sequence) is
TRL's loss_type "grpo" with importance_sampling_level "sequence". TRL trains with bf16 autocast over fp32 weights
on CUDA, as monorl's trainer does, without activation checkpointing (TRL's default is on; monorl's plan leaves it
off for a model this small); TRL generates with transformers' generate (no vLLM on the device).

Prints a table last (per side: pass@1 before / after with Wilson 95% intervals, reward of the first / last 5
steps, wall times) and writes JSON (default benchmarks/results/vs_trl_<date>.json). `--sides trl` runs one side
now and takes the other's numbers from the JSON already at --out (two device calls, same warm machine).

--smoke: the plumbing on CPU in a few minutes: 2 steps of 2 prompts x 4, 8 tokens, 8 held-out prompts; monorl
runs `tiny_arith` (the built-in char model: no GGUF needed) unless --smoke-monorl gguf (then 8 decode slots and a
512 MiB KV budget: a CPU generator's default 256 MiB does not hold Gemma 3's per-sequence window rings for the
preset's 128 slots); TRL runs the real GGUF.

  python benchmarks/bench_vs_trl.py --model .device/model/SmolLM2-135M-Instruct.Q4_1.gguf --steps 100
  python benchmarks/bench_vs_trl.py --smoke --model /path/to/SmolLM2-135M-Instruct.Q4_1.gguf
  python benchmarks/bench_vs_trl.py --smoke --smoke-monorl gguf --preset gemma3_270m_arith \
      --model /path/to/gemma-3-270m-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from monorl.config import RunConfig  # noqa: E402 -- after the src path
from monorl.presets import preset  # noqa: E402
from monorl.task_registry import load_task  # noqa: E402
from monorl.tasks.base import Prompt, Task, messages_of  # noqa: E402

SMOKE = {"steps": 2, "rollout.prompts_per_step": 2, "rollout.group_size": 4, "rollout.max_new_tokens": 8,
         "validation.num_prompts": 8, "validation.max_new_tokens": 8}
# --smoke-monorl gguf: monorl's generator on CPU with the smoke's 8 sequences (the module docstring says why)
SMOKE_GGUF = {"generator.max_num_seqs": 8, "generator.kv_cache_bytes": 512 << 20}
# monorl loss kind -> TRL (loss_type, importance_sampling_level); see the module docstring
TRL_LOSS = {"token_grpo": ("dapo", "token"), "dapo": ("dapo", "token"), "grpo": ("grpo", "sequence"),
            "gspo": ("grpo", "sequence"), "cispo": ("cispo", "token")}
TRL_SCHEDULE = {"constant": "constant", "linear": "linear", "cosine": "cosine"}


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion k / n (95% for z = 1.96)."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # clamped: at k = 0 or n the bound is 0 or 1 exactly, which rounding would otherwise miss by 1e-17
    return (max(0.0, (centre - half) / (1 + z * z / n)), min(1.0, (centre + half) / (1 + z * z / n)))


def set_key(cfg: RunConfig, key: str, value: Any) -> None:
    """cfg.a.b = value for the dotted key 'a.b' (the same keys the command line takes as --a.b)."""
    *path, last = key.split(".")
    obj: Any = cfg
    for part in path:
        obj = getattr(obj, part)
    if not hasattr(obj, last):
        raise SystemExit(f"bench_vs_trl: no config key {key!r}")
    setattr(obj, last, value)


def settings(args: argparse.Namespace) -> tuple[RunConfig, dict[str, Any]]:
    """The preset with this benchmark's overrides, and those overrides (dotted key -> value) for monorl's CLI."""
    overrides: dict[str, Any] = dict(SMOKE) if args.smoke else {}
    if args.smoke and args.smoke_monorl == "gguf":
        overrides.update(SMOKE_GGUF)
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.lr is not None:
        overrides["trainer.lr"] = args.lr
    if args.seed is not None:
        overrides["seed"] = args.seed
    cfg = preset(args.preset)
    for k, v in overrides.items():
        set_key(cfg, k, v)
    return cfg, overrides


def task_of(cfg: RunConfig) -> Task:
    return load_task(cfg.task.name, **cfg.task.args)


def pass_stats(passed: list[bool]) -> dict[str, Any]:
    k, n = sum(passed), len(passed)
    lo, hi = wilson(k, n)
    return {"pass@1": k / n if n else None, "passed": k, "n": n, "ci95": [lo, hi]}


# ---- monorl ---------------------------------------------------------------------------------------------------

def run_monorl(args: argparse.Namespace, cfg: RunConfig, overrides: dict[str, Any]) -> dict[str, Any]:
    name = args.preset
    extra: list[str] = []
    if args.smoke and args.smoke_monorl == "tiny":  # the char model: no GGUF loader needed for the plumbing
        name, extra = "tiny_arith", ["--warm_start.steps", "2"]
    elif args.model:
        extra = ["--model.path", str(args.model)]
    run_dir = Path(tempfile.mkdtemp(prefix="vs_trl_monorl_")) / "run"
    cmd = [sys.executable, "-m", "monorl.cli", "train", "--preset", name, "--run_dir", str(run_dir),
           "--checkpoint.final", "false", "--checkpoint.every_minutes", "0", *extra]
    for k, v in overrides.items():
        cmd += [f"--{k}", str(v)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    print("monorl:", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"bench_vs_trl: monorl train failed (exit {proc.returncode}); its output is above")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows if "step" in r and "reward" in r]
    n_val = cfg.validation.num_prompts

    def side(v: dict[str, Any] | None) -> dict[str, Any]:
        if not v or v.get("pass_at_k") is None:
            return {}
        passed = round(v["pass_at_k"] * n_val)  # greedy: pass@1 is a share of n_val prompts
        return {**pass_stats([True] * passed + [False] * (n_val - passed)), "mean_reward": v["mean_reward"],
                "components": v["components"]}

    return {"preset": name, "pre": side(summary["pre"]), "post": side(summary["post"]), "reward_per_step": rewards,
            "wall_s": wall, "train_s": summary["total_s"], "startup_s": summary["startup_s"],
            "validation_s": summary.get("validation_s"), "device": summary["device"], "run_dir": str(run_dir)}


# ---- TRL ------------------------------------------------------------------------------------------------------

def trl_reward_funcs(task: Task) -> list[Any]:
    """The task's reward components as TRL reward functions (a list of floats per batch), scoring with the task's
    own `reward`, so both sides grade every completion identically."""
    def component(name: str) -> Any:
        def fn(completions: list[Any], answer: list[Any], **_: Any) -> list[float]:
            out = []
            for c, a in zip(completions, answer, strict=True):
                text = c[-1]["content"] if isinstance(c, list) else c  # conversational: [{"role", "content"}]
                out.append(float(task.reward(Prompt(text="", answer=a), text)[name] or 0.0))
            return out
        fn.__name__ = name  # TRL logs rewards/<name>/mean
        return fn
    return [component(c) for c in task.reward_components]


def trl_tokens(task: Task, p: Prompt, hf_tok: Any, ours: Any) -> tuple[Any, list[int], list[int], str]:
    """(what TRL's dataset gets as prompt `p`, the ids TRL will tokenize it to, monorl's ids, the rendered text)."""
    bos = ours.special_tokens.get("bos_token", "") if getattr(ours, "add_bos_token", False) else ""
    text = task.render(p, ours)
    if hf_tok.chat_template:
        row: Any = messages_of(p)
        got = hf_tok.apply_chat_template([row], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"][0]
    else:
        row = text.removeprefix(bos) if bos else text
        got = hf_tok(text=row)["input_ids"]  # as TRL's GRPOTrainer tokenizes a plain prompt
    return row, list(got), ours.encode(text), text


def trl_prompts(task: Task, prompts: list[Prompt], hf_tok: Any, ours: Any) -> tuple[list[Any], list[list[int]]]:
    """What TRL's dataset gets as each prompt, and the token ids both sides feed the model (monorl's: `Task.render`
    through monorl's tokenizer `ours`), checked equal to what TRL will tokenize (the module docstring): with a chat
    template, the messages; without one, the rendered text less the BOS text transformers' tokenizer adds itself."""
    rows, ids = [], []
    for p in prompts:
        row, got, want, text = trl_tokens(task, p, hf_tok, ours)
        if got != want:
            raise SystemExit(f"bench_vs_trl: TRL would feed other tokens than monorl for the prompt {text!r}: "
                             f"{got[:8]}... against {want[:8]}...")
        rows.append(row)
        ids.append(want)
    return rows, ids


def trl_tokenizer(task: Task, probe: Prompt, hf_tok: Any, ours: Any) -> Any:
    """transformers' tokenizer of the GGUF, or where it tokenizes `probe` otherwise than monorl, monorl's own
    `tokenizers` object as a transformers tokenizer. transformers 5.17 (the GPU machine's) builds Gemma 3's GGUF
    tokenizer without BOS and splits " What" in two; 5.25 builds what monorl builds (tests/test_gguf.py)."""
    from transformers import PreTrainedTokenizerFast

    _, got, want, _ = trl_tokens(task, probe, hf_tok, ours)
    if got == want:
        return hf_tok
    fast = PreTrainedTokenizerFast(tokenizer_object=ours._tok, chat_template=ours.chat_template, **ours.special_tokens)
    if fast.pad_token is None:
        fast.pad_token = fast.eos_token
    print(f"bench_vs_trl: transformers {__import__('transformers').__version__} tokenizes the GGUF's prompts "
          "otherwise than monorl; TRL gets monorl's tokenizer (what transformers 5.25 builds)", flush=True)
    return fast


def hf_pass_at_1(model: Any, tokenizer: Any, task: Task, prompts: list[Prompt], prompt_ids: list[list[int]],
                 max_new_tokens: int, component: str, threshold: float, batch: int = 256) -> dict[str, Any]:
    """Greedy pass@1 with transformers' generate on the prompts' token ids (`trl_prompts`), left-padded."""
    import torch

    passed: list[bool] = []
    was_training = model.training
    model.eval()
    for i in range(0, len(prompts), batch):
        chunk, chunk_ids = prompts[i:i + batch], prompt_ids[i:i + batch]
        width = max(map(len, chunk_ids))
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(x)) + x for x in chunk_ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in chunk_ids])
        with torch.no_grad():
            out = model.generate(input_ids=input_ids.to(model.device), attention_mask=mask.to(model.device),
                                 max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        completions = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        passed += [(task.reward(p, c)[component] or 0.0) >= threshold for p, c in zip(chunk, completions, strict=True)]
    model.train(was_training)
    return pass_stats(passed)


def trainable_copy(model: Any) -> Any:
    """The GGUF model transformers loaded (weights dequantized to fp32, but flagged as quantized, which its Trainer
    refuses to fine-tune) as a plain model of the same class and config holding the same weights."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    return plain


def trl_config(cfg: RunConfig, task: Task, output_dir: str, cuda: bool) -> Any:
    from trl import GRPOConfig

    ro, tr, loss = cfg.rollout, cfg.trainer, cfg.trainer.loss
    if loss.kind not in TRL_LOSS:
        raise SystemExit(f"bench_vs_trl: no TRL loss matches monorl's {loss.kind!r} (known: {', '.join(TRL_LOSS)})")
    if tr.min_lr_ratio != 0.0 or ro.advantage != "grpo" or ro.dynamic_sampling or ro.overlong_buffer:
        raise SystemExit("bench_vs_trl: the preset uses a setting with no TRL counterpart here (min_lr_ratio, "
                         "advantage kind, dynamic sampling or the overlong penalty)")
    loss_type, level = TRL_LOSS[loss.kind]
    schedule = TRL_SCHEDULE[tr.schedule]
    if schedule == "constant" and tr.warmup_steps:
        schedule = "constant_with_warmup"
    return GRPOConfig(
        output_dir=output_dir, max_steps=cfg.steps, seed=cfg.seed, report_to="none", save_strategy="no",
        logging_steps=1, shuffle_dataset=False, remove_unused_columns=False, bf16=cuda, use_cpu=not cuda,
        per_device_train_batch_size=ro.prompts_per_step * ro.group_size, num_generations=ro.group_size,
        gradient_accumulation_steps=1, num_iterations=1,
        # TRL defaults to activation checkpointing; monorl turns it on only when the memory plan says the run does
        # not fit without it (a 135M model fits): off on both sides, so TRL is not timed recomputing activations
        gradient_checkpointing=bool(tr.activation_checkpointing),
        learning_rate=tr.lr, lr_scheduler_type=schedule, warmup_steps=tr.warmup_steps, weight_decay=tr.weight_decay,
        adam_beta1=tr.beta1, adam_beta2=tr.beta2, adam_epsilon=tr.eps, max_grad_norm=tr.max_grad_norm,
        temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k, max_completion_length=ro.max_new_tokens,
        mask_truncated_completions=ro.mask_truncated,
        beta=loss.kl_coef, loss_type=loss_type, importance_sampling_level=level,
        epsilon=loss.floor, epsilon_high=loss.ceiling,
        scale_rewards="group" if ro.advantage_std_norm else "none",
        reward_weights=[float(task.reward_weights.get(c, 1.0)) for c in task.reward_components],
    )


def run_trl_phase(args: argparse.Namespace) -> None:
    """The TRL side, in its own process (`--phase trl`): writes its result JSON to --phase-out."""
    t_phase = time.perf_counter()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from monorl.model.hf_checkpoint import load_tokenizer

    cfg, _ = settings(args)
    task = task_of(cfg)
    cuda = torch.cuda.is_available()
    model_file = Path(args.model).resolve()
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_file.parent, gguf_file=model_file.name)
    if tokenizer.pad_token is None:  # some transformers versions read no pad token from the GGUF (SmolLM2: pad = eos)
        tokenizer.pad_token = tokenizer.eos_token
    model = trainable_copy(AutoModelForCausalLM.from_pretrained(model_file.parent, gguf_file=model_file.name,
                                                                dtype=torch.float32))
    model.to("cuda" if cuda else "cpu")
    load_s = time.perf_counter() - t0
    ours = load_tokenizer(model_file)  # monorl's, for the prompt check (`trl_prompts`)
    v = cfg.validation
    val = task.val_prompts(v.num_prompts)
    tokenizer = trl_tokenizer(task, val[0], tokenizer, ours)
    ro = cfg.rollout
    prompts = list(islice(task.train_prompts(seed=cfg.seed), cfg.steps * ro.prompts_per_step))
    _, val_ids = trl_prompts(task, val, tokenizer, ours)
    rows, _ = trl_prompts(task, prompts, tokenizer, ours)
    print(f"trl: the {len(val) + len(prompts)} prompts' tokens equal monorl's ("
          f"{'chat template' if tokenizer.chat_template else 'plain text'})", flush=True)
    max_new = v.max_new_tokens or cfg.rollout.max_new_tokens
    component = v.pass_component or task.reward_components[0]
    t0 = time.perf_counter()
    pre = hf_pass_at_1(model, tokenizer, task, val, val_ids, max_new, component, v.pass_threshold)
    eval_s = time.perf_counter() - t0

    data = Dataset.from_list([{"prompt": row, "answer": p.answer} for row, p in zip(rows, prompts, strict=True)])
    with tempfile.TemporaryDirectory(prefix="vs_trl_trl_") as out_dir:
        trainer = GRPOTrainer(model=model, reward_funcs=trl_reward_funcs(task),
                              args=trl_config(cfg, task, out_dir, cuda), train_dataset=data,
                              processing_class=tokenizer)
        t0 = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t0
    trained = trainer.accelerator.unwrap_model(trainer.model)
    t0 = time.perf_counter()
    post = hf_pass_at_1(trained, tokenizer, task, val, val_ids, max_new, component, v.pass_threshold)
    eval_s += time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "reward" in h]
    result = {"pre": pre, "post": post, "reward_per_step": [h["reward"] for h in logs],
              "log_history": trainer.state.log_history, "train_s": train_s, "load_s": load_s, "eval_s": eval_s,
              "phase_s": time.perf_counter() - t_phase,
              "device": torch.cuda.get_device_name() if cuda else "cpu", "trl_config": trainer.args.to_dict()}
    Path(args.phase_out).write_text(json.dumps(result, indent=2, default=str) + "\n")


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="vs_trl_")) / "trl.json"
    cmd = [sys.executable, __file__, "--phase", "trl", "--phase-out", str(out), "--preset", args.preset,
           "--model", str(args.model)]
    cmd += [f for f, on in (("--smoke", args.smoke),) if on] + ["--smoke-monorl", args.smoke_monorl]
    cmd += [x for k, val in (("--steps", args.steps), ("--lr", args.lr), ("--seed", args.seed)) if val is not None
            for x in (k, str(val))]
    print("trl:", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"bench_vs_trl: the TRL phase failed (exit {proc.returncode}); its output is above")
    return {**json.loads(out.read_text()), "wall_s": wall}


# ---- the report -----------------------------------------------------------------------------------------------

def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _pass(p: dict[str, Any]) -> str:
    if not p:
        return "n/a"
    lo, hi = p["ci95"]
    return f"{p['pass@1']:.3f} [{lo:.3f}, {hi:.3f}] ({p['passed']}/{p['n']})"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def table(result: dict[str, Any]) -> str:
    lines = ["| side | pass@1 before (95% CI) | pass@1 after (95% CI) | reward first 5 | reward last 5 | wall s | "
             "train s |", "|---|---|---|---|---|---|---|"]
    for name in ("monorl", "trl"):
        r = result.get(name)
        if not r:
            continue
        rw = r["reward_per_step"]
        lines.append(f"| {name} | {_pass(r['pre'])} | {_pass(r['post'])} | {_num(_mean(rw[:5]))} | "
                     f"{_num(_mean(rw[-5:]))} | {_num(r['wall_s'], '.1f')} | {_num(r['train_s'], '.1f')} |")
    if result.get("monorl") and result.get("trl"):
        m, t = result["monorl"], result["trl"]
        lines.append(f"\nmonorl whole process / TRL whole process: {m['wall_s'] / t['wall_s']:.3f}; monorl whole "
                     f"process / TRL trainer.train(): {m['wall_s'] / t['train_s']:.3f}")
    lines.append("wall s: each side's whole process (interpreter, imports, model load, held-out eval before and "
                 "after, training). train s: monorl's startup + steps (summary.json total_s); TRL's trainer.train().")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="the GGUF file (SmolLM2-135M-Instruct.Q4_1.gguf, gemma-3-270m-q4_k_m.gguf)")
    ap.add_argument("--preset", default="smollm2_135m_arith")
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default: the preset's)")
    ap.add_argument("--lr", type=float, default=None, help="learning rate for both sides (default: the preset's)")
    ap.add_argument("--seed", type=int, default=None, help="the run's seed on both sides (default: the preset's)")
    ap.add_argument("--sides", default="monorl,trl", help="sides to run now; others come from --out's JSON")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check: tiny sizes (module docstring)")
    ap.add_argument("--smoke-monorl", choices=("tiny", "gguf"), default="tiny",
                    help="--smoke: monorl's model, the built-in char model or the GGUF (needs monorl's GGUF loader)")
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default benchmarks/results/vs_trl_DATE.json)")
    ap.add_argument("--phase", choices=("trl",), help=argparse.SUPPRESS)
    ap.add_argument("--phase-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.model and not (args.smoke and args.smoke_monorl == "tiny" and args.sides == "monorl"):
        ap.error("--model FILE.gguf is needed (TRL loads it; so does monorl outside --smoke)")
    if args.model and not Path(args.model).is_file():
        ap.error(f"--model {args.model}: no such file")
    if args.phase == "trl":
        run_trl_phase(args)
        return
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if unknown := sorted(set(sides) - {"monorl", "trl"}):
        ap.error(f"--sides: unknown side(s) {unknown}; use monorl, trl or both")
    date = datetime.date.today().isoformat()
    out = args.out or ROOT / "benchmarks" / "results" / f"vs_trl_{'smoke_' if args.smoke else ''}{date}.json"
    cfg, overrides = settings(args)
    result: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {}
    result.update(date=date, preset=args.preset, smoke=args.smoke, overrides=overrides,
                  config=dataclasses.asdict(cfg))
    if "monorl" in sides:
        result["monorl"] = run_monorl(args, cfg, overrides)
    if "trl" in sides:
        result["trl"] = run_trl(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {out}\n")
    print(table(result))


if __name__ == "__main__":
    main()
