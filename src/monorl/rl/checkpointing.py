"""Training checkpoints: everything a GRPO run needs to continue as if it had never stopped.

Layout under `<run_dir>/checkpoints/`:

    step_000010/            one checkpoint, taken after 10 completed RL steps
        config.json, model.safetensors, tokenizer files   the fp32 policy in HF format (loads in transformers)
        trainer_state.pt    optimizer, LR schedule, trainer step count, python/numpy/torch RNG states,
                            RL step, data position (index of the next training prompt)
        meta.json           step, data position, file sizes, and what the run wants back on resume
                            (e.g. the pre-training validation, which a resume does not repeat)
    latest                  the name of the newest complete checkpoint (one line)

Writes are atomic: a checkpoint is built in `.step_000010.tmp-<id>/` beside its final place, every file
is fsynced, and one rename publishes it; `latest` is replaced by rename too. A process killed at any
point leaves the previous checkpoint and `latest` intact; the half-written temp dir is ignored, and removed
by the next save. Only the newest `keep_last` step checkpoints are kept.

Test hook: MONORL_TEST_SLOW_CHECKPOINT_WRITE=<seconds> sleeps inside each write, after the policy files and
before trainer_state.pt, so a test can SIGKILL a process mid-write deterministically. Not for production use.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from monorl.model.checkpoint import CheckpointError, load_config, load_state_dict, save_checkpoint
from monorl.model.qwen3 import Qwen3ForCausalLM
from monorl.tasks.base import Prompt, Task
from monorl.train.trainer import Trainer

STATE_FILE = "trainer_state.pt"
META_FILE = "meta.json"
LATEST_FILE = "latest"
PREFIX = "step_"
FORMAT = "monorl-training-checkpoint"
VERSION = 1
SLOW_WRITE_ENV = "MONORL_TEST_SLOW_CHECKPOINT_WRITE"


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:06d}"


# ---- the data stream ------------------------------------------------------------------------------------

class PromptStream:
    """`task.train_prompts(seed, start)` that knows its position (the index of the next prompt it yields),
    which is what a checkpoint stores so that a resumed run draws the same prompts."""

    def __init__(self, task: Task, seed: int, start: int = 0) -> None:
        self.task_name = getattr(task, "name", type(task).__name__)
        self.position = start
        self._it = task.train_prompts(seed=seed, start=start)

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        p = next(self._it)
        index = p.meta.get("index")
        if index is None:  # a task without stream indices: count what was drawn
            self.position += 1
        else:
            if index < self.position:  # the task replayed from 0: a resume would silently repeat data
                raise ValueError(f"task {self.task_name!r}: train_prompts yielded index {index} after position "
                                 f"{self.position}; it must honour `start` (see monorl.tasks.base.Task)")
            self.position = int(index) + 1
        return p


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

def _fsync_dir(path: Path) -> None:
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


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(path)


def _write_text_atomic(file: Path, text: str) -> None:
    tmp = file.parent / f".{file.name}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)
    _fsync_dir(file.parent)


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


def _remove_stale(root: Path) -> None:
    """Temp dirs of writes that were killed before their rename."""
    for p in root.glob(".*"):  # ours: .step_N.tmp-*, .step_N.old-*, save_checkpoint's ..step_N.tmp-*.tmp-*
        if p.name.lstrip(".").startswith(PREFIX) and (".tmp-" in p.name or ".old-" in p.name):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def save_training_checkpoint(root: str | os.PathLike, step: int, policy: Qwen3ForCausalLM, trainer: Trainer, *,
                             data_position: int, tokenizer: Any = None, meta: dict[str, Any] | None = None,
                             keep_last: int = 2) -> Path:
    """Write `root/step_<step>/` atomically, point `root/latest` at it, and delete step checkpoints older than
    the newest `keep_last`. `step` counts completed RL steps (the resumed run starts at step index `step`)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale(root)
    name = checkpoint_name(step)
    final = root / name
    tmp = root / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        # fp32 master weights, not a bf16 copy: a resume must continue from exactly these values
        save_checkpoint(policy, tmp, dtype=torch.float32, tokenizer=tokenizer)
        _test_hook_sleep()
        state = {
            "format": FORMAT, "version": VERSION, "step": step, "data_position": data_position,
            "optimizer": trainer.optimizer.state_dict(), "scheduler": trainer.scheduler.state_dict(),
            "trainer_step_count": trainer.step_count, "rng": rng_state(),
        }
        torch.save(state, tmp / STATE_FILE)
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
        info = {"format": FORMAT, "version": VERSION, "step": step, "data_position": data_position,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files, **(meta or {})}
        (tmp / META_FILE).write_text(json.dumps(_finite(info), indent=2) + "\n", encoding="utf-8")
        _fsync_tree(tmp)
        old = None
        if final.exists():  # re-saving a step (a resume from an older checkpoint): move the old one aside
            old = root / f".{name}.old-{uuid.uuid4().hex[:8]}"
            final.rename(old)
        tmp.rename(final)
        _fsync_dir(root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_text_atomic(root / LATEST_FILE, name + "\n")
    for _, p in step_checkpoints(root)[:-keep_last]:
        if p != final:
            shutil.rmtree(p, ignore_errors=True)
    return final


def _finite(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_finite(x) for x in v]
    return v


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
        raise CheckpointError(f"no training checkpoint in {root} (expected {LATEST_FILE} or {PREFIX}NNNNNN/)")
    return found[-1][1]


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


@dataclass
class TrainingCheckpoint:
    path: Path
    step: int  # completed RL steps: the resumed loop starts at this step index
    data_position: int  # index of the next training prompt
    meta: dict[str, Any]


def load_training_checkpoint(path: str | os.PathLike, policy: Qwen3ForCausalLM, trainer: Trainer,
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
    stored = load_config(p)
    arch = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
            "rope_theta", "rms_norm_eps", "tie_word_embeddings")  # not token ids: those may be rewritten on save
    if diff := [f"{k}={getattr(stored, k)} (run: {getattr(policy.config, k)})" for k in arch
                if getattr(stored, k) != getattr(policy.config, k)]:
        raise CheckpointError(f"{p / 'config.json'} is another model than the run's policy: {', '.join(diff)}")
    expected = policy.state_dict()
    ignore = ("lm_head.weight",) if policy.config.tie_word_embeddings else ()
    device = next(policy.parameters()).device
    weights = load_state_dict(p, expected, device=device, dtype=torch.float32, ignore=ignore)

    with torch.no_grad():
        policy.load_state_dict(weights, strict=True)
    try:
        trainer.optimizer.load_state_dict(state["optimizer"])  # moves the moments to the parameters' device
        trainer.scheduler.load_state_dict(state["scheduler"])
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"{state_file}: optimizer/scheduler state does not fit this run: {e}") from None
    trainer.step_count = int(state["trainer_step_count"])
    if restore_rng:
        set_rng_state(state["rng"])
    return TrainingCheckpoint(p, int(state["step"]), int(state["data_position"]), meta)


