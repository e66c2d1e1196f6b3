"""`monorl <verb>`: one entry per verb in VERBS (its help line, example, own arguments and what it runs); the
run config's keys come from the config dataclasses (monorl/cliargs.py), so a new key or section needs no edit
here. Errors a user can fix end in one line, `monorl: error: ...`, exit 2."""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentError, ArgumentParser, Namespace

from monorl.cliargs import base_config, condense_error, config_file_text, config_parser, flag_value, parse_config
from monorl.config import RunConfig, config_diff, config_from_dict, format_config_diff
from monorl.config_paths import with_absolute_paths
from monorl.console import best_effort
from monorl.presets import PRESETS


@dataclass(frozen=True)
class Verb:
    run: Callable[[RunConfig | None, Namespace], int]  # (the config, or None without one; its own arguments)
    help: str  # one line in `monorl --help`
    example: str
    config: bool = True  # takes the run config: --preset NAME, --config FILE, --a.b value
    add_args: Callable[[ArgumentParser], None] | None = None
    base: Callable[[list[str]], RunConfig] = base_config  # the config the command line's keys apply to


# ---- train ----------------------------------------------------------------------------------------------------

def _train_args(p: ArgumentParser) -> None:
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue RUN_DIR (or one of its checkpoints) where it stopped; keys given apply to its "
                        "config.json (with --preset: the command line is the whole config)")
    p.add_argument("--allow-config-change", "--allow_config_change", dest="allow_config_change",
                   action="store_true", help="with --resume: accept keys that differ from the stored config")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="run as N ranks (one per GPU) on this machine: torchrun --standalone --nproc_per_node N; "
                        "several nodes: torchrun on each (docs/guides/several-gpus.md)")


