"""Training checkpoints: everything a GRPO run needs to continue as if it had never stopped.

Layout under `<run_dir>/checkpoints/`:

    step_000010/            one checkpoint, taken after 10 completed RL steps
        config.json, model.safetensors, tokenizer files   the fp32 policy in HF format (loads in transformers)
        adapter/            LoRA runs, instead of model.safetensors: the adapters in PEFT's format (the frozen
                            base is the run's model.path, or its seeded random init)
        trainer_state.pt    `Trainer.state_dict()` (optimizer, LR schedule, trainer step count; with kl_coef > 0
                            the KL reference's weights), python/numpy/torch RNG states, RL step, data position
                            (index of the next training prompt)
        meta.json           step, data position, file sizes, and what the run wants back on resume
                            (e.g. the pre-training validation, which a resume does not repeat)
    latest                  the name of the newest complete checkpoint (one line)

Writes are atomic (`monorl.fsutil`): a checkpoint is built in `.step_000010.tmp-<id>/` beside its final place,
every file is fsynced, and one rename publishes it; `latest` is replaced by rename too. A process killed at any
point leaves the previous checkpoint and `latest` intact; the half-written temp dir is ignored, and removed
by the next save. Only the newest `keep_last` step checkpoints are kept.

Test hook: MONORL_TEST_SLOW_CHECKPOINT_WRITE=<seconds> sleeps inside each write, after the policy files and
before trainer_state.pt, so a test can SIGKILL a process mid-write deterministically. Not for production use.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from monorl.fsutil import json_safe, remove_leftovers, write_dir_atomic, write_text_atomic
from monorl.model.decoder import DecoderForCausalLM
from monorl.model.hf_checkpoint import CheckpointError, load_config, load_state_dict, write_checkpoint_files
from monorl.model.lora import is_lora, load_adapter_, save_adapter
from monorl.train.trainer import Trainer

STATE_FILE = "trainer_state.pt"
ADAPTER_DIR = "adapter"  # a LoRA run's adapters, in PEFT's format
META_FILE = "meta.json"
LATEST_FILE = "latest"
PREFIX = "step_"
FORMAT = "monorl-training-checkpoint"
VERSION = 1
SLOW_WRITE_ENV = "MONORL_TEST_SLOW_CHECKPOINT_WRITE"


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:06d}"


# ---- RNG ------------------------------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU and every CUDA device) generator states, in torch.load(weights_only)-safe
    types."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        try:
            import numpy as np

            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
        except ImportError:
            pass
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:  # other GPU count: the local device's stream is what sampling-free code could touch
            torch.cuda.set_rng_state(state["cuda"][0])


# ---- writing --------------------------------------------------------------------------------------------

def _test_hook_sleep() -> None:
    secs = os.environ.get(SLOW_WRITE_ENV)
    if secs:
        time.sleep(float(secs))


def step_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete-looking step checkpoints under `root`, oldest first (temp dirs start with '.': skipped)."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit():
                out.append((int(p.name[len(PREFIX):]), p))
    return sorted(out)


def save_training_checkpoint(root: str | os.PathLike, step: int, policy: DecoderForCausalLM, trainer: Trainer, *,
                             data_position: int, tokenizer: Any = None, meta: dict[str, Any] | None = None,
                             keep_last: int = 2, processor: Any = None) -> Path:
    """Write `root/step_<step>/` atomically, point `root/latest` at it, and delete step checkpoints older than
    the newest `keep_last`. `step` counts completed RL steps (the resumed run starts at step index `step`).
    processor: a vision-language policy's image processor (its files beside the tokenizer's)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    remove_leftovers(root, PREFIX)  # temp dirs of writes that were killed before their rename
    name = checkpoint_name(step)

    def fill(tmp: Path) -> None:
        # fp32 master weights, not a bf16 copy: a resume must continue from exactly these values. A LoRA policy's
        # trained weights are its adapters (PEFT format, under adapter/); its frozen base comes from the run's
        # model.path (or seed) on resume
        lora = is_lora(policy)
        write_checkpoint_files(policy, tmp, dtype=torch.float32, tokenizer=tokenizer, weights=not lora,
                               processor=processor)
        if lora:
            save_adapter(policy, tmp / ADAPTER_DIR)
        _test_hook_sleep()
        state = {"format": FORMAT, "version": VERSION, "step": step, "data_position": data_position,
                 **trainer.state_dict(), "rng": rng_state()}
        torch.save(state, tmp / STATE_FILE)
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
        info = {"format": FORMAT, "version": VERSION, "step": step, "data_position": data_position,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files, **(meta or {})}
        (tmp / META_FILE).write_text(json.dumps(json_safe(info), indent=2) + "\n", encoding="utf-8")

    # re-saving a step (a resume from an older checkpoint) replaces the old one once the new one is complete
    final = write_dir_atomic(root / name, fill)
    write_text_atomic(root / LATEST_FILE, name + "\n")
    for _, p in step_checkpoints(root)[:-keep_last]:
        if p != final:
            shutil.rmtree(p, ignore_errors=True)
    return final


