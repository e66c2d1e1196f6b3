"""Files on disk: written so that a process killed at any point leaves the old version or the new one where a
reader looks, never a partial one; and JSON in and out.

A file is written beside its target (`.<name>.tmp-<id>`), fsynced, and renamed over it. A directory is built
the same way and published by one rename; an existing one is first renamed aside (`.<name>.old-<id>`: a
directory cannot be renamed over a non-empty one) and deleted after. Leftovers of killed writes start with
'.', so readers that list names skip them; `remove_leftovers` deletes them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _aside(path: Path, kind: str) -> Path:
    return path.parent / f".{path.name}.{kind}-{uuid.uuid4().hex[:8]}"


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(file: Path, text: str) -> None:
    tmp = _aside(file, "tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)
    fsync_dir(file.parent)


def write_dir_atomic(dst: Path, fill: Callable[[Path], None]) -> Path:
    """Call `fill(tmp)` on a new empty directory beside `dst`, then make it `dst`, replacing any old one only
    once the new one is complete. If `fill` raises, the temp directory is removed and `dst` is untouched."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = _aside(dst, "tmp")
    tmp.mkdir()
    try:
        fill(tmp)
        for f in tmp.iterdir():  # file data on disk before the rename makes it visible
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        fsync_dir(tmp)
        old = None
        if dst.exists():
            old = _aside(dst, "old")
            dst.rename(old)
        tmp.rename(dst)
        fsync_dir(dst.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def remove_leftovers(parent: Path, prefix: str) -> None:
    """Temp and set-aside entries in `parent` of writes (of names starting with `prefix`) that were killed
    before they finished."""
    for p in parent.glob(".*"):  # .NAME.tmp-*, .NAME.old-*, and ..NAME.tmp-*.tmp-* (a nested write)
        if p.name.lstrip(".").startswith(prefix) and (".tmp-" in p.name or ".old-" in p.name):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def read_json(file: Path, error: type[Exception] = ValueError) -> dict[str, Any]:
    """A JSON object from `file`; anything else raises `error` with a message naming the file."""
    if not file.is_file():
        raise error(f"{file.name} not found: {file}")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as e:
        raise error(f"cannot read {file}: {e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"cannot parse {file}: {e}") from None
    if not isinstance(data, dict):
        raise error(f"cannot parse {file}: expected a JSON object, got {type(data).__name__}")
    return data


def json_safe(v: Any) -> Any:
    """`v` with every non-finite float as None (JSON has no NaN/inf) and tuples as lists."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [json_safe(x) for x in v]
    return v


def install_hint(extra: str) -> str:
    """The command that installs monorl's optional extra `extra` the way this monorl was installed: from a
    checkout (an editable install: `pip install -e '/path/to/checkout[extra]'`) or from the index."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        direct = distribution("monorl").read_text("direct_url.json")
    except PackageNotFoundError:
        direct = None
    if direct:
        info = json.loads(direct)
        if info.get("dir_info", {}).get("editable") and info.get("url", "").startswith("file://"):
            return f"pip install -e '{info['url'].removeprefix('file://')}[{extra}]'"
    return f"pip install 'monorl[{extra}]'"
