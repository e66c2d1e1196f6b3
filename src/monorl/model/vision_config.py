"""The vision half of a vision-language config (Qwen3-VL; Qwen3.5 uses the same tower): the tower's shape, its
special tokens and the text decoder's M-RoPE sections. `ModelConfig.vision` holds one; None for a text-only model.
Its own module so that `config.py` (which holds it) and the tower (`vision.py`) both import it without a cycle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# transformers' Qwen3VLVisionConfig defaults and Qwen3VLConfig's token ids (a key config.json leaves out means these;
# tests/test_qwen3_vl.py checks them against the installed transformers)
HF_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304, "num_heads": 16,
    "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 3584,
    "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]}
HF_VL_TOKEN_DEFAULTS: dict[str, int] = {"image_token_id": 151655, "video_token_id": 151656,
                                        "vision_start_token_id": 151652, "vision_end_token_id": 151653}
DEFAULT_MROPE_SECTION = (24, 20, 20)  # Qwen3VLTextRotaryEmbedding's, when rope_parameters names none


@dataclass(frozen=True)
class VisionConfig:
    depth: int  # vision blocks
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int  # the merger's output width: the text decoder's hidden_size
    patch_size: int = 16
    temporal_patch_size: int = 2  # frames per patch (an image is its one frame repeated)
    spatial_merge_size: int = 2  # merge x merge patches become one text token
    in_channels: int = 3
    num_position_embeddings: int = 2304  # a square grid of learned position embeddings, resampled to each image
    deepstack_visual_indexes: tuple[int, ...] = ()  # blocks whose merged features are added to text layers 0, 1, ..
    rope_theta: float = 10000.0  # the tower's axial 2-D RoPE
    # the text side: placeholder tokens and the decoder's M-RoPE sections (t, h, w frequency pairs, interleaved)
    image_token_id: int = HF_VL_TOKEN_DEFAULTS["image_token_id"]
    video_token_id: int = HF_VL_TOKEN_DEFAULTS["video_token_id"]
    vision_start_token_id: int = HF_VL_TOKEN_DEFAULTS["vision_start_token_id"]
    vision_end_token_id: int = HF_VL_TOKEN_DEFAULTS["vision_end_token_id"]
    mrope_section: tuple[int, int, int] = DEFAULT_MROPE_SECTION

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision hidden_size ({self.hidden_size}) / num_heads ({self.num_heads}) must be a "
                             "multiple of 4 (the tower's 2-D RoPE)")
        side = round(self.num_position_embeddings ** 0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"vision num_position_embeddings ({self.num_position_embeddings}) must be a square")
        if bad := [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]:
            raise ValueError(f"deepstack_visual_indexes {bad} are not blocks of a {self.depth}-block tower")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch (pixel_values' width): channels x frames x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_factor(self) -> int:
        """An image's side must be a multiple of this many pixels (`smart_resize`'s factor)."""
        return self.patch_size * self.spatial_merge_size
