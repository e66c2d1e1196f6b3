"""The console is best effort; the run directory is the record.

`monorl train ... | tee log` loses `tee` first on Ctrl-C (the terminal signals the whole pipeline), and
`monorl train ... | head -3` closes the pipe after three lines: either way the next console write raises
`BrokenPipeError`. A run must survive that and still write its checkpoint, so `best_effort()` puts stdout and
stderr behind `ConsoleStream`s, which swallow a dead stream's errors and carry on without it, and copy every
line to the run directory's `console.log` once the run directory exists (`record_to`): what the console lost,
the log kept.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

LOG_FILE = "console.log"
_EARLY_LIMIT = 1 << 20  # characters kept from before the run directory exists (the model line, the plan)


class ConsoleStream(io.TextIOBase):
    """A text stream in front of stdout or stderr: writes go to the console while it lives and to the record
    (`console.log`) once attached; a console that raised (a closed pipe, a closed file) is dropped, silently."""

    def __init__(self, console: TextIO) -> None:
        self.console: TextIO | None = console
        self.record: TextIO | None = None
        self.early: list[str] | None = []  # written before the record was attached (None once it is)
        self.early_chars = 0

    def write(self, s: str) -> int:
        if self.console is not None:
            try:
                self.console.write(s)
            except (OSError, ValueError):  # BrokenPipeError, or a closed file: the console is gone
                self.console = None
        if "\r" not in s:  # progress bars redraw a line: not worth keeping
            self.keep(s)
        return len(s)

    def keep(self, s: str) -> None:
        """`s` to the record alone (or, before the record is attached, to what it will start with)."""
        if self.record is not None:
            with contextlib.suppress(OSError, ValueError):
                self.record.write(s)
        elif self.early is not None and self.early_chars < _EARLY_LIMIT:
            self.early.append(s)
            self.early_chars += len(s)

    def flush(self) -> None:
        if self.console is not None:
            try:
                self.console.flush()
            except (OSError, ValueError):
                self.console = None
        if self.record is not None:
            with contextlib.suppress(OSError, ValueError):
                self.record.flush()

    def isatty(self) -> bool:
        try:
            return self.console is not None and self.console.isatty()
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:
        if self.console is None:
            raise io.UnsupportedOperation("the console stream was closed")
        return self.console.fileno()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.console, "encoding", None) or "utf-8"


@contextlib.contextmanager
def best_effort() -> Iterator[None]:
    """stdout and stderr behind `ConsoleStream`s for the block (nested calls keep the outer ones)."""
    saved = sys.stdout, sys.stderr
    if not isinstance(sys.stdout, ConsoleStream):
        sys.stdout = ConsoleStream(sys.stdout)
    if not isinstance(sys.stderr, ConsoleStream):
        sys.stderr = ConsoleStream(sys.stderr)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            if stream not in saved and isinstance(stream, ConsoleStream):
                stream.flush()
                stream.record = None
        sys.stdout, sys.stderr = saved


def record_only(text: str) -> None:
    """`text` to console.log, not the console: what the console shows another way (Ctrl-C's line, which the CLI
    prints after the run unwound), or would drown in (every failing reward's traceback). Nothing outside
    `best_effort`."""
    if isinstance(sys.stderr, ConsoleStream):
        sys.stderr.keep(text)


def record_to(run_dir: Path) -> TextIO | None:
    """Copy stdout and stderr (what `best_effort` wraps) to `run_dir/console.log`, from what they printed before
    the run directory existed on; returns the open file (the caller closes it with `stop_recording`), or None
    when the streams are not wrapped."""
    streams = [s for s in (sys.stdout, sys.stderr) if isinstance(s, ConsoleStream)]
    if not streams:
        return None
    f = (run_dir / LOG_FILE).open("a", encoding="utf-8", buffering=1)
    for s in streams:
        if s.early:
            f.write("".join(s.early))
        s.early, s.early_chars, s.record = None, 0, f
    return f


def stop_recording(f: TextIO | None) -> None:
    if f is None:
        return
    for s in (sys.stdout, sys.stderr):
        if isinstance(s, ConsoleStream) and s.record is f:
            s.flush()
            s.record = None
    with contextlib.suppress(OSError):
        f.close()
