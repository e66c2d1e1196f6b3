"""The built-in ``python`` tool: code the model writes runs in a child process, never in the trainer's.

What it does:
- a fresh interpreter (``python -I -u``: no user site-packages, no PYTHON* variables, unbuffered), a small
  environment of its own (no variables of the parent: no tokens, no CUDA_VISIBLE_DEVICES; one BLAS / OpenMP
  thread), in a new session (its own process group), cwd a new temporary work directory, removed afterwards;
- isolation (`isolation`, "auto" by default), where Linux allows it without root (unprivileged user namespaces;
  no extra package): new user, mount, network, IPC and PID namespaces and a root of its own -- the system's
  binaries and libraries and the interpreter read-only, the work directory the only writable path, no /etc/passwd,
  no home directory, no network (a loopback that is down), none of the host's processes (it can signal none), no
  GPU device; `sandbox_child.py` says how. Whether it works is probed once per process (`isolation_problem`);
  where it does not, "auto" logs one line saying the tool runs without it and why, and "required" refuses to
  start (`SandboxUnavailable`); "off" never isolates;
- limits set in the child before the code runs, soft = hard so the code cannot raise them: CPU seconds
  (RLIMIT_CPU), address space (RLIMIT_AS: a memory bomb gets MemoryError), file size (RLIMIT_FSIZE), no core files,
  processes (RLIMIT_NPROC: `max_processes` more than the user has (isolated: than the sandbox's own three);
  Linux does not apply it to root);
- process creation refused by default (an audit hook on fork / exec / spawn / subprocess / os.system): a fork
  bomb gets PermissionError; `allow_subprocesses=True` lifts it;
- a wall-clock timeout: at the deadline the whole process group is killed (SIGKILL), and so is anything left in
  it after a normal exit (isolated: anything left in its PID namespace, even outside the group);
- stdout and stderr (merged, in order) read with a bounded reader: past `max_output_bytes` the program is stopped
  and the text cut, so an infinite print costs neither memory nor the rest of the timeout.

Every outcome (a hang, a crash, a signal, an infinite print, a fork or memory bomb) is a string for the model; the
parent is never blocked past the timeout and never dies. The tool counts a run that did not end with exit code 0
(timed out, killed, cut, crashed, an uncaught exception) as a failed call (`ToolFailed`: `ToolResult.ok` False).

Without isolation the code reads and writes whatever the user running the trainer can, opens sockets and signals
that user's processes; a process that calls setsid() leaves the group the timeout kills; ctypes can call fork()
past the audit hook (the hook stops accidents, not an adversary). Isolated or not, the kernel is shared: for code
from an adversary, run the trainer inside a VM.
"""

from __future__ import annotations

import functools
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from monorl.agent.tools import ToolFailed

log = logging.getLogger("monorl")
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")  # the program the child runs
ISOLATION = ("auto", "required", "off")
SANDBOX_PROCESSES = 3  # isolated: the child, its PID namespace's PID 1 and the code (RLIMIT_NPROC counts them)


class SandboxUnavailable(RuntimeError):
    """isolation="required" where this machine cannot isolate the tool's child."""


@dataclass
class SandboxLimits:
    """Limits of one run. `timeout_s` is wall-clock; `cpu_s` CPU seconds; `memory_mb` the address space (0: none);
    `file_mb` the largest file the code may write; `max_processes` how many more processes (threads count) the
    user may have while it runs, where RLIMIT_NPROC applies; `max_output_bytes` what is kept of the output;
    `isolation` "auto" (namespaces where available, else a one-line notice), "required" or "off"."""

    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    file_mb: int = 16
    max_processes: int = 16
    max_output_bytes: int = 8192
    allow_subprocesses: bool = False
    isolation: str = "auto"

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATION:
            raise ValueError(f"sandbox isolation must be one of {', '.join(ISOLATION)}, got {self.isolation!r}")
        if self.timeout_s <= 0 or self.cpu_s < 1 or self.memory_mb < 0 or self.file_mb < 0:
            raise ValueError(f"sandbox limits must be positive: {self}")
        if self.max_output_bytes < 1 or self.max_processes < 1:
            raise ValueError(f"sandbox max_output_bytes and max_processes must be >= 1: {self}")


@dataclass
class SandboxResult:
    output: str  # stdout and stderr, merged, cut at max_output_bytes
    returncode: int | None  # None: killed at the timeout or for too much output
    timed_out: bool = False
    output_truncated: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """The program ran to its end and exited with code 0 (not timed out, killed, cut, crashed or failed)."""
        return self.returncode == 0 and not self.timed_out and not self.output_truncated

    def text(self) -> str:
        """What the model reads: the output, then a bracketed note when the run did not end normally."""
        notes = []
        if self.output_truncated:
            notes.append("output truncated; the program was stopped")
        if self.timed_out:
            notes.append(f"timed out after {self.seconds:.1f} s; the program was killed")
        elif self.returncode is not None and self.returncode < 0:
            sig = -self.returncode
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
            # RLIMIT_CPU sends SIGXCPU at the soft limit and SIGKILL at the hard one
            why = " (the CPU time limit, most likely)" if sig in (signal.SIGXCPU, signal.SIGKILL) else ""
            notes.append(f"killed by signal {name}{why}")
        elif self.returncode:
            notes.append(f"exit code {self.returncode}")
        out = self.output
        if notes:
            sep = "" if not out or out.endswith("\n") else "\n"
            out = f"{out}{sep}[{'; '.join(notes)}]"
        return out if out else "[no output]"


