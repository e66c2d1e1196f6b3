"""Images in tool results and environment messages, TRL's convention: a tool (or a message-level environment's
message) gives a list of content parts, ``[{"type": "image", "image": <PIL image | path | bytes>}, {"type": "text",
"text": "..."}]`` (GRPOTrainer's tool loop passes such a list through as the ``tool`` message's content and collects
its images for the forward pass). A tool that runs in another process returns the image as a file path.

monorl's messages hold text: each image part becomes Qwen-VL's placeholder (``<|vision_start|><|image_pad|>
<|vision_end|>``, what its chat template renders for an image part) at its place in the text, and the message
carries its images under ``"images"``, in order. The episode runner expands the placeholders to each image's token
count and feeds the images at the next turn's prefill (`monorl.model.vision_prompt.append_images`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from monorl.model.image_processing import IMAGE_PAD
from monorl.tasks.images import PLACEHOLDER, check_image

PART_TYPES = ("text", "image")


def is_content_parts(value: Any) -> bool:
    """Is `value` a list of content parts (each a dict whose "type" is "text" or "image")?"""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(p, dict) and p.get("type") in PART_TYPES for p in value))


def parts_text(parts: Sequence[dict[str, Any]]) -> tuple[str, list[Any]]:
    """Content parts -> (their text, a placeholder at each image's place; the images in order). ValueError (one
    line) for a text part without text or an image part without an image."""
    text: list[str] = []
    images: list[Any] = []
    for part in parts:
        if part["type"] == "image":
            if part.get("image") is None:
                raise ValueError('an image part has no "image" (expected {"type": "image", "image": <PIL image, '
                                 'path or bytes>})')
            images.append(check_image(part["image"]))
            text.append(PLACEHOLDER)
        elif isinstance(part.get("text"), str):
            text.append(part["text"])
        else:
            raise ValueError('a text part has no "text" string (expected {"type": "text", "text": "..."})')
    return "".join(text), images


def flat_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose content is a list of parts, as text with its images under "images" (others as they are)."""
    if not is_content_parts(message.get("content")):
        return message
    text, images = parts_text(message["content"])
    return {**message, "content": text, "images": images}


def cut_images(text: str, images: list[Any]) -> list[Any]:
    """The images whose placeholders a cut `text` (a long result cut to its limit) still holds."""
    return images[:text.count(IMAGE_PAD)]


def message_images(messages: Sequence[dict[str, Any]]) -> list[Any]:
    """The images of `messages`, in order."""
    return [im for m in messages for im in m.get("images") or ()]


def without_images(message: dict[str, Any]) -> dict[str, Any]:
    """A message as text alone (its placeholders show where its images were): for samples.jsonl."""
    return {k: v for k, v in message.items() if k != "images"}
