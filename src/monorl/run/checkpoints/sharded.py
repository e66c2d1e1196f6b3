"""Training checkpoints of a run on several ranks: sharded with torch.distributed.checkpoint (DCP), so a run
resumes on the same number of ranks or another (4 -> 2, 2 -> 1: DCP reshards on load).

Layout of `step_N/` (the single-process layout of `monorl.run.checkpoints.files`, with the weights and optimizer
moved into DCP):

    dcp/               DCP shards: the policy's state dict, the optimizer's (both by parameter name), and with
                       kl_coef > 0 the KL reference's (replicated: written once)
    trainer_state.pt   rank 0: LR schedule, trainer step count, RNG states, RL step, data position
    config.json, tokenizer files, meta.json    as in a single-process checkpoint (meta lists `dcp` as format)

No HF weights in step checkpoints (gathering and writing the full fp32 policy every few steps costs what the
shards cost again); `checkpoints/final` is the HF export, gathered to rank 0 (`full_policy_on_main`).

Writes stay atomic: rank 0 picks the temporary directory, every rank writes its shards into it, and rank 0
adds its files and publishes it with one rename (`monorl.fsutil.write_dir_atomic`). Every rank must reach the
same calls in the same order (they are collectives). The run directory must be on a filesystem every rank sees.
A disaggregated run's checkpoints are its trainers' (`World.group`: the trainer group), the generator ranks holding
no state a resume needs.
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import monorl.run.checkpoints.files as ck
from monorl.distributed.world import World
from monorl.fsutil import json_safe, remove_leftovers, write_dir_atomic, write_text_atomic
from monorl.model.hf_checkpoint import CheckpointError, write_checkpoint_files
from monorl.train.trainer import Trainer

# torch.distributed.checkpoint is imported where it is used: with DTensor and sympy it costs ~1.5 s, which a
# one-process run (the loop imports this module) never needs
DCP_DIR = "dcp"
FORMAT = "dcp"  # meta.json "storage": how the weights and optimizer are stored


def is_sharded_checkpoint(path: Path) -> bool:
    return (Path(path) / DCP_DIR).is_dir()


def _state(policy: nn.Module, trainer: Trainer, with_ref: bool) -> dict[str, Any]:
    """What DCP saves and loads, by name: fully qualified parameter names for the model and the optimizer."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(policy, trainer.optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    if with_ref and trainer.ref_model is not None:
        state["ref_model"] = trainer.ref_model.state_dict()
    return state


def full_policy_on_main(policy: nn.Module, world: World, make_plain: Callable[[], nn.Module]) -> nn.Module | None:
    """The sharded policy as one plain CPU module on rank 0 (`make_plain()` builds its empty shape), None on the
    other ranks. Every rank must call it: the parameters are gathered one at a time, offloaded to CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not world.is_main:
        return None
    plain = make_plain()
    plain.load_state_dict(sd)
    return plain


def save_sharded_checkpoint(root: Path, step: int, policy: nn.Module, trainer: Trainer, world: World, *,
                            data_position: int, config_source: nn.Module, tokenizer: Any = None,
                            meta: dict[str, Any] | None = None, keep_last: int = 2, processor: Any = None) -> Path:
    """Write `root/step_<step>/` (see the module docstring) from every rank, point `latest` at it, keep the
    newest `keep_last`. config_source: a module whose `.config` is the policy's (for config.json)."""
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    name = ck.checkpoint_name(step)
    state = _state(policy, trainer, with_ref=True)
    if not world.is_main:
        tmp = world.broadcast(None)
        dcp.save(state, checkpoint_id=tmp / DCP_DIR, process_group=world.group)
        world.barrier()  # rank 0 publishes the directory
        return root / name
    root.mkdir(parents=True, exist_ok=True)
    remove_leftovers(root, ck.PREFIX)

    def fill(tmp: Path) -> None:
        world.broadcast(tmp)
        dcp.save(state, checkpoint_id=tmp / DCP_DIR, process_group=world.group)
        write_checkpoint_files(config_source, tmp, dtype=torch.float32, tokenizer=tokenizer, weights=False,
                               processor=processor)
        ck._test_hook_sleep()
        small = {"format": ck.FORMAT, "version": ck.VERSION, "step": step, "data_position": data_position,
                 "scheduler": trainer.scheduler.state_dict(), "trainer_step_count": trainer.step_count,
                 "rng": ck.rng_state(), "has_ref_model": "ref_model" in state}
        torch.save(small, tmp / ck.STATE_FILE)
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
        info = {"format": ck.FORMAT, "version": ck.VERSION, "storage": FORMAT, "world_size": world.size,
                "step": step, "data_position": data_position, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "files": files, **(meta or {})}
        (tmp / ck.META_FILE).write_text(json.dumps(json_safe(info), indent=2) + "\n", encoding="utf-8")

    final = write_dir_atomic(root / name, fill)
    write_text_atomic(root / ck.LATEST_FILE, name + "\n")
    for _, p in ck.step_checkpoints(root)[:-keep_last]:
        if p != final:
            shutil.rmtree(p, ignore_errors=True)
    world.barrier()
    return final


def load_sharded_checkpoint(path: Path, policy: nn.Module, trainer: Trainer, restore_rng: bool = True,
                            group: Any = None) -> ck.TrainingCheckpoint:
    """Restore a DCP checkpoint into this run's policy (sharded over any number of ranks, or plain) and trainer,
    in place. Every rank of `group` (default: the job; a disaggregated run's trainers) calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    p = Path(path)
    meta = ck.read_meta(p)
    try:
        small = torch.load(p / ck.STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as e:  # zip / unpickling errors of a corrupt file
        raise CheckpointError(f"corrupt checkpoint file {p / ck.STATE_FILE}: {type(e).__name__}: {e}") from None
    if (small.get("step"), small.get("data_position")) != (meta["step"], meta["data_position"]):
        raise CheckpointError(f"{p / ck.STATE_FILE} and {p / ck.META_FILE} disagree: files from different "
                              "checkpoints")
    ck.check_architecture(p, policy.config)
    state = _state(policy, trainer, with_ref=bool(small.get("has_ref_model")))
    with warnings.catch_warnings():  # one process, no group: DCP warns that it assumes just that
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=p / DCP_DIR, no_dist=not dist.is_initialized(), process_group=group)
    set_state_dict(policy, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if "ref_model" in state:
        trainer.ref_model.load_state_dict(state["ref_model"])
    trainer.scheduler.load_state_dict(small["scheduler"])
    trainer.step_count = int(small["trainer_step_count"])
    if restore_rng:
        ck.set_rng_state(small["rng"])
    return ck.TrainingCheckpoint(p, int(small["step"]), int(small["data_position"]), meta)
