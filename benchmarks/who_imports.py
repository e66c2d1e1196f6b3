"""Who first imports a module during a `monorl` command, and what the import costs (issue 18: a warm run pays for
torch._dynamo's import; this names the caller). Runs the command in this process through `monorl.cli.main` with a
meta-path hook that records, for each watched module, the call stack of its first import and its import time.

    python benchmarks/who_imports.py --watch torch._dynamo,torch._inductor -- train --preset tiny --steps 1
"""

from __future__ import annotations

import argparse
import importlib.abc
import sys
import time
import traceback


class _Watch(importlib.abc.MetaPathFinder):
    """Records the stack of each watched module's first import; the import's time is taken by wrapping the
    loader's exec_module."""

    def __init__(self, names: list[str]) -> None:
        self.names = set(names)
        self.seen: dict[str, tuple[list[str], float]] = {}

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001, ANN201 (the finder protocol)
        if fullname not in self.names or fullname in self.seen:
            return None
        stack = [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                 if "importlib" not in f.filename and "who_imports" not in f.filename]
        self.seen[fullname] = (stack, float("nan"))
        for finder in sys.meta_path:  # the real spec, from the finders after this one
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                exec_module = spec.loader.exec_module

                def timed(module, _exec=exec_module, _name=fullname):  # noqa: ANN001, ANN202
                    t = time.perf_counter()
                    try:
                        _exec(module)
                    finally:
                        self.seen[_name] = (self.seen[_name][0], time.perf_counter() - t)

                spec.loader.exec_module = timed
                return spec
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--watch", default="torch._dynamo", help="comma-separated module names")
    p.add_argument("--frames", type=int, default=14, help="innermost frames of each stack to print")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the monorl command")
    args = p.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    watch = _Watch(args.watch.split(","))
    already = [n for n in watch.names if n in sys.modules]
    sys.meta_path.insert(0, watch)
    t = time.perf_counter()
    import monorl.cli

    rc = monorl.cli.main(argv)
    print(f"\n[who_imports] command rc {rc}, {time.perf_counter() - t:.2f} s in this process")
    for name in sorted(watch.names):
        if name in already:
            print(f"[who_imports] {name}: imported before the command")
        elif name not in watch.seen:
            print(f"[who_imports] {name}: never imported")
        else:
            stack, secs = watch.seen[name]
            print(f"[who_imports] {name}: first imported in {secs:.3f} s (its own import, nested ones included) from")
            for line in stack[-args.frames:]:
                print(f"    {line}")
    return 0 if not rc else int(rc)


if __name__ == "__main__":
    sys.exit(main())