# ---- reading --------------------------------------------------------------------------------------------

def find_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint to resume from: `path` itself if it is one, else the one `path/checkpoints/latest` (or
    `path/latest`) names, else the newest step checkpoint there."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"resume path {p} does not exist")
    if (p / META_FILE).exists() or (p / STATE_FILE).exists():
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    latest = root / LATEST_FILE
    if latest.is_file():
        name = latest.read_text(encoding="utf-8").strip()
        target = root / name
        if not name or not target.is_dir():
            raise CheckpointError(f"{latest} names checkpoint {name!r}, which does not exist in {root}"
                                  + _others(root))
        return target
    found = step_checkpoints(root)
    if not found:
        run = root.parent if root.name == "checkpoints" else root
        if (run / "config.json").is_file():  # a run stopped before its first checkpoint (the warm start is not one)
            raise CheckpointError(f"no training checkpoint in {root}: {no_checkpoint_hint(run)}")
        raise CheckpointError(f"no training checkpoint in {root} (expected {LATEST_FILE} or {PREFIX}NNNNNN/)")
    return found[-1][1]


def no_checkpoint_hint(run_dir: Path) -> str:
    """What works for a run directory without a training checkpoint (stopped before its first one): starting over."""
    return (f"{run_dir} has nothing to resume from (it stopped before its first checkpoint); start over: the same "
            f"command with a new --run_dir, or after `rm -r {run_dir}`")


def resumable(run_dir: Path) -> bool:
    """Whether `monorl train --resume run_dir` finds a checkpoint to continue from."""
    try:
        find_checkpoint(run_dir)
    except CheckpointError:
        return False
    return True


def check_resume_point(path: Path) -> None:
    """Refuse to resume a run from a step checkpoint older than its newest: the run directory would then hold
    checkpoints, `latest` and metrics of two histories. Resuming the newest (or the run dir) is what --resume is."""
    found = step_checkpoints(path.parent)
    if found and path.name.startswith(PREFIX) and found[-1][1].name != path.name:
        step, newest = found[-1]
        raise CheckpointError(f"{path} is older than the run's newest checkpoint {newest.name} (step {step}): "
                              f"resuming from it would rewrite the run's history; resume the run "
                              f"({path.parent.parent}), or branch: copy its config.json and checkpoints/{path.name} "
                              "into a new directory and resume that")


def _others(root: Path, but: Path | None = None) -> str:
    others = [p.name for _, p in step_checkpoints(root) if p != but]
    return f"; other checkpoints there (resume one with --resume <its path>): {', '.join(others)}" if others else ""


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """meta.json of a training checkpoint, checked for format and for the files it lists (by size)."""
    p = Path(path)
    file = p / META_FILE
    if not file.is_file():
        raise CheckpointError(f"checkpoint file missing: {file}" + _others(p.parent, p))
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt checkpoint file {file}: {e}" + _others(p.parent, p)) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a monorl training checkpoint's meta.json")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{file}: checkpoint format version {meta.get('version')}, this monorl reads {VERSION}")
    for name, size in meta.get("files", {}).items():
        f = p / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint file missing: {f}" + _others(p.parent, p))
        if f.stat().st_size != size:  # cheap truncation check; parse errors catch the rest below
            raise CheckpointError(f"corrupt checkpoint file {f}: {f.stat().st_size} bytes, {size} when written"
                                  + _others(p.parent, p))
    return meta


