"""A real demonstration on one GPU (issue #60, item 3): SmolLM2-135M-Instruct (GGUF) distilled from a teacher that
monorl's own RL made, against RL from the same start; and a run whose only reward is a generative judge.

--part distill (a):
  1. teacher: `monorl train --preset smollm2_135m_arith --model.path FILE.gguf` (default 100 steps), its final
     checkpoint kept, greedy held-out pass@1 (200 prompts, the Python reward) every `--rl-every` steps
     (validation.every). This run is also the RL curve: RL from the same start on the same prompt stream.
  2. students: the same preset from the same GGUF start, `--teacher.path <teacher run> --teacher.task_weight 0`
     (distillation alone), steps // 3 steps, pass@1 every `--distill-every` steps, once per `--distill-lrs` value
     (default: the RL run's lr and 4x it; the table names each).
  Target: a student reaches >= 90% of the teacher's final pass@1 within 1/3 of the teacher's RL steps. The teacher's
  cost per step: `time/teacher_s` (the teacher forward's wall seconds, a step metric) over the rest of the step,
  medians over the steps after the first.

--part judge (b): the arith prompts as a `dataset` task whose only reward is a generative judge (`--task.args.reward
  judge`); the Python reward is withheld from the run and scores it only at the end: greedy pass@1 on the 200
  held-out prompts with `monorl eval` before (the start) and after (the run's final checkpoint). The judge is the
  policy frozen at step 0 (`--judge-model start`, default) or the teacher of part (a) (`--judge-model teacher`).
  A 135M model cannot solve these products, and in a CPU probe (60 answers, a third right) it graded "Answer: n"
  10/10 whatever n was when asked to compare with a reference in words or by 4 worked gradings. So the task is
  made one it can do: reference-guided judging (the template's `{reference}`: the row's known answer) laid out so
  that the answer equal to the reference repeats a graded line of the prompt (`Student: Answer: <ref>` /
  `Score: 10/10`) among lines graded 0/10: grading is copying a line, which small models do (the probe: 41 of 60
  graded right, every right answer 10/10). Reported beside pass@1: the judge's agreement with the withheld reward on
  every training sample (samples.jsonl), and its parse failures. `--judge-model trained` (`judge_training.py`): a
  judge trained on grading rows (the preset's RL run's replies labelled by the Python reward, and written variants)
  to write the reply's number and the reference before its grade; it runs that RL run itself when no teacher run is
  given.

Prints a table and writes --out JSON (default benchmarks/results/demo_distill_<date>.json; a second call with the
other --part adds to the same file).

  python benchmarks/demo_distill.py --model .device/model/SmolLM2-135M-Instruct.Q4_1.gguf --part distill
  python benchmarks/demo_distill.py --model .device/model/SmolLM2-135M-Instruct.Q4_1.gguf --part judge
  python benchmarks/demo_distill.py --smoke     # CPU, the built-in tiny char model, a few minutes

--smoke: the whole script on CPU with `tiny_arith` (no GGUF): the start is a tiny_arith warm start (its checkpoint
plays the GGUF's part), then a few steps of each run on 8 held-out prompts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path
from typing import Any

import judge_training  # noqa: E402 -- benchmarks/ is the script's own directory
from bench_vs_trl import ROOT, wilson  # noqa: E402
from bench_vs_trl import _num as _n  # noqa: E402 -- the same 'n/a' or formatted number

sys.path.insert(0, str(ROOT / "src"))
from monorl.presets import preset  # noqa: E402
from monorl.task_registry import load_task  # noqa: E402
from monorl.tasks.base import Prompt  # noqa: E402

# reference-guided, by copying (the module docstring): the answer equal to {reference} repeats a 10/10 line
JUDGE_TEMPLATE = """Question: {question}

Student: Answer: 7
Score: 0/10

Student: Answer: {reference}
Score: 10/10

Student: Answer: 1234
Score: 0/10

Student: Answer: 58
Score: 0/10

