"""The built-in ``python`` tool: code the model writes runs in a child process, never in the trainer's.

What it does:
- a fresh interpreter (``python -I``: no user site-packages, no PYTHON* variables), a small environment of its
  own (no variables of the parent: no tokens, no CUDA_VISIBLE_DEVICES; one BLAS / OpenMP thread), in a new
  session (its own process group), cwd a new temporary scratch directory, removed afterwards;
- limits set in the child before the code runs, soft = hard so the code cannot raise them: CPU seconds
  (RLIMIT_CPU), address space (RLIMIT_AS: a memory bomb gets MemoryError), file size (RLIMIT_FSIZE), no core files,
  processes (RLIMIT_NPROC: the user's current count + `max_processes`; Linux does not apply it to root);
- process creation refused by default (an audit hook on fork / exec / spawn / subprocess / os.system): a fork
  bomb gets PermissionError; `allow_subprocesses=True` lifts it;
- a wall-clock timeout: at the deadline the whole process group is killed (SIGKILL), and so is anything left in
  it after a normal exit;
- stdout and stderr (merged, in order) read with a bounded reader: past `max_output_bytes` the program is stopped
  and the text cut, so an infinite print costs neither memory nor the rest of the timeout.

Every outcome (a hang, a crash, a signal, an infinite print, a fork or memory bomb) is a string for the model; the
parent is never blocked past the timeout and never dies.

What it does NOT isolate: the network (the code can open sockets), the filesystem outside the scratch directory
(it reads and writes whatever the user running the trainer can), other processes of that user (signals), the GPU
(hidden from CUDA by the environment, not by the kernel). A process that calls setsid() leaves the group the
timeout kills; ctypes can call fork() past the audit hook (the hook stops accidents, not an adversary). For
untrusted code, run the trainer (or this tool's child) inside a container, a VM or a seccomp / namespace jail.
"""

from __future__ import annotations

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

# Runs in the child before the code: limits (soft = hard), the audit hook, then the code as __main__, with a
# traceback that starts at the code's own frames.
_BOOTSTRAP = r"""
import resource, sys, traceback
cpu, mem, fsize, nproc, forbid = (int(a) for a in sys.argv[1:6])
def limit(which, value):
    try:
        resource.setrlimit(which, (value, value))
    except (ValueError, OSError):
        pass
limit(resource.RLIMIT_CORE, 0)
if cpu > 0: limit(resource.RLIMIT_CPU, cpu)
if mem > 0: limit(resource.RLIMIT_AS, mem)
if fsize >= 0: limit(resource.RLIMIT_FSIZE, fsize)
if nproc > 0: limit(resource.RLIMIT_NPROC, nproc)
if forbid:
    blocked = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
               "pty.spawn", "os.startfile")
    def hook(event, args):
        if event in blocked:
            raise PermissionError(f"{event}: creating processes is disabled in this sandbox")
    sys.addaudithook(hook)
del limit
with open("main.py", encoding="utf-8") as f:
    source = f.read()
sys.argv = ["main.py"]
namespace = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
try:
    exec(compile(source, "main.py", "exec"), namespace)
except SystemExit:
    raise
except BaseException as e:
    tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
    traceback.print_exception(type(e), e, tb)
    sys.stderr.flush()
    sys.exit(1)
"""


@dataclass
class SandboxLimits:
    """Limits of one run. `timeout_s` is wall-clock; `cpu_s` CPU seconds; `memory_mb` the address space (0: none);
    `file_mb` the largest file the code may write; `max_processes` how many more processes (threads count) the
    user may have while it runs, where RLIMIT_NPROC applies; `max_output_bytes` what is kept of the output."""

    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    file_mb: int = 16
    max_processes: int = 16
    max_output_bytes: int = 8192
    allow_subprocesses: bool = False

    def __post_init__(self) -> None:
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


def _child_env(scratch: str) -> dict[str, str]:
    """The child's whole environment: nothing of the parent's (tokens, CUDA_VISIBLE_DEVICES, PYTHONPATH)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
           "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1", "CUDA_VISIBLE_DEVICES": "",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` in a sandboxed child interpreter (see the module docstring) and return what it printed."""
    lim = limits or SandboxLimits()
    start = time.monotonic()
    scratch = tempfile.mkdtemp(prefix="monorl-python-")
    try:
        with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        nproc = 0 if os.getuid() == 0 else _user_tasks() + lim.max_processes  # root ignores RLIMIT_NPROC
        argv = [sys.executable, "-I", "-c", _BOOTSTRAP, str(lim.cpu_s), str(lim.memory_mb << 20),
                str(lim.file_mb << 20), str(nproc), str(int(not lim.allow_subprocesses))]
        proc = subprocess.Popen(argv, cwd=scratch, env=_child_env(scratch), stdin=subprocess.DEVNULL,
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
                     max_processes: int = 16, max_output_bytes: int = 8192,
                     allow_subprocesses: bool = False) -> Callable[[str], str]:
    """The ``python`` tool with these limits (`cpu_s` defaults to the timeout, rounded up)."""
    limits = SandboxLimits(timeout_s=timeout_s, cpu_s=cpu_s if cpu_s is not None else max(1, int(timeout_s + 0.999)),
                           memory_mb=memory_mb, file_mb=file_mb, max_processes=max_processes,
                           max_output_bytes=max_output_bytes, allow_subprocesses=allow_subprocesses)

    def python(code: str) -> str:
        """Run Python code in a fresh interpreter and return what it prints (stdout and stderr).

        Args:
            code: The Python program to run. Print the values you need to see.
        """
        return run_python(code, limits).text()

    python.tool_timeout = limits.timeout_s + 5.0  # type: ignore[attr-defined]  # the child has its own deadline
    python.limits = limits  # type: ignore[attr-defined]
    return python
