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
    """After each step: a run that had a learning signal and then went `patience` steps in a row with every group's
    rewards equal (every advantage 0) and a zero gradient has collapsed to outputs that all score alike (or solves
    every prompt): further steps train on nothing and only move it on AdamW's momentum, so this raises
    `NoLearningSignal`. A run without any signal since its first step is warned about once (the line returned):
    a hard start may still find a signal. patience 0: never."""
    def dead(r: dict) -> bool:
        return r.get("frac_reward_zero_std") == 1.0 and r.get("grad_norm") == 0.0

    if patience <= 0 or len(rows) < patience or not all(map(dead, rows[-patience:])):
        return ""  # (the earlier rows are read only once the last `patience` are silent: not every step)
    what = f"every group's rewards were equal (mean reward {rows[-1]['reward']:+.3f}) and the gradient was 0"
    if all(map(dead, rows[:-patience])):
        return (f"warning: no learning signal in the first {patience} steps: {what}; the run trains on nothing "
                "until a group's samples score differently (a warm start, a larger group, other prompts or "
                "rewards)") if len(rows) == patience else ""
    raise NoLearningSignal(f"no learning signal for {patience} steps in a row after steps that had one: {what}; "
                           f"stopped after step {rows[-1]['step'] + 1} (samples.jsonl shows what the policy "
                           f"writes; --stop_without_signal 0 runs on)")


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
