"""`monorl train --nproc N`: the same command as N processes on this machine, through torchrun's own entry
point (`torch.distributed.run`), i.e. `torchrun --standalone --nproc_per_node N -m monorl.cli train ...`.
Several nodes: run torchrun yourself on each (README "Several GPUs")."""

from __future__ import annotations

import sys

from monorl.distributed.world import launched_by_torchrun


def relaunch_with_torchrun(nproc: int, verb_argv: list[str]) -> int:
    """Run `monorl <verb_argv>` as `nproc` ranks on this machine and wait for them; the exit status is 0 when
    every rank succeeded. torchrun names a failed rank (its exit code and error) on stderr."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
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
