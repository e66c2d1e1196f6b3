"""The vision tower of Qwen3-VL (and of Qwen3.5, which shares it): patches -> ViT blocks with 2-D RoPE -> a 2x2
patch merger into the text decoder's width, plus the DeepStack features (merged outputs of some middle blocks) that
the decoder adds to its first layers' hidden states at the image tokens.

Parameter names equal transformers' `Qwen3VLVisionModel` (checkpoints say `model.visual.<name>`). Its input is a
`VisionInputs` (`monorl.model.vision_inputs`): HF's `pixel_values [patches, C * t * p * p]` in
`monorl.model.image_processing`'s order (merge blocks contiguous) and the grids' (frames, patch rows, patch columns
per image) position and RoPE tables, all on the device before the forward (a CUDA graph captures the tower). The
images of one call attend only within themselves (per frame), so a call over several images equals one call per
image.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from monorl.model.layers import Linear, embedding
from monorl.model.vision_config import VisionConfig
from monorl.model.vision_inputs import VisionInputs, table_settings


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class PatchEmbed(nn.Module):
    """HF's Conv3d with stride = kernel over (frames, patch, patch): one Linear over each flattened patch (the same
    products; the weight keeps the Conv3d's 5-D shape so checkpoints load as they are)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Module()
        shape = (cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj.weight = nn.Parameter(torch.empty(shape))
        self.proj.bias = nn.Parameter(torch.empty(cfg.hidden_size))

    def forward(self, pixels: Tensor) -> Tensor:
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.flatten(1), self.proj.bias)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))  # HF: gelu_pytorch_tanh


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, lengths: list[int]) -> Tensor:
        """cos / sin: [T, 1, 1, head_dim] fp32 (`VisionInputs`)."""
        T = x.shape[0]
        qkv = self.qkv(x).view(T, 3, self.num_heads, self.head_dim)
        # RoPE in fp32, back to the activations' dtype (HF's apply_rotary_pos_emb_vision), on q and k together:
        # the same products per element as one at a time, in half the launches
        qk = qkv[:, :2].float()
        qk = (qk * cos + _rotate_half(qk) * sin).to(qkv.dtype)
        q, k, v = qk[:, 0], qk[:, 1], qkv[:, 2]
        # [batch, heads, L, D] calls (4-D: the fused kernels serve them, a 3-D call ran the math path on CUDA), one
        # batch entry per image (frame); images of one size in one call: each entry computes as it would alone
        if len(set(lengths)) == 1:
            n, L = len(lengths), lengths[0]
            out = F.scaled_dot_product_attention(
                *(t.reshape(n, L, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v)))
            out = out.transpose(1, 2)
        else:
            out = torch.cat([F.scaled_dot_product_attention(qi[None], ki[None], vi[None]).transpose(1, 2)[0]
                             for qi, ki, vi in zip(*(t.transpose(0, 1).split(lengths, 1) for t in (q, k, v)),
                                                   strict=True)])
        return self.proj(out.reshape(T, -1))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, lengths: list[int]) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge x merge neighbouring patches (contiguous rows, by the patch order) -> one token of out_hidden_size.
    postshuffle: the LayerNorm over the concatenated patches (the DeepStack mergers) rather than each patch."""

    def __init__(self, cfg: VisionConfig, postshuffle: bool = False) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = Linear(self.width, self.width, bias=True)
        self.linear_fc2 = Linear(self.width, cfg.out_hidden_size, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """images (`VisionInputs`) -> (image embeddings [tokens, out_hidden], DeepStack features: one such per
    `deepstack_visual_indexes` entry), tokens = sum over images of t * h * w / merge^2, in the images' order."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(cfg, postshuffle=True)
                                                   for _ in cfg.deepstack_visual_indexes)

    def forward(self, inputs: VisionInputs) -> tuple[Tensor, list[Tensor]]:
        """inputs: made before the forward (`vision_inputs`): nothing here reads the host or copies to the device."""
        if inputs.tables_for != table_settings(self.config):
            raise ValueError(f"the images' tables were made for a tower of {inputs.tables_for} (merge, position "
                             f"embeddings, head_dim, rope_theta), this tower is {table_settings(self.config)}")
        x = self.patch_embed(inputs.pixel_values)
        x = x + (self.pos_embed(inputs.pos_index) * inputs.pos_weight[:, :, None]).sum(1).to(x.dtype)
        lengths = inputs.lengths  # attention within each frame of each image
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, inputs.cos, inputs.sin, lengths)
            if i in self.config.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.config.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack
