"""The python tool's sandbox: a hang, an infinite print, a fork bomb, a memory bomb and a crash each come back as a
result string (a failed call), and the parent (this test process) lives on; where Linux namespaces are available,
the code cannot read the host's files, write outside its work directory, reach the network or signal this process.
Timeouts are kept short so the tests stay fast."""

from __future__ import annotations

import logging
import os
import socket
import sys

import pytest

from monorl.agent import sandbox
from monorl.agent.calls import format_tool_call
from monorl.agent.metrics import EpisodeRecord, episode_metrics
from monorl.agent.sandbox import SandboxLimits, SandboxUnavailable, make_python_tool, run_python
from monorl.agent.tools import ToolSet

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox's limits are Linux resource limits")
PROBLEM = sandbox.isolation_problem() if sys.platform == "linux" else "not Linux"
isolated = pytest.mark.skipif(PROBLEM is not None, reason=f"this machine cannot isolate the sandbox: {PROBLEM}")

# a wall-clock limit far above what the code needs (a busy CI box starts interpreters slowly): only the hang test
# waits for a timeout, with its own short one
LIMITS = SandboxLimits(timeout_s=60, cpu_s=2, memory_mb=512, max_output_bytes=2000)
HANG_LIMITS = SandboxLimits(timeout_s=1.5, cpu_s=2, memory_mb=512, max_output_bytes=2000)


@pytest.mark.parametrize("isolation", ["auto", "off"])
def test_prints_and_runs_in_a_scratch_dir(isolation):
    r = run_python("import os, sys\nprint(6 * 7)\nprint(os.getcwd())\nprint(sorted(os.environ))\n"
                   "open('note.txt', 'w').write('hi')", SandboxLimits(**{**vars(LIMITS), "isolation": isolation}))
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
    # the program exits at once but leaves a process (allowed here) that keeps the output pipe open: without
    # isolation it is killed with the process group at the timeout
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(600)\nprint('parent done')"
    r = run_python(code, SandboxLimits(timeout_s=3, cpu_s=2, memory_mb=512, allow_subprocesses=True, isolation="off"))
    assert "parent done" in r.output and r.timed_out