def _stored_config(resume: str) -> tuple[Path, RunConfig]:
    """(the run dir, its config.json as read back: keys a newer monorl added take their defaults)."""
    from monorl.run.checkpoints.files import find_checkpoint

    run_dir = find_checkpoint(resume).parent.parent  # CheckpointError (a ValueError) names what is missing
    stored_file = run_dir / "config.json"
    try:
        stored = json.loads(stored_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the resumed run's config {stored_file}: {e}") from None
    return run_dir, config_from_dict(stored)


def _train_base(argv: list[str]) -> RunConfig:
    resume = flag_value(argv, "--resume")
    if resume is None or any(a == "--preset" or a.startswith("--preset=") for a in argv):
        return base_config(argv)
    return _stored_config(resume)[1]


def _resume_config(resume: str, rest: list[str], allow_change: bool) -> RunConfig:
    """The config to resume with: the run's config.json + `rest` (or, with --preset, `rest` alone, as for a fresh
    run), checked against config.json: differing keys are an error unless allowed."""
    argv = [*rest, "--resume", resume]
    base = _train_base(argv)
    cfg, _ = parse_config(config_parser("monorl train", "", base, _train_args), argv, base)
    run_dir, stored = _stored_config(resume)
    return _check_resume(cfg, run_dir, stored, allow_change)


def _check_resume(cfg: RunConfig, run_dir: Path, stored: RunConfig, allow_change: bool) -> RunConfig:
    cfg.run_dir = str(run_dir)
    if diff := config_diff(stored.to_dict(), cfg.to_dict()):
        listing = format_config_diff(diff)
        if not allow_change:
            raise ValueError(f"the config differs from the one {run_dir} was trained with "
                             f"({run_dir / 'config.json'}); keys that differ (stored -> now):\n{listing}\n"
                             "pass --allow-config-change to resume with the new values")
        print(f"resuming with a changed config (--allow-config-change):\n{listing}", file=sys.stderr)
    return cfg


def cmd_train(cfg: RunConfig | None, args: Namespace) -> int:
    from monorl.run.grpo import train

    assert cfg is not None
    if args.resume is None and args.allow_config_change:
        raise ValueError("--allow-config-change only applies with --resume RUN_DIR")
    cfg = with_absolute_paths(cfg)  # as the run stores them, so a resume's keys compare equal
    if args.resume is not None:
        run_dir, stored = _stored_config(args.resume)
        cfg = _check_resume(cfg, run_dir, stored, args.allow_config_change)
    if args.nproc is not None:  # this run as N ranks under torchrun, each reading the config resolved here
        from monorl.run.launch import relaunch_train

        return relaunch_train(cfg, args.nproc, args.resume, args.allow_config_change)
    train(cfg, progress=sys.stderr.isatty(), resume=args.resume)
    return 0


# ---- config, presets, report ------------------------------------------------------------------------------------

def _config_args(p: ArgumentParser) -> None:
    p.add_argument("--out", default=None, metavar="FILE",
                   help="write the config to FILE (.json: JSON, else YAML) instead of printing it")
    p.add_argument("--format", default=None, choices=["yaml", "json"], help="printed format (default yaml)")


def cmd_config(cfg: RunConfig | None, args: Namespace) -> int:
    assert cfg is not None
    fmt = args.format or ("json" if args.out and args.out.endswith(".json") else "yaml")
    text = config_file_text(cfg, fmt)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {args.out}: monorl train --config {args.out} runs it", file=sys.stderr)
    else:
        print(text, end="")
    return 0


def cmd_presets(cfg: RunConfig | None, args: Namespace) -> int:
    width = max(map(len, PRESETS))
    for name, make in PRESETS.items():
        doc = " ".join((make.__doc__ or "").split())
        doc = re.split(r"\.\s+(?=[A-Z])", doc)[0].removesuffix(".")  # its first sentence ("et al. 2025" is not an end)
        print(f"{name:<{width}}  {doc}")
    return 0


def _report_args(p: ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory (holds metrics.jsonl)")
    p.add_argument("--out", default=None, metavar="FILE.png", help="PNG path (default: RUN_DIR/report.png)")


def cmd_report(cfg: RunConfig | None, args: Namespace) -> int:
    from monorl.run.report import report

    print(report(args.run_dir, args.out))
    return 0


def _plan_args(p: ArgumentParser) -> None:
    p.add_argument("--gpu_memory_gb", type=float, default=None, metavar="N",
                   help="the GPU's memory in GiB (nvidia-smi's MiB / 1024: 79.6 for an H100 80GB, 140.4 for an "
                        "H200); default: this machine's GPU")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="plan one GPU of an N-GPU run (FSDP2: monorl train --nproc N)")


def cmd_plan(cfg: RunConfig | None, args: Namespace) -> int:
    import torch

    from monorl.plan import GiB
    from monorl.plan_report import plan_report

    assert cfg is not None
    if args.gpu_memory_gb is not None:
        if not args.gpu_memory_gb > 0:
            raise ValueError(f"--gpu_memory_gb must be > 0, got {args.gpu_memory_gb}")
        device_bytes = int(args.gpu_memory_gb * GiB)
    elif torch.cuda.is_available():
        device_bytes = torch.cuda.get_device_properties(0).total_memory
    else:
        raise ValueError("no GPU here: give the GPU's memory with --gpu_memory_gb N, in GiB as nvidia-smi's MiB / 1024 "
                         "(79.6 for an H100 80GB, 140.4 for an H200)")
    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    text, fits = plan_report(cfg, device_bytes, ranks=args.nproc)
    print(text)
    return 0 if fits else 1


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """`module.name`, imported on its first call: a verb's own modules stay out of the other verbs' start-up."""
    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args)
    return call


_EVAL = "monorl.eval.run"  # eval's and generate's commands