Student: {completion}
Score:"""
SMOKE = {"rollout.prompts_per_step": 4, "rollout.group_size": 4, "validation.num_prompts": 8}
QUESTION_RE = judge_training.QUESTION_RE  # "What is a op b?" (probe_judge reads it from here)


# ---- child processes ------------------------------------------------------------------------------------------

def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def _cli(args: list[str], what: str) -> float:
    cmd = [sys.executable, "-m", "monorl.cli", *args]
    print(f"\n[{what}]", shlex.join(cmd), flush=True)  # copy-pastable: the judge template is quoted
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(), cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"demo_distill: {what} failed (exit {proc.returncode}); its output is above")
    return time.perf_counter() - t0


def train(what: str, name: str, run_dir: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    """`monorl train --preset name` with `overrides` (dotted key -> value) in a child process: its summary.json,
    metrics rows and whole-process wall time."""
    args = ["train", "--preset", name, "--run_dir", str(run_dir), "--checkpoint.every_minutes", "0"]
    for k, v in overrides.items():
        args += [f"--{k}", str(v)]
    wall = _cli(args, what)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"summary": json.loads((run_dir / "summary.json").read_text()), "rows": [r for r in rows if "step" in r],
            "wall_s": wall, "run_dir": str(run_dir)}


def evaluate(what: str, name: str, model: str, out: Path, extra: dict[str, Any]) -> dict[str, Any]:
    """Greedy pass@1 of `model` on the preset's held-out prompts by the task's own (Python) reward: `monorl eval`."""
    args = ["eval", "--preset", name, "--model.path", model, "--k", "0", "--out", str(out)]
    for k, v in extra.items():
        args += [f"--{k}", str(v)]
    wall = _cli(args, what)
    res = json.loads(out.read_text())
    passed = [(p["greedy_rewards"].get(res["pass_component"]) or 0.0) >= res["pass_threshold"] for p in res["prompts"]]
    return {**stats(sum(passed), len(passed)), "wall_s": wall}


def stats(k: int, n: int) -> dict[str, Any]:
    return {"pass@1": k / n if n else None, "passed": k, "n": n, "ci95": list(wilson(k, n))}


# ---- (a) distillation against RL --------------------------------------------------------------------------------

def curve(run: dict[str, Any], n_val: int) -> list[dict[str, Any]]:
    """Held-out greedy pass@1 against steps: before (0), every validation.every, after the last step."""
    s = run["summary"]
    points = [(0, s["pre"]), *((v["step"], {"pass_at_k": v.get("pass@1")}) for v in s["validations"]),
              (s["steps"], s["post"])]
    return [{"step": step, **stats(round(v["pass_at_k"] * n_val), n_val)} for step, v in points
            if v and v.get("pass_at_k") is not None]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def teacher_cost(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The teacher forward's seconds per step against the rest of the step (medians over the steps after the
    first, whose graphs and kernels warm up)."""
    steady = [r for r in rows[1:] if "time/teacher_s" in r] or [r for r in rows if "time/teacher_s" in r]
    teacher = [r["time/teacher_s"] for r in steady]
    rest = [r["time/step_s"] - r["time/teacher_s"] for r in steady]
    t, o = _median(teacher), _median(rest)
    return {"teacher_s": t, "step_without_teacher_s": o, "added": t / o if t is not None and o else None,
            "steps": len(steady)}


def teacher_rl(args: argparse.Namespace, start: dict[str, str], name: str, base: dict[str, Any],
               work: Path) -> dict[str, Any]:
    """The preset's RL run from the start: part (a)'s teacher and RL curve, and with every sample logged the replies
    `--judge-model trained` grades (labelled by the Python reward)."""
    cfg = preset(name)
    return train("teacher: RL", name, work / "teacher", {
        **base, **start, "steps": args.steps, "validation.every": args.rl_every,
        "samples_per_step": cfg.rollout.prompts_per_step * cfg.rollout.group_size})


