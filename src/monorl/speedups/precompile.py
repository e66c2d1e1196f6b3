"""Compile the Triton kernels a run will launch ahead of its warm-ups, in parallel threads.

Why: Triton compiles a kernel specialisation when it is first launched, one at a time. A cold run of the reference
preset compiled 21 that way: 6.1 s in `triton.compile` and 4.2 s building a C launcher per signature with the host
compiler (benchmarks/RESULTS.md, 2026-11-24), all serial in the warm-ups. Both mostly run outside the GIL (the
MLIR/LLVM passes, ptxas and gcc as subprocesses), so threads overlap them.

How the specialisations are found: `recording()` runs the code that will launch them (the warm-ups' forward,
backward and decode steps, with the warm-ups' shapes) with every `@triton.jit` launch recorded and skipped, through
Triton's `jit_cache_hook`: nothing is compiled or launched, so those kernels' outputs stay as allocated (garbage).
Such a pass must not feed a kernel's output to anything that indexes memory by it (token ids into an embedding)
and must not capture CUDA graphs; its results are dropped. `compile_ahead` then compiles and loads each recorded
specialisation (Triton's `JITFunction.preload`, its own format for a specialisation) in a thread pool, into the
kernel caches the real launches look in. Kernels Inductor generates do not pass through `JITFunction.run` and are
not affected. A specialisation the pass missed is compiled at its first launch, as without this.

A run keeps the list it traced (`save_specs`, beside Triton's cache, keyed by everything that decides which
specialisations a run launches: `compile_auto.run_kernels_key`), and a later run with the same key loads it instead of
tracing again (`load_specs`): on a warm Triton cache the pass is then only the parallel load of cached kernels.
A list that cannot be read or resolved is skipped with a line saying why, and the run traces.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from monorl.fsutil import write_text_atomic
from monorl.speedups.private_apis import HAS_TRITON

MAX_THREADS = 16
COMPILE_THREADS = "triton-compile"  # the pool's thread names start with this
SPECS_DIR = "monorl_kernel_specs"  # under Triton's cache directory: the lists `save_specs` keeps


@dataclass
class Recorded:
    """Kernel specialisations seen by `recording()`: (JITFunction, Triton's serialised specialisation), unique."""

    specs: list[tuple[Any, str]] = field(default_factory=list)
    placeholders: list[tuple[dict, str]] = field(default_factory=list)  # (a JITFunction's kernel cache, key)


class _NoLaunch:
    """Stands in a JITFunction's kernel cache for a recorded specialisation while recording, so its later launches
    find a "compiled" kernel whose launch does nothing: the hook (which serialises the specialisation, ~0.3 ms)
    runs once per specialisation instead of at every launch."""

    function = packed_metadata = None

    def launch_metadata(self, *args: Any) -> None:
        return None

    def run(self, *args: Any) -> None:
        return None


def monorl_kernels() -> list[Any]:
    """The `@triton.jit` kernels of monorl's modules imported so far."""
    from triton.runtime.jit import JITFunction

    found = {id(obj): obj for name, mod in list(sys.modules.items()) if name.startswith("monorl.")
             for obj in list(vars(mod).values()) if isinstance(obj, JITFunction)}  # one each, re-exported or not
    return list(found.values())


@contextlib.contextmanager
def recording() -> Iterator[Recorded]:
    """Inside: every monorl kernel launch (and any other `@triton.jit` launch not compiled yet) is recorded and
    skipped, neither compiled nor launched. monorl's kernels compiled before (by earlier work in this process) are
    set aside meanwhile and put back after: launched for real, one would read the garbage a skipped kernel left,
    e.g. a token id, as an address (an illegal memory access, seen in the GPU tests)."""
    rec = Recorded()
    if not HAS_TRITON:
        yield rec
        return
    from triton import knobs

    held = []
    for fn in monorl_kernels():
        for kernel_cache, *_ in fn.device_caches.values():
            held.append((kernel_cache, dict(kernel_cache)))
            kernel_cache.clear()

    def hook(*, key, fn, compile, **_) -> bool:
        kernel_cache = fn.jit_function.device_caches[compile["device"]][0]
        kernel_cache[key] = _NoLaunch()
        rec.placeholders.append((kernel_cache, key))
        rec.specs.append((fn.jit_function, compile["specialization_data"]))
        return True  # skip this launch: JITFunction.run returns before compiling and launching

    before = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        yield rec
    finally:
        knobs.runtime.jit_cache_hook = before
        for kernel_cache, key in rec.placeholders:  # never left behind: a real launch would do nothing
            if isinstance(kernel_cache.get(key), _NoLaunch):
                del kernel_cache[key]
        for kernel_cache, kernels in held:
            kernel_cache.update(kernels)


def default_threads() -> int:
    """One compile thread per CPU core this process may use, shared among the node's ranks (torchrun's
    LOCAL_WORLD_SIZE), at most MAX_THREADS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_THREADS, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))


class TritonKeyPrefetch:
    """Triton's own cache key, `triton.runtime.cache.triton_key()`, computed in a child process while this one
    reads the tokenizer and builds the models. That key is a SHA-256 of Triton's 415 MB libtriton and its
    sources, computed once a process at the first kernel lookup; in `compile_ahead`'s threads every thread
    computed it at once (it is an unlocked lru_cache: 16 times, ~1 s of a warm run's 1.0 s load, H100,
    2026-11-25). `adopt()` hands the child's value to Triton's lookups; a child that failed, or saw another
    Triton, is ignored and the key is computed here, once, before the threads start."""

    CODE = ("import triton; from triton.runtime.cache import triton_key; "
            "print(triton.__file__); print(triton_key(), end='')")

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        if HAS_TRITON:
            with contextlib.suppress(OSError):
                self.proc = subprocess.Popen([sys.executable, "-c", self.CODE], stdout=subprocess.PIPE,
                                             stderr=subprocess.DEVNULL, text=True)

    def adopt(self, timeout_s: float = 10.0) -> bool:
        """Wait for the child (~0.5 s of work; one that hangs is killed after timeout_s) and install its key;
        whether it was installed."""
        import triton
        from triton.runtime import cache

        proc, self.proc = self.proc, None
        if proc is None:
            return False
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return False
        where, _, key = out.partition("\n")
        original = getattr(cache, "triton_key", None)
        if (proc.returncode != 0 or where != triton.__file__ or not key.startswith(triton.__version__)
                or not hasattr(original, "cache_info") or original.cache_info().currsize > 0):
            return False
        cache.triton_key = functools.lru_cache(maxsize=None)(functools.wraps(original)(lambda: key))
        return True


def compile_ahead(rec: Recorded, device: torch.device, threads: int, key: TritonKeyPrefetch | None = None) -> float:
    """Compile, build the launcher of and load every recorded specialisation on `device`, `threads` at a time;
    returns the seconds it took. Errors surface here as they would at the kernel's first launch. `key`: Triton's
    cache key being computed in a child process (`TritonKeyPrefetch`)."""
    if not rec.specs:
        return 0.0
    t = time.perf_counter()
    if key is None or not key.adopt():
        from triton.runtime.cache import triton_key

        triton_key()  # once, here: each pool thread would compute it again (an unlocked lru_cache)
    for fn, _ in rec.specs:  # the per-device caches, created here: two threads creating one would lose a kernel
        fn.device_caches[device.index if device.index is not None else torch.cuda.current_device()]

    def load(spec: tuple[Any, str]) -> None:
        fn, data = spec
        with torch.cuda.device(device):  # Triton reads the thread's current device
            kernel = fn.preload(data)
            kernel._init_handles()  # the launcher (a host-compiler build per signature) and the module load

    with ThreadPoolExecutor(max(1, min(threads, len(rec.specs))), thread_name_prefix=COMPILE_THREADS) as pool:
        for f in [pool.submit(load, s) for s in rec.specs]:
            f.result()
    return time.perf_counter() - t


def specs_path(key: str) -> Path:
    """Where the list of a run with this key is kept: beside the Triton cache it describes."""
    from triton import knobs

    return Path(knobs.cache.dir) / SPECS_DIR / f"{key}.json"


def save_specs(path: Path, rec: Recorded) -> None:
    """Keep `rec`'s specialisations as (module, kernel name, Triton's serialised specialisation), written whole or
    not at all (a temporary file renamed: ranks of one node may write the same list at once). A directory that
    cannot be written costs the next run its trace, nothing more: a line says so and the run goes on."""
    entries = [{"module": fn.module, "name": fn.__name__, "spec": data} for fn, data in rec.specs]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(entries) + "\n")
    except OSError as err:
        print(f"triton: could not keep the kernel list at {path} ({type(err).__name__}: {err}); the next run "
              "traces again", flush=True)


def load_specs(path: Path) -> Recorded | None:
    """The list `save_specs` kept at `path`, its kernels resolved to this process' JITFunctions; None if there is
    none, or (with a line saying why) if it cannot be read or names a kernel that is not there."""
    if not path.is_file():
        return None
    rec = Recorded()
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
        from triton.runtime.jit import JITFunction

        for e in entries:
            fn = getattr(importlib.import_module(e["module"]), e["name"], None)
            if not isinstance(fn, JITFunction) or not isinstance(e["spec"], str):
                raise ValueError(f"{e['module']}.{e['name']} is not a Triton kernel")
            rec.specs.append((fn, e["spec"]))
    except (OSError, ValueError, TypeError, KeyError, ImportError) as err:
        print(f"triton: skipping the kernel list {path} ({type(err).__name__}: {err}); tracing instead", flush=True)
        return None
    return rec
