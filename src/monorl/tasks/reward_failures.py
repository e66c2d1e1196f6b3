"""A reward function that raises: the run goes on (the completion scores 0.0, `monorl.tasks.base.safe_reward`), and
the user can still debug it. The first failure of each reward function prints its traceback (file and line) to the
console; every failure's traceback goes to the run's console.log (`monorl.console.record_only`), where a reward that
fails now and then leaves its record without flooding the console."""

from __future__ import annotations

import asyncio
import logging
import traceback
import weakref
from pathlib import Path

from monorl.console import record_only

log = logging.getLogger("monorl")
_CALLERS = (str(Path(__file__).parent), str(Path(asyncio.__file__).parent))

# per task, the names of its reward functions whose traceback the console has shown (a task that cannot be a weak
# key, e.g. an eq-dataclass, shares one set)
_shown: weakref.WeakKeyDictionary[object, set[str]] = weakref.WeakKeyDictionary()
_shown_unkeyed: set[str] = set()


def _shown_for(task: object) -> set[str]:
    try:
        return _shown.setdefault(task, set())
    except TypeError:
        return _shown_unkeyed


def report_reward_failure(task: object, name: str, error: BaseException) -> None:
    """Record `error`, raised by reward function `name` of `task`: its traceback (from the frame that called the
    reward on, so it starts in the user's code) to the console the first time, to console.log every time."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename.startswith(_CALLERS):
        tb = tb.tb_next  # the frames that called the reward (monorl's `try`, asyncio's task): not what failed
    text = "".join(traceback.format_exception(type(error), error, tb)).rstrip()
    shown = _shown_for(task)
    if name in shown:
        record_only(f"reward {name!r} raised (scored 0.0):\n{text}\n")
        return
    shown.add(name)
    log.warning("reward %r raised; its completions score 0.0 and the run goes on (this traceback once; every "
                "failure's goes to the run directory's console.log):\n%s", name, text)