def part_distill(args: argparse.Namespace, start: dict[str, str], name: str, base: dict[str, Any], work: Path,
                 n_val: int) -> dict[str, Any]:
    steps = args.steps
    teacher = teacher_rl(args, start, name, base, work)
    rl_curve = curve(teacher, n_val)
    teacher_acc = rl_curve[-1]["pass@1"]
    budget = steps // 3
    lr = preset(name).trainer.lr
    lrs = [float(x) * (lr if args.distill_lrs_relative else 1.0) for x in args.distill_lrs.split(",")]
    # a teacher gives each token its advantage: a per-sequence loss (tiny_arith's grpo) becomes its token-mean kind
    loss = {"trainer.loss.kind": "token_grpo"} if preset(name).trainer.loss.kind in ("grpo", "gspo") else {}
    students = []
    for student_lr in lrs:
        run = train(f"student: distillation, lr {student_lr:g}", name, work / f"student_lr{student_lr:g}", {
            **base, **start, "steps": budget, "validation.every": args.distill_every,
            "teacher.path": teacher["run_dir"], "teacher.task_weight": 0, "trainer.lr": student_lr,
            "checkpoint.final": "false", **loss})
        points = curve(run, n_val)
        reached = next((p["step"] for p in points if p["pass@1"] >= 0.9 * teacher_acc), None)
        students.append({"lr": student_lr, "curve": points, "reached_90pct_at": reached,
                         "target_met": reached is not None and reached <= steps / 3,
                         "teacher_cost": teacher_cost(run["rows"]),
                         "teacher_kl_first_last": [run["rows"][0].get("teacher/kl"), run["rows"][-1].get("teacher/kl")],
                         "wall_s": run["wall_s"], "steady_step_s": run["summary"]["steady_step_s"]})
    rl_at_budget = max((p for p in rl_curve if p["step"] <= budget), key=lambda p: p["step"])
    return {"teacher_steps": steps, "step_budget": budget, "teacher_pass@1": teacher_acc, "rl_curve": rl_curve,
            "rl_at_budget": rl_at_budget, "rl_steady_step_s": teacher["summary"]["steady_step_s"],
            "rl_wall_s": teacher["wall_s"], "rl_lr": lr, "teacher_run": teacher["run_dir"], "students": students}


# ---- (b) a judge-rewarded run ----------------------------------------------------------------------------------

def judge_dataset(name: str, steps: int, file: Path) -> int:
    """The preset's arith training prompts (as many as the run draws, the preset's seed) as a dataset file: the
    conversation and the reference answer; the task's Python reward stays out of the run."""
    cfg = preset(name)
    task = load_task(cfg.task.name, **cfg.task.args)
    prompts = list(islice(task.train_prompts(seed=cfg.seed), steps * cfg.rollout.prompts_per_step))
    file.write_text("".join(json.dumps({"prompt": p.meta["messages"], "answer": p.answer}) + "\n" for p in prompts))
    return len(prompts)


def judge_agreement(run_dir: Path, name: str) -> dict[str, Any]:
    """The judge's grade of each training sample against the withheld Python reward (correctness) of the same
    completion: agreement (grade >= 0.5 iff correct), the mean grade of right and wrong answers, parse failures."""
    cfg = preset(name)
    task = load_task(cfg.task.name, **cfg.task.args)
    right, wrong, failed = [], [], 0
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        m = QUESTION_RE.search(row["prompt"])
        grade = row["rewards"].get("judge")
        if m is None:
            continue
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        truth = a + b if op == "+" else a * b
        correct = (task.reward(Prompt(text=row["prompt"], answer=truth), row["completion"])["correctness"] or 0) > 0
        if grade is None:
            failed += 1
            continue
        (right if correct else wrong).append(grade)
    n = len(right) + len(wrong)
    agree = sum(g >= 0.5 for g in right) + sum(g < 0.5 for g in wrong)
    return {"samples": n + failed, "parse_failures": failed, "agreement": agree / n if n else None,
            "mean_grade_right": _mean(right), "mean_grade_wrong": _mean(wrong),
            "right": len(right), "wrong": len(wrong)}


