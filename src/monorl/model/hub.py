"""`--model.path` as a local directory or a Hugging Face Hub name (`Qwen/Qwen3-0.6B`): a name resolves to the
snapshot in huggingface_hub's local cache (HF_HUB_CACHE / HF_HOME), and is downloaded there when absent and
the hub is reachable (not with HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import os
import re
from pathlib import Path

# what a model needs: config, weights (one file or shards + index), tokenizer, generation defaults
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def run_final_checkpoint(path: str | Path) -> Path | None:
    """RUN/checkpoints/final when `path` is a monorl run directory (a model path may name the run itself), else
    None."""
    local = Path(path).expanduser()
    final = local / "checkpoints" / "final"
    if final.is_dir() and not any(local.glob("*.safetensors")):
        return final
    return None


def resolve_model_path(path: str) -> tuple[Path, str]:
    """(a local directory holding the model, a note on where it came from: '' for a local dir, else the hub name
    and whether the cache or a download served it). A missing path that is no hub name raises FileNotFoundError."""
    local = Path(path).expanduser()
    if (final := run_final_checkpoint(local)) is not None:
        return final, f" (the final checkpoint of run {local})"
    if local.exists() or not _REPO_ID.match(path):
        return local, ""  # load_config names what is missing
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # a dependency of tokenizers, so normally present
        raise FileNotFoundError(f"model.path {path} is not a directory, and huggingface_hub (needed to fetch "
                                "it by name) is not installed") from None
    cache = os.environ.get("HF_HUB_CACHE")  # read now: huggingface_hub reads it once, at import
    try:
        return Path(snapshot_download(path, local_files_only=True, allow_patterns=MODEL_FILES, cache_dir=cache)), \
            f" ({path} from the Hugging Face cache)"
    except LocalEntryNotFoundError:
        pass
    try:
        return Path(snapshot_download(path, allow_patterns=MODEL_FILES, cache_dir=cache)), \
            f" ({path}, downloaded from the Hub)"
    except Exception as e:  # offline, unknown repo, gated, network: one line saying which
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        raise FileNotFoundError(f"model.path {path} is neither a local directory nor in the Hugging Face cache, and "
                                f"downloading it failed ({why})") from None
