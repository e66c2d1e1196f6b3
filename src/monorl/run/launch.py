"""`monorl train --nproc N`: the run as N processes on this machine, through torchrun's own entry point
(`torch.distributed.run`), i.e. `torchrun --standalone --nproc_per_node N -m monorl.cli train --config FILE`, FILE
being the config this process resolved (so every rank runs exactly it). Several nodes: run torchrun yourself on
each (docs/guides/several-gpus.md)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from monorl.distributed.world import World, launched_by_torchrun
from monorl.distributed.world_fit import check_world


def relaunch_train(cfg: Any, nproc: int, resume: str | None = None, allow_config_change: bool = False) -> int:
    """`monorl train` of `cfg` (a resolved RunConfig; `resume` as given) as `nproc` ranks on this machine."""
    from monorl.cliargs import config_file_text

    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    check_world(cfg, World(size=nproc))  # before starting N processes that would each say it
    tmp = Path(tempfile.mkdtemp(prefix="monorl-launch-"))
    try:
        file = tmp / "config.json"
        file.write_text(config_file_text(cfg, "json"), encoding="utf-8")
        argv = ["train", "--config", str(file)]
        if resume is not None:
            argv += ["--resume", resume] + (["--allow-config-change"] if allow_config_change else [])
        return relaunch_with_torchrun(nproc, argv)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def relaunch_with_torchrun(nproc: int, verb_argv: list[str]) -> int:
    """Run `monorl <verb_argv>` as `nproc` ranks on this machine and wait for them; the exit status is 0 when
    every rank succeeded. torchrun names a failed rank (its exit code and error) on stderr."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    if launched_by_torchrun():
        raise ValueError("--nproc under torchrun: torchrun already started the ranks (drop --nproc)")
    try:
        torchrun_main(["--standalone", f"--nproc_per_node={nproc}", "-m", "monorl.cli", *verb_argv])
    except ChildFailedError as e:
        rank, first = e.get_first_failure()
        print(f"monorl: error: rank {rank} failed first (exit code {first.exitcode}); torchrun then ended the "
              "others. Its output is above", file=sys.stderr)
        return 1
    return 0
