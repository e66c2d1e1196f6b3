"""The program the ``python`` tool's child runs (``python -I sandbox_child.py ARGS``, started by `sandbox.run_python`;
standard library only: nothing of monorl is importable there). In order: isolation when asked, the limits, the
audit hook, then the model's code (``main.py`` in the work directory) as ``__main__``.

Isolation uses what Linux gives without root where unprivileged user namespaces are enabled (no extra package):
- this process enters new user (its uid and gid mapped to themselves), mount, network, IPC and PID namespaces;
- its child, PID 1 of the new PID namespace, builds a root of its own on a tmpfs: read-only binds of /usr, /bin,
  /lib*, the interpreter's prefixes and /etc/ld.so.cache, the /dev nodes null, zero, full, random and urandom, a
  /proc of the new PID namespace (where the kernel allows one), and the work directory, the only writable path
  (the rest of the root is read-only, so there is no /tmp: TMPDIR is the work directory). It pivots into that root
  and detaches the old one: /etc/passwd, home directories and the rest of the host's files are not there at all;
- PID 1 starts the code as PID 2 with no capabilities (so it cannot remount anything writable) and
  PR_SET_NO_NEW_PRIVS; the new network namespace has only a loopback interface that is down, so no connection
  goes anywhere; the host's processes are not in its PID namespace, so it can signal none of them;
- PID 1 hands the code's wait status to this process through a pipe and exits; this process then ends the same
  way (the exit code, or the same signal), and the kernel kills whatever the code left in the namespace.
A step that fails prints one ``sandbox isolation failed: ...`` line and exits with SETUP_FAILED.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import re
import resource
import signal
import sys
import traceback

SETUP_FAILED = 125
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x8000000, 0x10000000, 0x20000000, \
    0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, \
    1 << 18
# statvfs flag -> mount flag: what a read-only remount must keep (the kernel refuses to clear a locked one)
KEPT_FLAGS = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC, os.ST_NOATIME: 1024,
              os.ST_NODIRATIME: 2048, os.ST_RELATIME: 1 << 21}
MNT_DETACH, PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 2, 1, 24, 38
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217}
DEV_NODES = ("null", "zero", "full", "random", "urandom")

libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: None if s is None else os.fsencode(s))
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def write(path: str, text: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(text)


def mounts_at_or_under(path: str) -> list[str]:
    """Mount points at or below `path`, from /proc/self/mountinfo (octal escapes decoded)."""
    out = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            point = os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), line.split()[4]))
            if point == path or point.startswith(path + "/"):
                out.append(point)
    return out


def bind_read_only(source: str, root: str) -> None:
    """`source` visible read-only at the same path under `root` (a top-level symlink such as /bin -> usr/bin is
    recreated as a symlink); every mount below it is made read-only too."""
    target = root + source
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(source) and os.path.dirname(source) == "/":
        os.symlink(os.readlink(source), target)
        return
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        open(target, "a").close()
    mount(source, target, None, MS_BIND | MS_REC)
    for point in mounts_at_or_under(target):
        kept = os.statvfs(point).f_flag
        flags = sum(ms for st, ms in KEPT_FLAGS.items() if kept & st)
        mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | flags)


def system_paths() -> list[str]:
    """What the interpreter (and a program it may start) needs: the system's binaries and libraries, the
    loader's cache and the interpreter's own prefixes; each listed once, an ancestor before what it covers."""
    wanted = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache"]
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, os.path.dirname(sys.executable)):
        wanted += [os.path.abspath(p), os.path.realpath(p)]
    out: list[str] = []
    for p in sorted({p for p in wanted if os.path.lexists(p)}, key=len):
        if not any(p == q or p.startswith(q + "/") for q in out):
            out.append(p)
    return out


def build_root(work: str) -> None:
    """Make the tmpfs at `work`'s sibling ``root`` this process's root (see the module docstring); cwd `work`."""
    root = os.path.join(os.path.dirname(work), "root")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates anywhere
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for path in system_paths():
        bind_read_only(path, root)
    os.makedirs(root + "/dev")
    for name in DEV_NODES:
        open(f"{root}/dev/{name}", "a").close()
        mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    for name, to in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                     ("stderr", "/proc/self/fd/2")):
        os.symlink(to, f"{root}/dev/{name}")
    os.makedirs(root + "/proc")
    try:  # a container that masks parts of the host's /proc refuses a new one; the code runs without /proc then
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass
    os.makedirs(root + work)
    mount(work, root + work, None, MS_BIND)
    if platform.machine() not in PIVOT_ROOT:
        raise OSError(errno.ENOSYS, f"pivot_root: no syscall number known for {platform.machine()}")
    os.chdir(root)
    # pivot_root(".", "."): the old root ends up stacked on the new one, and detaching it leaves only the new one
    check(libc.syscall(ctypes.c_long(PIVOT_ROOT[platform.machine()]), b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "umount the old root")
    os.chdir("/")
    mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(work)


def exit_like(status: int) -> None:
    """End this process as a child with wait status `status` ended: the same exit code or the same signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:  # (SIGKILL's action cannot be set)
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else SETUP_FAILED)


