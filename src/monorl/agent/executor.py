"""Where tool and environment work runs, so that many episodes proceed while the engine decodes.

- `call_with_timeout(fn, *args, timeout=...)`: one call with a deadline. A plain function runs in a daemon
  thread of its own; past the deadline the caller gets `TimeoutError` and the thread is abandoned (Python cannot
  stop a thread: a hung function keeps its thread until it returns; `abandoned_calls()` counts them). A coroutine
  function runs on the shared event-loop thread under `asyncio.wait_for`, so a hung one is cancelled. This is for
  trusted code: hard isolation (a process that is killed) is the `python` tool's sandbox (`agent/sandbox.py`).
- `AgentExecutor`: a thread pool the episode runner submits a turn's work to (`submit`), then polls the returned
  futures between decode steps (`Future.done()`), or waits on several (`wait_any`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import inspect
import threading
from collections.abc import Callable, Iterable
from typing import Any

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()
_abandoned = 0
_abandoned_lock = threading.Lock()


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's background event loop (started on first use, a daemon thread) that async tools and
    environments run on."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="monorl-agent-loop", daemon=True).start()
            _loop = loop
        return _loop


def abandoned_calls() -> int:
    """How many timed-out plain-function calls were left running in their threads (since the process began)."""
    return _abandoned


def is_async_callable(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def call_with_timeout(fn: Callable[..., Any], *args: Any, timeout: float | None, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, or TimeoutError after `timeout` seconds (None: no limit). Exceptions of `fn`
    propagate. An awaitable result (an ``async def``) is awaited on the shared loop under the same deadline."""
    global _abandoned
    if is_async_callable(fn):
        return _await(fn(*args, **kwargs), timeout)
    done = threading.Event()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 -- handed to the caller, which decides
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=target, name=f"monorl-call-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    if not done.wait(timeout):
        with _abandoned_lock:
            _abandoned += 1
        raise TimeoutError(f"no result after {timeout:g} s")
    if "error" in box:
        raise box["error"]
    value = box["value"]
    if inspect.isawaitable(value):  # a sync wrapper that returned a coroutine
        return _await(value, timeout)
    return value


def _await(awaitable: Any, timeout: float | None) -> Any:
    async def run() -> Any:
        return await asyncio.wait_for(awaitable, timeout)

    loop = event_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:  # blocking here would wait on the loop this very call is holding up
        if inspect.iscoroutine(awaitable):
            awaitable.close()
        raise RuntimeError("an async tool or environment was called synchronously from inside the agent's event "
                           "loop (an async environment calling it without await); await it instead")
    future = asyncio.run_coroutine_threadsafe(run(), loop)
    try:
        return future.result()
    except TimeoutError:
        raise TimeoutError(f"no result after {timeout:g} s") from None


class AgentExecutor:
    """A thread pool for episodes' turns. `submit(fn, ...)` returns a `concurrent.futures.Future`; the runner
    polls `future.done()` between decode steps. The episode interface (`EpisodeEnv.start` / `respond`) never
    raises, so these futures hold results, not exceptions. One executor serves a run; `close()` (or a ``with``
    block) stops taking work."""

    def __init__(self, max_workers: int = 32) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._pool = cf.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="monorl-agent")

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> cf.Future:
        return self._pool.submit(fn, *args, **kwargs)

    @staticmethod
    def wait_any(futures: Iterable[cf.Future], timeout: float | None = None) -> set[cf.Future]:
        """The futures of `futures` that are done, waiting up to `timeout` seconds for the first."""
        done, _ = cf.wait(list(futures), timeout=timeout, return_when=cf.FIRST_COMPLETED)
        return done

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)

    def __enter__(self) -> AgentExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