VERBS: dict[str, Verb] = {
    "train": Verb(cmd_train, "run GRPO (default preset: tiny)",
                  "monorl train --preset qwen3_0_6b_gsm8k --model.path Qwen/Qwen3-0.6B --trainer.lr 1e-6",
                  add_args=_train_args, base=_train_base),
    "eval": Verb(_lazy(_EVAL, "cmd_eval"),
                 "evaluate a model on a task's held-out prompts: greedy, pass@k, mean@k",
                 "monorl eval --model.path runs/RUN/checkpoints/final --k 8 --validation.num_prompts 100",
                 add_args=_lazy(_EVAL, "eval_args"), base=_lazy(_EVAL, "checkpoint_base")),
    "generate": Verb(_lazy(_EVAL, "cmd_generate"),
                     "complete prompts with a model, rendered as its task does (--temperature 0: greedy)",
                     "monorl generate --preset qwen3_0_6b_sum_digits "
                     "--model.path Qwen/Qwen3-0.6B --prompt 'What is 2+3?' --temperature 0",
                     add_args=_lazy(_EVAL, "generate_args"), base=_lazy(_EVAL, "checkpoint_base")),
    "plan": Verb(cmd_plan, "the memory plan of a run on one GPU, before loading anything; exit 1 if it does not fit",
                 "monorl plan --preset qwen3_0_6b_gsm8k --model.path Qwen/Qwen3-4B --gpu_memory_gb 79.6",
                 add_args=_plan_args),
    "report": Verb(cmd_report, "plot a run's curves to a PNG and print a summary table",
                   "monorl report runs/tiny-20261121-120000", config=False, add_args=_report_args),
    "config": Verb(cmd_config, "print (or --out FILE: write) the resolved config as YAML or JSON",
                   "monorl config --preset qwen3_0_6b_gsm8k --trainer.lr 1e-6 --out run.yaml",
                   add_args=_config_args),
    "parity": Verb(_lazy("monorl.parity", "cmd_parity"),
                   "generator vs trainer log-probs on a few prompts, as a run builds them: PASS (exit 0) "
                   "or FAIL (exit 1)", "monorl parity --preset qwen3_0_6b_sum_digits --model.path Qwen/Qwen3-0.6B "
                   "--batch_invariant true", add_args=_lazy("monorl.parity", "parity_args")),
    "presets": Verb(cmd_presets, "list the presets", "monorl presets", config=False),
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("monorl")
    except PackageNotFoundError:
        return "unknown (not installed)"


def top_help() -> str:
    width = max(map(len, VERBS))
    verbs = "\n".join(f"  {name:<{width}}  {v.help}" for name, v in VERBS.items())
    examples = "\n".join(f"  {v.example}" for v in VERBS.values())
    return (f"usage: monorl VERB [options]    (monorl VERB --help: its options, every config key with its type, "
            f"default and description)\n\nRL post-training for language models in plain PyTorch.\n\n"
            f"verbs:\n{verbs}\n\nexamples:\n{examples}\n\n"
            "options:\n  -h, --help  this help\n  --version   print the version")


def verb_parser(name: str, argv: list[str]) -> tuple[ArgumentParser, RunConfig | None]:
    """The verb's parser (config keys defaulting to its base config) and that base config."""
    verb = VERBS[name]
    prog = f"monorl {name}"
    if not verb.config:
        p = ArgumentParser(prog=prog, description=verb.help, exit_on_error=False, allow_abbrev=False)
        if verb.add_args is not None:
            verb.add_args(p)
        return p, None
    base = verb.base(argv)
    p = config_parser(prog, f"{verb.help}. Example: {verb.example}", base, verb.add_args)
    if any(a in ("-h", "--help") for a in argv):  # the chosen task's arguments, with their descriptions
        from monorl.task_registry import task_object
        from monorl.tasks.arguments import task_args_help

        name = flag_value(argv, "--task.name") or base.task.name
        p.help_appendix = task_args_help(name, task_object, base.task.args if name == base.task.name else None)
        if name != base.task.name:  # the base's task args belong to its own task (`parse_config` drops them too)
            p.set_defaults({"task.args": {}})
    return p, base


def run_verb(name: str, argv: list[str]) -> int:
    p, base = verb_parser(name, argv)
    if base is None:
        try:
            args = p.parse_args(argv)
        except ArgumentError as e:
            raise ValueError(condense_error(str(e))) from None
        return VERBS[name].run(None, args)
    cfg, args = parse_config(p, argv, base)
    return VERBS[name].run(cfg, args)


def main(argv: list[str] | None = None) -> int:
    """`monorl VERB ...`; the console is best effort (`monorl.console`): a closed pipe ends no command."""
    with best_effort():
        return _main(sys.argv[1:] if argv is None else argv)


def _main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(top_help())
        return 0
    if argv[0] == "--version":
        print(f"monorl {version()}")
        return 0
    if argv[0] not in VERBS:
        print(f"monorl: error: unknown command {argv[0]!r}; the commands are {', '.join(VERBS)} "
              "(monorl --help)", file=sys.stderr)
        return 2
    try:
        return run_verb(argv[0], argv[1:])
    except SystemExit as e:  # --help printed
        return e.code if isinstance(e.code, int) else 0
    except ImportError as e:  # an optional dependency (the message says what to install)
        print(f"monorl: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as e:  # configuration / input errors: one clear line, no traceback
        print(f"monorl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C: where the run stands (the loop fills this in), no traceback
        print(f"\nmonorl: {e or 'interrupted'}", file=sys.stderr)
        return 130


def entry() -> None:
    """The `monorl` command (and `python -m monorl.cli`): `main()`, then exit without the interpreter's teardown.
    Every file a run writes is closed by then (logs, metrics, checkpoints and loggers close themselves; checkpoint
    writes are synchronous); what the exit skips is freeing the CUDA context, the caching allocator's segments and
    every module's objects one by one, about a second after a GPU run. In-process callers use `main()`."""
    rc = main()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):  # a closed pipe or stream: nothing left to say
        pass
    logging.shutdown()
    os._exit(rc)


if __name__ == "__main__":
    entry()
