"""Where a `monorl train` process spends its time before the run's own clock starts (`start_parts`, where the
summary's `wall_s` begins): the imports, then `monorl.cli.main` of W0 under cProfile, stopped at `start_parts`.

  python benchmarks/probe_pre_run.py DIR   (DIR holds Qwen3-0.6B's config.json: bench_memory.model_dir makes one)
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import cProfile  # noqa: E402 -- after the clock
import pstats  # noqa: E402
import sys  # noqa: E402

import monorl.cli as cli  # noqa: E402
import monorl.run.parts as parts  # noqa: E402

IMPORTS_S = time.perf_counter() - T0


class _Stop(Exception):
    pass


def main() -> None:
    original = parts.start_parts

    def stop(*args: object, **kwargs: object) -> None:
        print(f"imports {IMPORTS_S:.2f} s; start_parts reached at {time.perf_counter() - T0:.2f} s", flush=True)
        raise _Stop

    for module in list(sys.modules.values()):  # every module that imported the function by name
        if getattr(module, "__dict__", {}).get("start_parts") is original:
            module.start_parts = stop
    profile = cProfile.Profile()
    profile.enable()
    try:
        cli.main(["train", "--preset", "qwen3_0_6b_sum_digits", "--model.path", sys.argv[1], "--model.random_init",
                  "true", "--rollout.ignore_eos", "true", "--checkpoint.final", "false",
                  "--checkpoint.every_minutes", "0", "--run_dir", "/tmp/probe_pre_run"])
    except _Stop:
        pass
    profile.disable()
    pstats.Stats(profile).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
