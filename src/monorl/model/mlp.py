"""The dense SiLU-gated MLP every family's layer (and Qwen3.5-MoE's shared expert) is built from; its own module so
`monorl.model.moe` and `monorl.model.blocks` both import it without importing each other."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from monorl.model.config import ModelConfig
from monorl.model.layers import Linear


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (a family with another gate activation subclasses it, `act`)."""

    act = staticmethod(F.silu)

    def __init__(self, cfg: ModelConfig, fused: bool = False) -> None:
        super().__init__()
        self.fused, self.intermediate_size = fused, cfg.intermediate_size
        if fused:
            self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        else:
            self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
            self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).split([self.intermediate_size, self.intermediate_size], dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)
