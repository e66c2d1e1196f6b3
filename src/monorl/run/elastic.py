"""Restarts under torchrun --max-restarts: a restarted job continues from its run directory's last complete
checkpoint instead of starting over (torchrun restarts every rank with the same command line)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from monorl.run.checkpoints.files import step_checkpoints
from monorl.run.run_dir import truncate_jsonl


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def restart_resume_path(cfg: Any, is_main: bool) -> Path | None:
    """The run directory to resume after a restart (None: a first attempt, or no checkpoint yet, so the job
    starts over). A job that may be restarted needs a fixed run_dir: a default one names the start time, which a
    restarted job cannot know."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and cfg.run_dir is None:
        raise ValueError("torchrun --max-restarts needs --run_dir DIR: a restarted job resumes from DIR's last "
                         "checkpoint")
    if restart_count() == 0 or cfg.run_dir is None:
        return None
    root = Path(cfg.run_dir)
    if step_checkpoints(root / "checkpoints"):
        return root
    if is_main:  # no checkpoint yet: the job starts over, without the failed attempt's log rows
        for log in ("metrics.jsonl", "samples.jsonl"):
            truncate_jsonl(root / log, lambda row: False)
    return None


# Test hook: "RANK:STEP" makes rank RANK exit (code 3) right after step STEP's checkpoint, on the job's first
# attempt only, so a test can watch torchrun end or restart the job; "RANK:STEP:hang" makes it hang there instead
# (the others then time out in their next collective). Not for production use.
DIE_ENV = "MONORL_TEST_DIE_AFTER_STEP"


def die_for_test(rank: int, steps_done: int) -> None:
    spec = os.environ.get(DIE_ENV, "").split(":")
    if len(spec) >= 2 and restart_count() == 0 and (int(spec[0]), int(spec[1])) == (rank, steps_done):
        if spec[2:] == ["hang"]:  # stuck, yet killed by torchrun's SIGTERM (not a graceful stop after the step)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(3600)
        os._exit(3)
