"""What the routers of a Qwen3-MoE model decided in a forward: their logits (`RouterTap`), the load-balancing
auxiliary loss of those logits (`load_balancing_loss`, transformers' `load_balancing_loss_func`), and how often two
forwards of the same tokens (the generator's copy and the trainer's model) routed a token to different experts
(`routing_mismatch`: 0 in batch-invariant mode, by construction).

The tap is a forward hook on each sparse block's router (`mlp.gate`), registered while it is open: the model's
code never checks whether anyone is listening. A forward replayed from a CUDA graph runs no hooks, so a tapped
forward is an eager one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from monorl.model.moe import moe_blocks
from monorl.speedups.private_apis import dynamo_imported


class RouterTap:
    """`with RouterTap(model) as tap: model(...)`, then `tap.logits()`: each sparse layer's router logits [T, E]
    of the forwards run while open (with their autograd graph: the auxiliary loss trains the routers), and
    `tap.experts()`: the experts each token was routed to. A recomputed block (activation checkpointing) records
    again in backward: take what you need before it, or `clear()`."""

    def __init__(self, model: nn.Module) -> None:
        self.blocks = moe_blocks(model)
        if not self.blocks:
            raise ValueError("RouterTap: the model has no mixture-of-experts blocks")
        self._logits: dict[str, list[Tensor]] = {name: [] for name in self.blocks}
        self._hooks: list[Any] = []

    def __enter__(self) -> RouterTap:
        for name, block in self.blocks.items():
            def hook(module: nn.Module, inputs: Any, output: Tensor, name: str = name) -> None:
                self._logits[name].append(output)
            self._hooks.append(getattr(block, block.router_name).register_forward_hook(hook))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def clear(self) -> None:
        for v in self._logits.values():
            v.clear()

    def logits(self) -> list[Tensor]:
        """Per sparse layer (in order), its router logits over every tapped forward's tokens (concatenated)."""
        return [torch.cat(v) if len(v) > 1 else v[0] for v in self._logits.values() if v]

    def experts(self) -> Tensor:
        """[layers, T, k]: the experts each token was routed to, by each layer's own routing (`block.route`)."""
        return torch.stack([self.blocks[name].route(torch.cat(v).detach())[1]
                            for name, v in self._logits.items() if v])


def load_balancing_loss(logits: list[Tensor], num_experts: int, top_k: int) -> Tensor:
    """transformers' `load_balancing_loss_func` without an attention mask (Switch Transformer, eqs. 4-6): E times
    the sum over experts of (the share of top-k assignments it got) x (its mean router probability), over every
    layer's tokens together. Differentiable through the probabilities (the counts are not)."""
    counts = torch.zeros(num_experts, dtype=torch.float32, device=logits[0].device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=logits[0].device)
    rows = 0
    for layer in logits:
        probs = F.softmax(layer.float(), dim=-1)
        selected = torch.topk(probs, top_k, dim=-1)[1]
        counts = counts + F.one_hot(selected.reshape(-1), num_experts).sum(0).float()
        prob_sum = prob_sum + probs.sum(0)
        rows += probs.shape[0]
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))


@dataclass(frozen=True)
class RoutingMismatch:
    tokens: int  # tokens compared (each over every sparse layer)
    tokens_different: int  # tokens routed to a different expert set in at least one layer
    layer_routings_different: int  # (token, layer) pairs whose expert sets differ
    layer_routings: int

    @property
    def share(self) -> float:
        """The share of tokens whose routing differs (in any layer): 0 in batch-invariant mode."""
        return self.tokens_different / self.tokens if self.tokens else 0.0

    def text(self) -> str:
        return (f"routing: tokens checked {self.tokens}, tokens routed differently {self.tokens_different} "
                f"({self.share:.2%}), (token, layer) routings different {self.layer_routings_different} of "
                f"{self.layer_routings}")


def compare_routing(a: Tensor, b: Tensor) -> RoutingMismatch:
    """Two forwards' `RouterTap.experts()` [layers, T, k] of the same tokens: where the expert *sets* differ (the
    order within a token's k is the probabilities' order, which does not change its output's set of experts)."""
    if a.shape != b.shape:
        raise ValueError(f"routing of shape {tuple(a.shape)} against {tuple(b.shape)}: not the same tokens")
    differs = (a.sort(-1).values != b.sort(-1).values).any(-1)  # [layers, T]
    return RoutingMismatch(tokens=a.shape[1], tokens_different=int(differs.any(0).sum()),
                           layer_routings_different=int(differs.sum()), layer_routings=differs.numel())


@torch.no_grad()
def routing_mismatch(first: nn.Module, second: nn.Module, forward_first: Any, forward_second: Any) -> RoutingMismatch:
    """Run `forward_first()` (a forward of `first` over some tokens) and `forward_second()` (of `second` over the
    same tokens, in the same order) with their routers tapped, and compare which experts each token went to."""
    with RouterTap(first) as ta:
        forward_first()
    with RouterTap(second) as tb:
        forward_second()
    return compare_routing(ta.experts(), tb.experts())


def generator_trainer_routing(generator_model: nn.Module, trainer_model: nn.Module, autocast: torch.dtype | None,
                              sequences: list[list[int]]) -> RoutingMismatch:
    """Which experts each token of `sequences` goes to in the generator's copy (in its own dtype) and in the
    trainer's model (under the trainer's autocast dtype, `Trainer.autocast_dtype`), each one eager forward over
    the sequences laid out whole (`monorl parity`'s routing line; the RL loop's `moe/routing_mismatch`)."""
    from monorl.model.attention import VarlenContext, resolve_backend

    def forward(model: nn.Module, dtype: torch.dtype | None):
        p = next(model.parameters())
        ctx = VarlenContext.from_lengths([len(s) for s in sequences], p.device,
                                         resolve_backend("auto", p.device, dtype or p.dtype))
        flat = torch.tensor([t for s in sequences for t in s], device=p.device)

        def run() -> None:
            # compiled blocks run eagerly (their hooks then fire); a run that compiles nothing never imports Dynamo
            eager = (torch.compiler.set_stance("force_eager") if dynamo_imported()
                     else contextlib.nullcontext())
            with eager, torch.autocast(p.device.type, dtype=dtype, enabled=dtype is not None):
                model(flat, ctx.positions, ctx)
        return run

    return routing_mismatch(generator_model, trainer_model, forward(generator_model, None),
                            forward(trainer_model, autocast))
