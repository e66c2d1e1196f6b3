"""The python tool's sandbox: a hang, an infinite print, a fork bomb, a memory bomb and a crash each come back as a
result string, and the parent (this test process) lives on. Timeouts are kept short so the tests stay fast."""

from __future__ import annotations

import os
import sys

import pytest

from monorl.agent.calls import format_tool_call
from monorl.agent.sandbox import SandboxLimits, make_python_tool, run_python
from monorl.agent.tools import ToolSet

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox's limits are Linux resource limits")

# a wall-clock limit far above what the code needs (a busy CI box starts interpreters slowly): only the hang test
# waits for a timeout, with its own short one
LIMITS = SandboxLimits(timeout_s=60, cpu_s=2, memory_mb=512, max_output_bytes=2000)
HANG_LIMITS = SandboxLimits(timeout_s=1.5, cpu_s=2, memory_mb=512, max_output_bytes=2000)


def test_prints_and_runs_in_a_scratch_dir():
    r = run_python("import os, sys\nprint(6 * 7)\nprint(os.getcwd())\nprint(sorted(os.environ))\n"
                   "open('note.txt', 'w').write('hi')", LIMITS)
    lines = r.output.splitlines()
    assert r.returncode == 0 and lines[0] == "42" and "monorl-python-" in lines[1]
    assert not os.path.exists(lines[1])  # the scratch directory is gone
    assert "PATH" in lines[2] and "CUDA_VISIBLE_DEVICES" in lines[2] and "PYTEST_CURRENT_TEST" not in lines[2]
    assert r.text() == r.output


def test_hang_is_killed_at_the_timeout():
    r = run_python("import time\nprint('start', flush=True)\ntime.sleep(600)", HANG_LIMITS)
    assert r.timed_out and r.returncode is None and r.output == "start\n"
    assert "timed out after" in r.text() and "killed" in r.text()


def test_hang_in_a_grandchild_holding_the_pipe_is_killed_too():
    # the program exits at once but leaves a process (allowed here) that keeps the output pipe open
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(600)\nprint('parent done')"
    r = run_python(code, SandboxLimits(timeout_s=10, cpu_s=2, memory_mb=512, allow_subprocesses=True))
    assert "parent done" in r.output and r.timed_out


def test_infinite_print_is_cut():
    r = run_python("while True:\n    print('spam' * 50)", LIMITS)
    assert r.output_truncated and len(r.output.encode()) <= LIMITS.max_output_bytes
    assert r.text().endswith("[output truncated; the program was stopped]")


def test_fork_bomb_is_refused():
    r = run_python("import os\nwhile True:\n    os.fork()", LIMITS)
    assert r.returncode == 1 and "PermissionError" in r.output and "disabled in this sandbox" in r.output
    r = run_python("import subprocess\nsubprocess.run(['echo', 'hi'])", LIMITS)
    assert "PermissionError" in r.output and "subprocess.Popen" in r.output


@pytest.mark.skipif(os.getuid() == 0, reason="Linux does not apply RLIMIT_NPROC to root")
def test_process_limit_applies_when_subprocesses_are_allowed():
    code = ("import os, time\nn = 0\ntry:\n    while n < 200:\n        if os.fork() == 0:\n            time.sleep(5)\n"
            "            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('refused after', n, e)\n")
    r = run_python(code, SandboxLimits(timeout_s=3, cpu_s=3, memory_mb=512, max_processes=8,
                                       allow_subprocesses=True))
    assert "refused after" in r.output


def test_memory_bomb_gets_memory_error():
    r = run_python("blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))", LIMITS)
    assert r.returncode == 1 and "MemoryError" in r.output


@pytest.mark.parametrize("code,expect", [
    ("import os\nos.abort()", "killed by signal SIGABRT"),
    ("import sys\nsys.exit(3)", "[exit code 3]"),
    ("def f():\n    return 1 / 0\nf()", "ZeroDivisionError: division by zero"),
    ("print('unclosed'", "SyntaxError"),
    ("import ctypes\nctypes.string_at(0)", "killed by signal SIGSEGV"),
    ("open('big', 'wb').write(b'0' * (32 << 20))", "File too large"),
])
def test_crashes_are_results(code, expect):
    r = run_python(code, LIMITS)
    assert expect in r.text()
    assert 'File "<string>"' not in r.output  # the traceback starts at the program's own frames


def test_python_tool_through_a_toolset():
    python = make_python_tool(timeout_s=30, cpu_s=1, memory_mb=512)  # the busy loop ends at 1 CPU second
    tools = ToolSet([python])
    assert tools.schemas[0]["function"]["name"] == "python"
    assert tools.schemas[0]["function"]["parameters"]["required"] == ["code"]
    ok, hang = tools.run(format_tool_call("python", {"code": "print(sum(range(10)))"}) +
                         format_tool_call("python", {"code": "while True: pass"}))
    assert ok.ok and ok.content == "45\n"
    assert hang.ok and "CPU time limit" in hang.content  # the program's failure is its result; the tool worked