def isolate() -> None:
    """Enter the namespaces and the new root (see the module docstring). Returns only in the code's process."""
    uid, gid, work = os.getuid(), os.getgid(), os.getcwd()
    check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWPID), "unshare")
    write("/proc/self/setgroups", "deny")
    write("/proc/self/uid_map", f"{uid} {uid} 1")
    write("/proc/self/gid_map", f"{gid} {gid} 1")
    status_r, status_w = os.pipe()
    init = os.fork()
    if init:  # outside the PID namespace: wait for its PID 1, end as the code ended
        os.close(status_w)
        _, status = os.waitpid(init, 0)
        reported = os.read(status_r, 32)
        exit_like(int(reported) if reported else status)
    os.close(status_r)
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    build_root(work)
    code = os.fork()
    if code == 0:
        os.close(status_w)
        drop_capabilities()
        return
    _, status = os.waitpid(code, 0)
    os.write(status_w, str(status).encode())
    os._exit(0)  # PID 1 exits: the kernel kills the rest of the namespace


def drop_capabilities() -> None:
    """No capability left in the new user namespace, now or after an exec (bounding set emptied)."""
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    check(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def limit(which: int, value: int) -> None:
    try:
        resource.setrlimit(which, (value, value))  # soft = hard: the code cannot raise it
    except (ValueError, OSError):
        pass


def forbid_processes() -> None:
    blocked = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
               "pty.spawn", "os.startfile")

    def hook(event: str, args: tuple) -> None:
        if event in blocked:
            raise PermissionError(f"{event}: creating processes is disabled in this sandbox")
    sys.addaudithook(hook)


def main() -> None:
    cpu, mem, fsize, nproc, forbid, isolated = (int(a) for a in sys.argv[1:7])
    limit(resource.RLIMIT_CORE, 0)
    if isolated:
        try:
            isolate()
        except OSError as e:
            why = f"{e.strerror}: {e.filename}" if e.filename else (e.strerror or str(e))
            print(f"sandbox isolation failed: {why}", file=sys.stderr, flush=True)
            os._exit(SETUP_FAILED)
    if cpu > 0:
        limit(resource.RLIMIT_CPU, cpu)
    if mem > 0:
        limit(resource.RLIMIT_AS, mem)
    if fsize >= 0:
        limit(resource.RLIMIT_FSIZE, fsize)
    if nproc > 0:
        limit(resource.RLIMIT_NPROC, nproc)
    if forbid:
        forbid_processes()
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    sys.argv = ["main.py"]
    namespace = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
    try:
        exec(compile(source, "main.py", "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as e:
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # start at the code's own frames
        traceback.print_exception(type(e), e, tb)
        sys.stderr.flush()
        sys.exit(1)


if __name__ == "__main__":
    main()