def _user_tasks() -> int:
    """How many processes + threads this user runs now (what RLIMIT_NPROC counts)."""
    uid, total = os.getuid(), 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("Threads:")), 1)
        except (OSError, ValueError):
            continue
    return total


def _child_env(work: str) -> dict[str, str]:
    """The child's whole environment: nothing of the parent's (tokens, CUDA_VISIBLE_DEVICES, PYTHONPATH)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1", "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@functools.cache
def isolation_problem() -> str | None:
    """Why this machine cannot isolate the child (None: it can); probed once per process by running a program
    isolated and checking it ran."""
    if sys.platform != "linux":
        return f"namespaces are Linux's, this is {sys.platform}"
    probe = _run("print('isolated')", SandboxLimits(timeout_s=60, cpu_s=10, memory_mb=0, isolation="required"),
                 isolate=True)
    if probe.ok and probe.output == "isolated\n":
        return None
    lines = probe.output.strip().splitlines()
    return lines[-1] if lines else probe.text()


@functools.cache
def _notice_unisolated(problem: str) -> None:  # cached: one line per process
    log.warning(f"python tool: runs WITHOUT isolation ({problem}): the model's code can read and write the "
                "user's files and use the network; isolation='required' refuses to start instead")


def should_isolate(isolation: str) -> bool:
    """Whether runs with this `isolation` setting are isolated here; SandboxUnavailable for "required" where
    isolation does not work."""
    if isolation == "off":
        return False
    problem = isolation_problem()
    if problem is None:
        return True
    if isolation == "required":
        raise SandboxUnavailable(f"python tool: isolation='required' but this machine cannot isolate it "
                                 f"({problem}); enable unprivileged user namespaces or set isolation='auto'")
    _notice_unisolated(problem)
    return False


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` in a sandboxed child interpreter (see the module docstring) and return what it printed."""
    lim = limits or SandboxLimits()
    return _run(code, lim, isolate=should_isolate(lim.isolation))


def _run(code: str, lim: SandboxLimits, isolate: bool) -> SandboxResult:
    start = time.monotonic()
    scratch = tempfile.mkdtemp(prefix="monorl-python-")
    work = os.path.join(scratch, "work")  # the code's cwd; the isolated child mounts its root on scratch/root
    try:
        os.mkdir(work)
        os.mkdir(os.path.join(scratch, "root"))
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        if os.getuid() == 0:  # root ignores RLIMIT_NPROC
            nproc = 0
        else:  # a new user namespace counts only its own processes
            nproc = lim.max_processes + (SANDBOX_PROCESSES if isolate else _user_tasks())
        argv = [sys.executable, "-I", "-u", CHILD, str(lim.cpu_s), str(lim.memory_mb << 20), str(lim.file_mb << 20),
                str(nproc), str(int(not lim.allow_subprocesses)), str(int(isolate))]
        proc = subprocess.Popen(argv, cwd=work, env=_child_env(work), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            output, truncated, timed_out = _read_bounded(proc, lim, start)
        finally:
            _kill_group(proc)
        code_ = proc.wait()
        returncode = None if (timed_out or truncated) else code_
        text = output.decode("utf-8", errors="replace")
        return SandboxResult(text, returncode, timed_out=timed_out, output_truncated=truncated,
                             seconds=time.monotonic() - start)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _read_bounded(proc: subprocess.Popen, lim: SandboxLimits, start: float) -> tuple[bytes, bool, bool]:
    """(output, truncated, timed out): read the child's pipe until it closes, the deadline, or the byte cap."""
    assert proc.stdout is not None
    chunks, size = [], 0
    deadline = start + lim.timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return b"".join(chunks), False, True
            if not sel.select(timeout=left):
                continue
            data = os.read(proc.stdout.fileno(), 65536)
            if not data:  # EOF: the program (and any child holding the pipe) is done writing
                break
            chunks.append(data)
            size += len(data)
            if size > lim.max_output_bytes:
                return b"".join(chunks)[: lim.max_output_bytes], True, False
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
    except subprocess.TimeoutExpired:  # closed its output, still running
        return b"".join(chunks), False, True
    return b"".join(chunks), False, False


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session leader's pid is the group's id
    except (ProcessLookupError, PermissionError):
        pass
    if proc.stdout is not None:
        proc.stdout.close()


def make_python_tool(timeout_s: float = 10.0, cpu_s: int | None = None, memory_mb: int = 1024, file_mb: int = 16,
                     max_processes: int = 16, max_output_bytes: int = 8192, allow_subprocesses: bool = False,
                     isolation: str = "auto") -> Callable[[str], str]:
    """The ``python`` tool with these limits (`cpu_s` defaults to the timeout, rounded up). Whether it is isolated
    is settled here, at start-up: "required" raises SandboxUnavailable where it cannot be."""
    limits = SandboxLimits(timeout_s=timeout_s, cpu_s=cpu_s if cpu_s is not None else max(1, int(timeout_s + 0.999)),
                           memory_mb=memory_mb, file_mb=file_mb, max_processes=max_processes,
                           max_output_bytes=max_output_bytes, allow_subprocesses=allow_subprocesses,
                           isolation=isolation)
    should_isolate(isolation)

    def python(code: str) -> str:
        """Run Python code in a fresh interpreter and return what it prints (stdout and stderr).

        Args:
            code: The Python program to run. Print the values you need to see.
        """
        result = run_python(code, limits)
        if not result.ok:  # the model still reads the output and the note; the call counts as failed
            raise ToolFailed(result.text())
        return result.text()

    python.tool_timeout = limits.timeout_s + 5.0  # type: ignore[attr-defined]  # the child has its own deadline
    python.limits = limits  # type: ignore[attr-defined]
    return python