# config fields a checkpoint may differ in from the run's policy: token ids may be rewritten on save, the context
# length and the router's loss coefficient are run settings, not weights' shapes or meaning
_NOT_ARCHITECTURE = frozenset({"bos_token_id", "eos_token_id", "max_position_embeddings", "router_aux_loss_coef"})


def check_architecture(path: Path, config: Any) -> None:
    """Refuse a checkpoint whose config.json is another architecture than the run's policy (`config`): every
    `ModelConfig` field but `_NOT_ARCHITECTURE` (layer kinds, windows, shared experts and vision towers included)."""
    stored = load_config(path)
    arch = [f.name for f in dataclasses.fields(stored) if f.name not in _NOT_ARCHITECTURE]
    if diff := [f"{k}={getattr(stored, k)} (run: {getattr(config, k)})" for k in arch
                if getattr(stored, k) != getattr(config, k)]:
        raise CheckpointError(f"{path / 'config.json'} is another model than the run's policy: {', '.join(diff)}")


@dataclass
class TrainingCheckpoint:
    path: Path
    step: int  # completed RL steps: the resumed loop starts at this step index
    data_position: int  # index of the next training prompt
    meta: dict[str, Any]


def load_training_checkpoint(path: str | os.PathLike, policy: DecoderForCausalLM, trainer: Trainer,
                             restore_rng: bool = True) -> TrainingCheckpoint:
    """Restore a checkpoint into an existing policy (in place, so the optimizer's parameters and any
    generator copy stay the same objects) and trainer. Everything is read and checked before anything is
    changed; a bad file raises CheckpointError naming it."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"checkpoint directory {p} does not exist")
    meta = read_meta(p)
    state_file = p / STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"checkpoint file missing: {state_file}" + _others(p.parent, p))
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception as e:  # zip / unpickling errors of a corrupt file
        raise CheckpointError(f"corrupt checkpoint file {state_file}: {type(e).__name__}: {e}"
                              + _others(p.parent, p)) from None
    want = ("format", "step", "data_position", "optimizer", "scheduler", "trainer_step_count", "rng")
    if not isinstance(state, dict) or (missing := [k for k in want if k not in state]):
        raise CheckpointError(f"corrupt checkpoint file {state_file}: missing entries "
                              f"{missing if isinstance(state, dict) else want}")
    if (state["step"], state["data_position"]) != (meta["step"], meta["data_position"]):
        raise CheckpointError(f"{state_file} (step {state['step']}) and {p / META_FILE} (step {meta['step']}) "
                              "disagree: files from different checkpoints")
    check_architecture(p, policy.config)
    if is_lora(policy):
        try:
            load_adapter_(policy, p / ADAPTER_DIR)  # checks everything before writing the first tensor
        except ValueError as e:
            raise CheckpointError(f"{p}: {e}" + _others(p.parent, p)) from None
    else:
        expected = policy.state_dict()
        ignore = ("lm_head.weight",) if policy.config.tie_word_embeddings else ()
        device = next(policy.parameters()).device
        weights = load_state_dict(p, expected, device=device, dtype=torch.float32, ignore=ignore)
        with torch.no_grad():
            policy.load_state_dict(weights, strict=True)
    try:
        trainer.load_state_dict(state)
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"{state_file}: trainer state (optimizer, schedule, KL reference) does not fit this "
                              f"run: {e}") from None
    if restore_rng:
        set_rng_state(state["rng"])
    return TrainingCheckpoint(p, int(state["step"]), int(state["data_position"]), meta)
