"""Images in a dataset's rows (TRL's convention): an ``image`` column (one per row) or ``images`` (a list), each a
PIL image (a `datasets` Image feature decodes to one), a file path (JSONL; relative paths are taken from the data
file's directory when the file is there) or bytes (Parquet; also a `datasets` Image's undecoded
``{"bytes", "path"}``). A row's images go with its prompt as ``meta["images"]``, and its first user message starts
with one vision placeholder per image, where Qwen-VL's chat template puts a message's images (TRL's
``prepare_multimodal_messages`` puts them in the first user turn too); the placeholder's single image-pad token is
expanded to the image's token count at encoding (`monorl.model.vision_prompt`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

IMAGE_COLUMNS = ("image", "images")
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # one image in a Qwen-VL chat message


def row_images(record: dict[str, Any], base: Path | None = None) -> list[Any]:
    """The images of a row (none without an image column), paths resolved against `base` (the data's
    directory) where the file lies there. ValueError (one line) for a value that is no image."""
    if "image" in record and "images" in record:
        raise ValueError("a row has both an 'image' and an 'images' column; keep one")
    value = record.get("image", record.get("images"))
    if value is None:
        return []
    items = list(value) if isinstance(value, list | tuple) else [value]
    out = []
    for item in items:
        if isinstance(item, str) and base is not None and not Path(item).is_absolute() and (base / item).is_file():
            item = str(base / item)
        out.append(check_image(item))
    return out


def check_image(item: Any) -> Any:
    """`item` if it is an image `load_image` reads (a PIL image, a path, bytes, a {"bytes", "path"} dict); else
    ValueError (one line)."""
    if not (isinstance(item, str | bytes | dict) or hasattr(item, "convert")):
        raise ValueError(f"an image must be a PIL image, a path or bytes, got {type(item).__name__}")
    return item


def with_placeholders(messages: list[dict[str, str]], count: int) -> list[dict[str, str]]:
    """messages with `count` image placeholders at the start of the first user message."""
    if count == 0:
        return messages
    at = next((i for i, m in enumerate(messages) if m["role"] == "user"), 0)
    out = [dict(m) for m in messages]
    out[at]["content"] = PLACEHOLDER * count + out[at]["content"]
    return out


def check_no_images(prompt: Any) -> None:
    """Where a prompt's images do not reach the model yet (the generator ranks' continuous rollouts: #59), a prompt
    with images stops the run in one line rather than training on its placeholders alone."""
    if prompt.meta.get("images"):
        raise ValueError(f"a prompt holds {len(prompt.meta['images'])} image(s); this rollout path does not feed "
                         "images to the model yet (#59): generate on the trainer's ranks (colocated) or drop the "
                         "image column")