# ---- run-dir logs on resume -----------------------------------------------------------------------------

def truncate_jsonl(path: str | os.PathLike, keep: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
    """Rewrite a JSONL log with only the rows `keep` accepts (a resume drops rows logged after the checkpoint
    it continues from, and a last line cut off by a kill); returns the kept rows. Atomic (temp + rename)."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a partial line from a killed write
        if isinstance(row, dict) and keep(row):
            rows.append(row)
    _write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


# ---- config changes on resume ---------------------------------------------------------------------------

def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict) and d:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


# Keys that do not change what a run computes: where it lives.
IGNORED_CONFIG_KEYS = ("run_dir",)


def config_diff(old: dict[str, Any], new: dict[str, Any],
                ignore: tuple[str, ...] = IGNORED_CONFIG_KEYS) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every key that differs between two `to_dict()` configs,
    compared in their JSON form (tuples and lists alike)."""
    a = _flatten(json.loads(json.dumps(_finite(old), default=str)))
    b = _flatten(json.loads(json.dumps(_finite(new), default=str)))
    missing = object()
    return [(k, a.get(k, missing), b.get(k, missing)) for k in sorted(set(a) | set(b))
            if k not in ignore and a.get(k, missing) != b.get(k, missing)]


def format_config_diff(diff: list[tuple[str, Any, Any]]) -> str:
    def show(v: Any) -> str:
        return "(absent)" if not isinstance(v, str | int | float | bool | list | dict | None) else json.dumps(v)

    return "\n".join(f"  {k}: {show(a)} -> {show(b)}" for k, a, b in diff)