def train_judge(args: argparse.Namespace, start: dict[str, str], name: str, base: dict[str, Any], work: Path,
                teacher_run: str) -> dict[str, Any]:
    """The judge of `--judge-model trained` (`judge_training`): from the start, supervised steps then RL on grading
    rows built from the teacher run's replies, labelled by the Python reward; its held-out grading accuracy after
    the supervised steps (the run's pre-validation) and after RL."""
    cfg = preset(name)
    rows = judge_training.build_rows(Path(teacher_run) / "samples.jsonl", load_task(cfg.task.name, **cfg.task.args),
                                     args.judge_rows, seed=cfg.seed)
    data = work / "judge_grading.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = train("judge: trained on grading rows", name, work / "judge_train", {
        **base, **start, "steps": args.judge_train_steps, "task.name": "dataset", "task.args.path": str(data),
        "task.args.reward": f"{Path(judge_training.__file__).resolve()}:verdict", "task.args.test_fraction": 0.05,
        "rollout.max_new_tokens": judge_training.ANSWER_TOKENS, "trainer.lr": args.judge_lr,
        "validation.max_new_tokens": judge_training.ANSWER_TOKENS,
        "validation.num_prompts": min(200, int(len(rows) * 0.05)), "generator.max_model_len": 512,
        "warm_start.steps": args.judge_sft_steps, "warm_start.lr": args.judge_sft_lr, "stop_without_signal": 0})
    s = run["summary"]
    return {"path": str(Path(run["run_dir"]) / "checkpoints" / "final"), "rows": len(rows),
            "steps": args.judge_train_steps, "lr": args.judge_lr, "sft_steps": args.judge_sft_steps,
            "sft_lr": args.judge_sft_lr, "wall_s": run["wall_s"],
            "grading_accuracy_after_sft": (s.get("pre") or {}).get("pass_at_k"),
            "grading_accuracy_after_rl": (s.get("post") or {}).get("pass_at_k")}


def part_judge(args: argparse.Namespace, start: dict[str, str], name: str, base: dict[str, Any], work: Path,
               teacher_run: str | None) -> dict[str, Any]:
    model = start["model.path"]
    template, answer_tokens, trained = JUDGE_TEMPLATE, 6, None
    if args.judge_model == "trained" and not teacher_run:  # replies to grade: the teacher's RL run alone
        teacher_run = teacher_rl(args, start, name, base, work)["run_dir"]
    if args.judge_model == "teacher" and not teacher_run:
        raise SystemExit(f"demo_distill: --judge-model {args.judge_model} needs part (a)'s teacher: run --part "
                         "distill first (same --out) or pass --teacher-run DIR")
    if args.judge_model == "teacher":
        judge_path = teacher_run
    elif args.judge_model == "trained":
        trained = train_judge(args, start, name, base, work, teacher_run)
        judge_path, template, answer_tokens = trained["path"], judge_training.TEMPLATE, judge_training.ANSWER_TOKENS
    else:
        judge_path = model
    data = work / "judge_arith.jsonl"
    rows = judge_dataset(name, args.judge_steps, data)
    cfg = preset(name)
    evals = {k: v for k, v in base.items() if k.startswith("validation.")}
    pre = evaluate("judge: pass@1 before (the start, Python reward)", name, model, work / "eval_pre.json", evals)
    run = train("judge: RL on the judge's grades alone", name, work / "judge_run", {
        **base, **start, "steps": args.judge_steps, "task.name": "dataset",
        "task.args.path": str(data), "task.args.reward": "judge", "task.args.judge_model": judge_path,
        # a JSON string is a YAML double-quoted scalar: the CLI reads values as YAML
        "task.args.judge_template": json.dumps(template), "task.args.judge_max_new_tokens": answer_tokens,
        "validation.num_prompts": 0, "stop_without_signal": 0,
        "samples_per_step": cfg.rollout.prompts_per_step * cfg.rollout.group_size * 4})
    final = str(Path(run["run_dir"]) / "checkpoints" / "final")
    post = evaluate("judge: pass@1 after (the run's final checkpoint, Python reward)", name, final,
                    work / "eval_post.json", evals)
    judged = [r.get("rewards/judge/mean") for r in run["rows"]]
    return {"judge_model": args.judge_model, "judge_path": judge_path, "template": template, "rows": rows,
            "trained_judge": trained,
            "steps": args.judge_steps, "pre": pre, "post": post,
            "agreement": judge_agreement(Path(run["run_dir"]), name),
            "judge_grade_first_last5": [_mean(judged[:5]), _mean(judged[-5:])],
            "parse_failures_per_step": _mean([r.get("judge/parse_failures", 0.0) for r in run["rows"]]),
            "wall_s": run["wall_s"], "steady_step_s": run["summary"]["steady_step_s"], "run_dir": run["run_dir"]}


