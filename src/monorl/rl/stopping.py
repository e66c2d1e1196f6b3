"""Stopping a run without losing it: SIGTERM (a scheduler's preemption) or a first Ctrl-C asks the loop to
finish the step under way, write a checkpoint and stop; a second Ctrl-C stops at once. Between steps the
trainer's state is whole, so that checkpoint resumes exactly."""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType, TracebackType


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