@isolated
def test_isolated_leftovers_die_with_the_program():
    # isolated, whatever the program leaves (even in a session of its own) dies with its PID namespace at its end
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\nprint('parent done')"
    r = run_python(code, SandboxLimits(timeout_s=60, cpu_s=2, memory_mb=512, allow_subprocesses=True))
    assert r.output == "parent done\n" and r.ok and not r.timed_out


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
    ok, hang, crash = tools.run(format_tool_call("python", {"code": "print(sum(range(10)))"}) +
                                format_tool_call("python", {"code": "while True: pass"}) +
                                format_tool_call("python", {"code": "print('before')\n1 / 0"}))
    assert ok.ok and ok.content == "45\n"
    # the program's failure is its result, as the model reads it, and a failed call in the metrics
    assert not hang.ok and "CPU time limit" in hang.content and not hang.content.startswith("Error")
    assert not crash.ok and crash.content.startswith("before\n") and "ZeroDivisionError" in crash.content
    record = EpisodeRecord()
    record.add_tool_results([ok, hang, crash])
    assert episode_metrics([record])["tools/failure_frequency"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("code", ["import time\ntime.sleep(600)", "import os\nos.abort()", "import sys\nsys.exit(2)",
                                  "print('x' * 5000)"])
def test_python_tool_call_that_did_not_end_well_failed(code):
    # timed out, killed by a signal, a non-zero exit, output cut: each a failed call with the program's text
    python = make_python_tool(timeout_s=1.5, cpu_s=2, memory_mb=512, max_output_bytes=2000)
    (result,) = ToolSet([python]).run(format_tool_call("python", {"code": code}))
    assert not result.ok and result.content.endswith("]")


# ---- isolation ----------------------------------------------------------------------------------------------

def _isolated(code: str) -> str:
    r = run_python(code, SandboxLimits(timeout_s=60, cpu_s=5, memory_mb=512, isolation="required"))
    assert r.ok, r.text()
    return r.output


@isolated
def test_isolated_code_cannot_read_the_hosts_files(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the secret")
    out = _isolated("import os\n"
                    f"for path in ['/etc/passwd', {str(secret)!r}, os.path.expanduser('~root')]:\n"
                    "    try:\n        print(open(path).read()[:20])\n"
                    "    except OSError as e:\n        print('refused', type(e).__name__)\n")
    assert out.splitlines() == ["refused FileNotFoundError"] * 3


@isolated
def test_isolated_code_cannot_write_outside_its_work_dir(tmp_path):
    name = f"monorl-escaped-{os.getpid()}.txt"
    host_paths = [str(tmp_path / name), os.path.join("/tmp", name), os.path.join(sys.prefix, name)]
    try:
        out = _isolated(f"for path in {[*host_paths, '../' + name]!r}:\n"  # and next to its work directory
                        "    try:\n        open(path, 'w').write('escaped')\n        print('wrote', path)\n"
                        "    except OSError as e:\n        print('refused', type(e).__name__)\n"
                        "open('mine.txt', 'w').write('kept')\nprint(open('mine.txt').read())\n")
        assert not any(os.path.exists(p) for p in host_paths)
    finally:  # where isolation failed, leave nothing behind
        for p in host_paths:
            if os.path.exists(p):
                os.remove(p)
    lines = out.splitlines()
    assert len(lines) == 5 and all(line.startswith("refused") for line in lines[:4]) and lines[4] == "kept"


@isolated
def test_isolated_code_has_no_network():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        out = _isolated("import socket\ntry:\n"
                        f"    socket.create_connection(('127.0.0.1', {port}), timeout=5)\n    print('connected')\n"
                        "except OSError as e:\n    print('refused', type(e).__name__)\n")
        assert out.startswith("refused")
        with pytest.raises(BlockingIOError):  # nothing reached the listening socket
            server.accept()


@isolated
def test_isolated_code_cannot_signal_the_trainer():
    out = _isolated(f"import os\ntry:\n    os.kill({os.getpid()}, 0)\n    print('reached')\n"
                    "except OSError as e:\n    print('refused', type(e).__name__)\n")
    assert out == "refused ProcessLookupError\n"


@isolated
def test_ordinary_code_works_isolated():
    out = _isolated("import math, json, decimal, sqlite3, tempfile\nprint(math.factorial(20), json.dumps([1]))\n"
                    "print(decimal.Decimal(1) / 7)\n"
                    "print(sqlite3.connect(':memory:').execute('select 2*21').fetchone())\n"
                    "with tempfile.NamedTemporaryFile('w+') as f:\n    f.write('tmp ok')\n    f.seek(0)\n"
                    "    print(f.read())\n")
    assert out.splitlines() == ["2432902008176640000 [1]", "0.1428571428571428571428571429", "(42,)", "tmp ok"]


def test_isolation_setting(monkeypatch, caplog):
    with pytest.raises(ValueError, match="isolation must be one of auto, required, off"):
        SandboxLimits(isolation="on")
    # a machine without namespaces: "required" refuses at start-up in one line, "auto" says once it runs without
    monkeypatch.setattr(sandbox, "isolation_problem", lambda: "unshare: Operation not permitted")
    with pytest.raises(SandboxUnavailable, match="isolation='required' but .* Operation not permitted") as e:
        make_python_tool(isolation="required")
    assert "\n" not in str(e.value)
    sandbox._notice_unisolated.cache_clear()
    with caplog.at_level(logging.WARNING, logger="monorl"):
        python = make_python_tool(timeout_s=30, memory_mb=512, isolation="auto")
        assert python("print(1 + 1)") == "2\n"
    notices = [r.getMessage() for r in caplog.records if "WITHOUT isolation" in r.getMessage()]
    assert len(notices) == 1 and "Operation not permitted" in notices[0]