def _mean(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


# ---- the report -----------------------------------------------------------------------------------------------

def _p(p: dict[str, Any] | None) -> str:
    if not p or p.get("pass@1") is None:
        return "n/a"
    lo, hi = p["ci95"]
    return f"{p['pass@1']:.3f} [{lo:.2f}, {hi:.2f}]"


def table(result: dict[str, Any]) -> str:
    lines = []
    if d := result.get("distill"):
        lines += [f"(a) teacher: RL {d['teacher_steps']} steps, held-out pass@1 {d['teacher_pass@1']:.3f}; target: "
                  f">= {0.9 * d['teacher_pass@1']:.3f} within {d['step_budget']} steps", "",
                  "| run | " + " | ".join(f"step {p['step']}" for p in d["rl_curve"]) + " |",
                  "|---|" + "---|" * len(d["rl_curve"]),
                  "| RL (teacher run) | " + " | ".join(_p(p) for p in d["rl_curve"]) + " |", ""]
        for s in d["students"]:
            lines += ["| distill lr " + f"{s['lr']:g} | " + " | ".join(f"{p['step']}: {_p(p)}" for p in s["curve"])
                      + " |"]
        lines += ["", "| student lr | reached 90% at step | target met | RL pass@1 at that budget | teacher s/step | "
                  "rest of step s | teacher adds | teacher/kl first -> last |", "|---|---|---|---|---|---|---|---|"]
        for s in d["students"]:
            c, kl = s["teacher_cost"], s["teacher_kl_first_last"]
            lines.append(f"| {s['lr']:g} | {s['reached_90pct_at']} | {s['target_met']} | "
                         f"{_p(d['rl_at_budget'])} (step {d['rl_at_budget']['step']}) | {_n(c['teacher_s'], '.4f')} | "
                         f"{_n(c['step_without_teacher_s'], '.4f')} | {_n(c['added'], '.3f')}x (target <= 0.35x) | "
                         f"{_n(kl[0])} -> {_n(kl[1])} |")
        lines.append(f"RL steady step {_n(d['rl_steady_step_s'], '.4f')} s; RL run wall {d['rl_wall_s']:.1f} s")
    if j := result.get("judge"):
        a = j["agreement"]
        if t := j.get("trained_judge"):
            before, after = _n(t["grading_accuracy_after_sft"]), _n(t["grading_accuracy_after_rl"])
            lines += ["", f"judge trained: {t['sft_steps']} supervised steps (lr {t['sft_lr']:g}), then "
                      f"{t['steps']} RL steps (lr {t['lr']:g}) on {t['rows']} grading rows, "
                      f"held-out grading accuracy after the supervised steps {before}, after RL {after}"]
        lines += ["", f"(b) judge-rewarded RL, {j['steps']} steps, judge = {j['judge_model']} ({j['judge_path']})",
                  "| pass@1 before (Python reward, withheld) | after | judge grade first 5 / last 5 steps | "
                  "judge agrees with the withheld reward | mean grade right / wrong | parse failures |",
                  "|---|---|---|---|---|---|",
                  f"| {_p(j['pre'])} | {_p(j['post'])} | {_n(j['judge_grade_first_last5'][0])} / "
                  f"{_n(j['judge_grade_first_last5'][1])} | {_n(a['agreement'])} ({a['right']} right, {a['wrong']} "
                  f"wrong) | {_n(a['mean_grade_right'])} / {_n(a['mean_grade_wrong'])} | {a['parse_failures']} of "
                  f"{a['samples']} |"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="the GGUF file (SmolLM2-135M-Instruct.Q4_1.gguf); not with --smoke")
    ap.add_argument("--preset", default="smollm2_135m_arith")
    ap.add_argument("--part", choices=("distill", "judge", "both"), default="both")
    ap.add_argument("--steps", type=int, default=None, help="the teacher's RL steps (default: the preset's)")
    ap.add_argument("--rl-every", type=int, default=None, help="RL validation interval (default: steps // 9)")
    ap.add_argument("--distill-every", type=int, default=None, help="student validation interval (default: "
                                                                    "(steps // 3) // 11)")
    ap.add_argument("--distill-lrs", default="1,4", help="student learning rates, comma-separated")
    ap.add_argument("--distill-lrs-absolute", dest="distill_lrs_relative", action="store_false",
                    help="--distill-lrs are learning rates (default: multiples of the preset's)")
    ap.add_argument("--judge-steps", type=int, default=None, help="judge-rewarded RL steps (default: --steps)")
    ap.add_argument("--judge-model", choices=("start", "teacher", "trained"), default="start",
                    help="the judge: the start frozen, part (a)'s teacher, or one trained on grading (judge_training)")
    ap.add_argument("--judge-rows", type=int, default=6000, help="--judge-model trained: grading rows")
    ap.add_argument("--judge-train-steps", type=int, default=0,
                    help="--judge-model trained: RL steps on `verdict` after the supervised ones")
    ap.add_argument("--judge-lr", type=float, default=1e-5, help="--judge-model trained: its RL learning rate")
    ap.add_argument("--judge-sft-steps", type=int, default=150,
                    help="--judge-model trained: supervised steps (32 rows each) on the grades before its RL")
    ap.add_argument("--judge-sft-lr", type=float, default=2e-5, help="--judge-model trained: their peak lr")
    ap.add_argument("--teacher-run", default=None, help="--judge-model teacher: the teacher's run dir")
    ap.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check with the tiny char model")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides for every run (e.g. rollout.prompts_per_step=4 device=cpu)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.smoke:
        args.preset = "tiny_arith"
        args.steps = args.steps or 4
    elif not args.model or not Path(args.model).is_file():
        ap.error(f"--model FILE.gguf is needed (got {args.model!r})")
    name = args.preset
    args.steps = args.steps or preset(name).steps
    args.judge_steps = args.judge_steps or args.steps
    args.rl_every = args.rl_every or max(1, args.steps // 9)
    args.distill_every = args.distill_every or max(1, (args.steps // 3) // 11)
    date = datetime.date.today().isoformat()
    out = args.out or ROOT / "benchmarks" / "results" / f"demo_distill_{'smoke_' if args.smoke else ''}{date}.json"
    work = args.work or Path(tempfile.mkdtemp(prefix="demo_distill_"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {}
    base: dict[str, Any] = dict(SMOKE) if args.smoke else {}
    base |= dict(kv.split("=", 1) for kv in args.set)
    if args.smoke:  # the start: a tiny_arith warm start, saved, in the GGUF's place
        _cli(["train", "--preset", name, "--run_dir", str(work / "start"), "--steps", "0", "--warm_start.steps",
              "50", "--validation.num_prompts", "0", "--checkpoint.every_minutes", "0"], "smoke: the start")
        start = {"model.path": str(work / "start"), "warm_start.steps": "0"}
    else:
        start = {"model.path": str(Path(args.model).resolve())}
    n_val = preset(name).validation.num_prompts if not args.smoke else SMOKE["validation.num_prompts"]
    result.update(date=date, preset=name, smoke=args.smoke, model=args.model)
    t0 = time.perf_counter()
    if args.part in ("distill", "both"):
        result["distill"] = part_distill(args, start, name, base, work, n_val)
    if args.part in ("judge", "both"):
        teacher = args.teacher_run or (result.get("distill") or {}).get("teacher_run")
        result["judge"] = part_judge(args, start, name, base, work, teacher)
    result[f"wall_s_{args.part}"] = time.perf_counter() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {out}\n")
    print(table(result))


if __name__ == "__main__":
    main()
