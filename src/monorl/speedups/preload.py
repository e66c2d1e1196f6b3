"""Pay CUDA's lazy loading of the ATen kernels a run will launch in a background thread, while the run builds.

Why: CUDA loads a kernel's module at the kernel's first launch (lazy loading, the default; eager loading of all of
torch's kernels costs ~1.2 s of CUDA init instead). On the GPU machines each first launch of an ATen kernel took
5-70 ms (a warm run's trainer warm-up: ~0.9 s against ~0.17 s for its next eager pass; H100, torch 2.11+cu130,
benchmarks/RESULTS.md, 2026-11-25 (night, later)). The load runs in the driver with the GIL released, so a thread
that launches each kernel once on tiny tensors pays it while the main thread runs Python (the trainer's
construction with torch._dynamo's import, the Triton kernel load): 8 first launches and 0.3 s of Python took
0.35-0.37 s in a thread against 0.46-0.55 s in turn (`benchmarks/probe_startup_costs.py --overlap`).

Which kernels: `AtenRecorder`, a dispatch mode, records the ATen ops (the first call of each, with its arguments'
dtypes and ranks) of the trainer's first pass that `monorl.speedups.precompile` traces; the list is kept beside Triton's
kernel list and a later run replays it (`start_preload`) on tensors of one element: the kernel a tiny call launches
is not always the one the real shapes pick, but it lives in the same module (one per ATen source file), which is
what costs. A list that is missing, stale or partly unreplayable costs nothing but the loads it did not do: every
failure is counted and skipped. Recording costs a cold run ~0.4 s (the dispatch mode's Python on every op).

Safe to run beside the main thread: replays use their own stream and tensors, never a seeded random op (they would
move the run's RNG), and no op with CPU tensors only. `Preload.join()` must come before any CUDA graph capture (a
capture forbids other threads' allocations) and before peak-memory measurements.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from monorl.fsutil import write_text_atomic

log = logging.getLogger(__name__)

_MAX_INT = 64  # larger integer arguments are sizes, replayed as 1 to match the one-element tensors
_SKIP = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::_assert_async",
         "aten::record_stream"}  # host syncs, stream bookkeeping
_ENUMS: dict[str, Any] = {**{f"dtype.{str(d).removeprefix('torch.')}": d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}, **{f"format.{m}": getattr(torch, m) for m in (
        "contiguous_format", "preserve_format", "channels_last")}, "layout.strided": torch.strided}
_NAMES = {v: k for k, v in _ENUMS.items()}


def _encode(leaf: Any) -> Any:
    """A JSON-able stand-in for one argument leaf; raises ValueError for what cannot be replayed."""
    if isinstance(leaf, torch.Tensor):
        if leaf.dtype not in _NAMES:
            raise ValueError(f"tensor dtype {leaf.dtype}")
        return {"t": _NAMES[leaf.dtype], "dim": leaf.dim(), "cuda": leaf.is_cuda}
    if isinstance(leaf, torch.device):
        return {"device": leaf.type}
    if isinstance(leaf, (torch.dtype, torch.memory_format, torch.layout)):
        if leaf not in _NAMES:
            raise ValueError(f"argument {leaf}")
        return {"enum": _NAMES[leaf]}
    if isinstance(leaf, bool) or leaf is None or isinstance(leaf, (float, str)):
        return leaf
    if isinstance(leaf, int):
        return leaf if leaf <= _MAX_INT else 1
    raise ValueError(f"argument of type {type(leaf).__name__}")


def _decode(leaf: Any, device: torch.device) -> Any:
    if isinstance(leaf, dict):
        if "t" in leaf:
            return torch.zeros((1,) * leaf["dim"], dtype=_ENUMS[leaf["t"]], device=device if leaf["cuda"] else "cpu")
        if "device" in leaf:
            return device if leaf["device"] == device.type else torch.device(leaf["device"])
        return _ENUMS[leaf["enum"]]
    return leaf


class AtenRecorder(TorchDispatchMode):
    """Inside: the first call of each ATen op on a CUDA tensor (here or in autograd's threads) is recorded in `ops`,
    as a JSON-able `{"op", "spec", "leaves"}` entry; later calls cost a set lookup. `cuda_only=False` records ops on
    CPU tensors too (the CPU tests)."""

    def __init__(self, cuda_only: bool = True) -> None:
        super().__init__()
        self.cuda_only = cuda_only
        self.ops: list[dict[str, Any]] = []
        self._done: set[Any] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        if func not in self._done:  # one entry an op: its module is what a launch loads, whatever the dtypes
            name = func._schema.name
            if (not name.startswith("aten::") or name in _SKIP or func.is_view  # a view launches nothing
                    or torch.Tag.nondeterministic_seeded in func.tags):
                self._done.add(func)
            elif self._record(f"{name}.{func._overloadname}", args, kwargs):
                self._done.add(func)
        return func(*args, **kwargs)

    def _record(self, op: str, args: tuple, kwargs: dict) -> bool:
        """Record this call; False when it has no tensor the recorder wants (another call of the op may)."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        try:
            encoded = [_encode(x) for x in leaves]
        except ValueError:
            return True  # never replayable
        tensors = [x for x in encoded if isinstance(x, dict) and "t" in x]
        if not tensors or (self.cuda_only and not any(x["cuda"] for x in tensors)):
            return False
        self.ops.append({"op": op, "spec": pytree.treespec_dumps(spec), "leaves": encoded})
        return True


def _resolve(op: str) -> Any:
    namespace, _, rest = op.partition("::")
    name, _, overload = rest.rpartition(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def replay(ops: list[dict[str, Any]], device: torch.device) -> tuple[int, int]:
    """Run each recorded op once on one-element tensors (no autograd); returns (ran, failed)."""
    ran = failed = 0
    with torch.inference_mode():
        for entry in ops:
            try:
                fn = _resolve(entry["op"])
                leaves = [_decode(x, device) for x in entry["leaves"]]
                args, kwargs = pytree.tree_unflatten(leaves, pytree.treespec_loads(entry["spec"]))
                fn(*args, **kwargs)
                ran += 1
            except Exception as err:  # a stale or shape-bound entry: only its module load is lost
                failed += 1
                log.debug("ATen preload: %s failed (%s: %s)", entry.get("op"), type(err).__name__, err)
    return ran, failed


def save_ops(path: Path, ops: list[dict[str, Any]]) -> None:
    """Keep the list (`write_text_atomic`); a directory that cannot be written costs only the next preload."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(ops) + "\n")
    except OSError as err:
        log.warning("could not keep the ATen kernel list at %s (%s: %s)", path, type(err).__name__, err)


def load_ops(path: Path) -> list[dict[str, Any]] | None:
    """The list at `path`, or None if there is none or it cannot be read (a debug line says why)."""
    try:
        ops = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        log.debug("no ATen kernel list at %s (%s)", path, err)
        return None
    return ops if isinstance(ops, list) else None


class Preload:
    """`replay` in a daemon thread on its own CUDA stream; `join()` waits for it."""

    def __init__(self, ops: list[dict[str, Any]], device: torch.device) -> None:
        self.ops, self.device = ops, device
        self.ran = self.failed = 0
        self.run_s = self.wait_s = 0.0
        self._thread = threading.Thread(target=self._run, name="monorl-aten-preload", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t = time.perf_counter()
        try:
            stream = torch.cuda.Stream(self.device)
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                self.ran, self.failed = replay(self.ops, self.device)
            stream.synchronize()
        except Exception as err:  # only a lost head start: the run launches these kernels itself
            log.warning("ATen preload stopped (%s: %s)", type(err).__name__, err)
        self.run_s = time.perf_counter() - t

    def join(self) -> None:
        """Wait for the thread. Idempotent."""
        t = time.perf_counter()
        self._thread.join()
        self.wait_s += time.perf_counter() - t


def start_preload(path: Path, device: torch.device) -> Preload | None:
    """Replay the list kept at `path` in a thread (CUDA only); None when there is none."""
    if device.type != "cuda":
        return None
    ops = load_ops(path)
    return Preload(ops, device) if ops else None
