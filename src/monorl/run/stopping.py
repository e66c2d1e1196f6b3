"""Stopping a run without losing it: SIGTERM (a scheduler's preemption) or a first Ctrl-C asks the loop to
finish the step under way, write a checkpoint and stop; a second Ctrl-C stops at once. Between steps the
trainer's state is whole, so that checkpoint resumes exactly."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import FrameType, TracebackType

from monorl.run.checkpoints.files import no_checkpoint_hint, step_checkpoints


class GracefulStop:
    """Context manager over the RL steps: `requested` names the signal once one arrived ('' before)."""

    def __init__(self) -> None:
        self.requested = ""
        self._previous: dict[int, object] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: now
        self.requested = name
        print(f"\n{name}: stopping after the step under way, with a checkpoint (Ctrl-C again: stop now)",
              file=sys.stderr, flush=True)

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous = {}


class NoLearningSignal(ValueError):
    """The run learns nothing more: every group scored alike and the gradient was zero for several steps in a row."""


def check_learning_signal(rows: list[dict], patience: int) -> str:
    """After each step, over the step rows so far: `patience` steps in a row with every group's rewards equal (every
    advantage 0) and a zero gradient train on nothing (they only move the policy on AdamW's momentum). What that
    means depends on the reward they hold, against the mean reward of the run's earlier steps that had a signal:

    - below it, the policy collapsed to outputs that all score alike and low (#56: the tiny_tools preset fell to
      reward 0): `NoLearningSignal` stops the run;
    - at or above it, the policy converged: each prompt's samples all right (or all wrong) at the run's best reward
      (Gemma-3-270M's arith run, reward 0.94 with every group uniform, H100, 2026-12-07). The run goes on, as TRL's
      and verl's do (other prompts may still teach it), with a warning line once per such stretch;
    - without any signal since the first step, a warning once: a hard start may still find a signal.

    Returns the warning line ('' for none). patience 0: never."""
    def dead(r: dict) -> bool:
        return r.get("frac_reward_zero_std") == 1.0 and r.get("grad_norm") == 0.0

    if patience <= 0 or len(rows) < patience or not all(map(dead, rows[-patience:])):
        return ""  # (the earlier rows are read only once the last `patience` are silent: not every step)
    window = rows[-patience:]
    what = f"every group's rewards were equal (mean reward {window[-1]['reward']:+.3f}) and the gradient was 0"
    signal = [r["reward"] for r in rows[:-patience] if not dead(r)]
    fresh = len(rows) == patience or not dead(rows[-patience - 1])  # this silent stretch just reached `patience`
    if not signal:
        return (f"warning: no learning signal in the first {patience} steps: {what}; the run trains on nothing "
                "until a group's samples score differently (a warm start, a larger group, other prompts or "
                "rewards)") if len(rows) == patience else ""
    held, before = sum(r["reward"] for r in window) / patience, sum(signal) / len(signal)
    if held >= before:
        return (f"warning: no learning signal for {patience} steps in a row: {what}, at or above the mean reward of "
                f"the steps before ({before:+.3f}): the policy has converged on these prompts; the run goes on"
                ) if fresh else ""
    raise NoLearningSignal(f"no learning signal for {patience} steps in a row after steps that had one: {what}, "
                           f"below the mean reward of the steps before ({before:+.3f}); stopped after step "
                           f"{rows[-1]['step'] + 1} (samples.jsonl shows what the policy writes; "
                           "--stop_without_signal 0 runs on)")


def interrupted_line(run_dir: Path, steps_done: int | None, steps: int, stop_signal: str) -> str:
    """Where a stopped run stands and what continues it: `--resume` from its last checkpoint, or, stopped before
    its first one (the warm start and the validation before RL write none), starting over."""
    found = step_checkpoints(run_dir / "checkpoints")
    where = "before the first RL step" if steps_done is None else f"after {steps_done}/{steps} steps"
    what = f"stopped by {stop_signal}" if stop_signal else "interrupted"
    if not found:
        every = " (--checkpoint.every N / --checkpoint.every_minutes M write checkpoints during the run)" \
            if steps_done else ""
        return f"{what} {where}; {no_checkpoint_hint(run_dir)}{every}"
    step, path = found[-1]
    return (f"{what} {where}; the last checkpoint is {path} (step {step}); continue with: "
            f"monorl train --resume {run_dir}")
