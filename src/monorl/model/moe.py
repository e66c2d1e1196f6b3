"""The sparse mixture-of-experts MLP of Qwen3-MoE and Qwen3.5-MoE (`SparseMoeBlock`), in a sparse layer's place of
the dense MLP.

A router (`gate`, a `Linear` [E, hidden]) scores each token's experts; the token goes to its top-k by softmax
probability, weighted by those probabilities (renormalised to sum to 1 with `norm_topk_prob`), and its output is
the weighted sum of the k experts' SiLU-gated MLPs. Names and layouts are transformers' 5.x `Qwen3MoeSparseMoeBlock`:
`mlp.gate.weight`, `mlp.experts.gate_up_proj` [E, 2I, hidden] (each expert's gate rows, then its up rows) and
`mlp.experts.down_proj` [E, hidden, I]: one stacked tensor per projection, so FSDP2 shards the experts on dim 0
and a grouped kernel reads one tensor. Checkpoints store experts one by one (`monorl.model.expert_stacking`).

The experts run by one of four paths, each exact (the same products per token as the per-expert loop):
- `experts_gathered`: a decode step's few tokens: each (token, slot)'s expert weights gathered (index_select), one
  bmm per projection. No Python loop over experts, no shape that depends on the routing: CUDA-graph capturable.
- `experts_grouped_mm`: tokens sorted by expert, `torch._grouped_mm` with the experts' row offsets (CUDA, bf16,
  sm90+; forward and backward), also without host reads, so prefills and trainer packs can be captured.
- `experts_loop`: tokens sorted by expert, one product per expert on its contiguous slice (CPU, or where grouped_mm
  does not serve); reads the per-expert counts on the host.
- batch-invariant mode (`BatchInvariantSparseMoeBlock`, by `monorl.model.batch_invariant`): every product is the
  invariant GEMM (`matmul_invariant.linear`, a row's value depends only on that row), so a token's expert outputs
  are the same bits whichever tokens share its batch: the loop on slices for packs, and for decode steps (and any
  forward under CUDA-graph capture) every expert over all rows, each row then taking its own k (fixed shapes).
  The router's softmax and the top-k weight sum are fixed-order (`tree_sum`), so both sides route alike.

Every path sums a token's k weighted outputs in its own slot order (`_combine`), a function of the token alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from monorl.model.config import ModelConfig
from monorl.model.layers import Linear
from monorl.model.mlp import MLP
from monorl.ops import matmul_invariant
from monorl.ops.gated_delta_invariant import pointwise
from monorl.ops.tree_sum import tree_sum
from monorl.speedups.private_apis import grouped_mm

# the gathered decode path's transient weight copies, at most (above it: grouped_mm, or the loop)
GATHER_MAX_BYTES = 64 << 20
GROUP_ALIGN = 8  # rows: where each expert's rows start in grouped_mm's operands (16 bytes of bf16)

LinearFn = Callable[[Tensor, Tensor], Tensor]


class Experts(nn.Module):
    """E SiLU-gated MLPs as two stacked parameters (transformers' `Qwen3MoeExperts` names and layout)."""

    # tensor-parallel generation (`monorl.generate.tensor_parallel.ExpertSlice`): per parameter, the dim holding each
    # expert's MLP columns and how a rank takes its 1/N: "halves" (gate rows, then up rows: each half cut alike)
    TP_SHARDS = {"gate_up_proj": (1, "halves"), "down_proj": (2, "")}

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


def softmax_invariant(logits: Tensor) -> Tensor:
    """softmax over the last dim in fp32 with a fixed-order sum: a row's value depends on that row alone."""
    z = logits.float()
    e = (z - z.amax(-1, keepdim=True)).exp()
    return e / tree_sum(e).unsqueeze(-1)


def route(logits: Tensor, top_k: int, norm_topk_prob: bool, invariant: bool = False) -> tuple[Tensor, Tensor]:
    """transformers' `Qwen3MoeTopKRouter` on router logits [T, E]: (weights [T, k] in the logits' dtype, experts
    [T, k] int64), the top-k of the fp32 softmax, renormalised when norm_topk_prob. invariant: fixed-order sums."""
    probs = softmax_invariant(logits) if invariant else F.softmax(logits, dim=-1, dtype=torch.float)
    top, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top = top / (tree_sum(top) if invariant else top.sum(-1)).unsqueeze(-1)
    return top.to(logits.dtype), experts


def _expert_mlp(x: Tensor, gate_up: Tensor, down: Tensor, linear: LinearFn = F.linear) -> Tensor:
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down)


def _combine(y: Tensor, weights: Tensor) -> Tensor:
    """y [T * k, H] in (token, slot) order, weights [T, k] -> [T, H]: each token's weighted sum, slot by slot."""
    T, k = weights.shape
    y = y.view(T, k, y.shape[-1])
    w = weights.to(y.dtype)
    out = y[:, 0] * w[:, 0, None]
    for j in range(1, k):
        out = out + y[:, j] * w[:, j, None]
    return out


def _sort_by_expert(experts: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """(order, inverse, counts): the (token, slot) pairs sorted by expert (stable), the permutation back, and each
    expert's count, all on the device (no host read)."""
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat,
                                                                                          torch.ones_like(flat))
    return order, inverse, counts


def experts_loop(x: Tensor, weights: Tensor, experts: Tensor, gate_up: Tensor, down: Tensor,
                 linear: LinearFn = F.linear) -> Tensor:
    """The experts by one product per expert on its contiguous slice of the sorted tokens (reads the counts)."""
    k = experts.shape[1]
    order, inverse, counts = _sort_by_expert(experts, gate_up.shape[0])
    xs = x[order // k]
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            outs.append(_expert_mlp(xs[start:start + n], gate_up[e], down[e], linear))
            start += n
    if not outs:  # no tokens at all
        return x.new_zeros(x.shape[0], down.shape[1])
    return _combine(torch.cat(outs)[inverse], weights)


def grouped_rows(x: Tensor, experts: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """(xs [R, hidden], offs [E] int32, row [T * k]): each (token, slot)'s row of x placed in its expert's group of
    xs, `offs` the groups' ends for `torch._grouped_mm`, `row` where each slot's output lands. Each group starts at a
    multiple of `GROUP_ALIGN` (zero rows between): the weight gradient's grouped GEMM runs over the rows as its K dim,
    whose group starts its TMA loads need 16-byte aligned (TorchTitan pads the same way). R is a bound of the shapes
    alone, so a CUDA graph holds it; no host read."""
    T, k = experts.shape
    E = num_experts
    order, inverse, counts = _sort_by_expert(experts, E)
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    ends = padded.cumsum(0)
    sorted_experts = experts.reshape(-1)[order]
    # sorted slot i -> its row: its expert's padded start + its rank among that expert's slots
    rank = torch.arange(order.numel(), device=x.device) - (counts.cumsum(0) - counts)[sorted_experts]
    rows = (ends - padded)[sorted_experts] + rank
    total = -(-(T * k + E * (GROUP_ALIGN - 1)) // GROUP_ALIGN) * GROUP_ALIGN  # >= ends[-1]
    offs = torch.cat([ends[:-1], ends.new_full((1,), total)]).to(torch.int32)  # the last group takes the tail
    xs = x.new_zeros(total, x.shape[1]).index_copy(0, rows, x[order // k])
    return xs, offs, rows[inverse]


def experts_grouped_mm(x: Tensor, weights: Tensor, experts: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """The experts by `torch._grouped_mm` over the tokens grouped by expert (`grouped_rows`): one launch per
    projection, no host read."""
    xs, offs, row = grouped_rows(x, experts, gate_up.shape[0])
    gate, up = grouped_mm(xs, gate_up.transpose(1, 2), offs).chunk(2, dim=-1)
    y = grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs)
    return _combine(y[row], weights)


def experts_gathered(x: Tensor, weights: Tensor, experts: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """The experts by gathering each (token, slot)'s expert weights and one bmm per projection (few tokens)."""
    T, k = experts.shape
    flat = experts.reshape(-1)
    xr = x[:, None].expand(T, k, x.shape[-1]).reshape(T * k, -1, 1)
    gate, up = torch.bmm(gate_up.index_select(0, flat), xr).squeeze(-1).chunk(2, dim=-1)
    y = torch.bmm(down.index_select(0, flat), (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
    return _combine(y, weights)


def experts_every_expert(x: Tensor, weights: Tensor, experts: Tensor, gate_up: Tensor, down: Tensor,
                         linear: LinearFn = matmul_invariant.linear) -> Tensor:
    """Every expert over all T rows (E products of fixed shapes), then each row takes its own k outputs: the
    batch-invariant decode path (with a row-invariant `linear`, row t's outputs are those of any other batch)."""
    T, k = experts.shape
    every = torch.stack([_expert_mlp(x, gate_up[e], down[e], linear) for e in range(gate_up.shape[0])])
    rows = torch.arange(T, device=x.device).repeat_interleave(k)
    return _combine(every[experts.reshape(-1), rows], weights)


def grouped_mm_serves(device: torch.device, hidden_size: int, intermediate_size: int) -> bool:
    """Whether `torch._grouped_mm` can run bf16 experts of these widths here: CUDA sm90+, both widths multiples of 8
    (16-byte rows). Elsewhere a pass with gradients runs the loop, which reads counts on the host (no capture)."""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9 and hidden_size % 8 == 0 and intermediate_size % 8 == 0


def grouped_mm_fits(x: Tensor, gate_up: Tensor, down: Tensor) -> bool:
    """Where `torch._grouped_mm` runs the experts: bf16 activations where it serves (`grouped_mm_serves`)."""
    return x.dtype == torch.bfloat16 and grouped_mm_serves(x.device, down.shape[1], down.shape[2])


def expert_path(x: Tensor, experts: Tensor, gate_up: Tensor, down: Tensor) -> str:
    """How a block runs its experts on activations x routed to `experts` [T, k] (any layout of the [E, ...] weights):
    "gathered" without gradients when the slots' weight copies are small or a CUDA graph is being captured where
    grouped_mm does not serve (the loop's host read cannot be captured), "grouped" where grouped_mm serves, else
    "loop". One decision for every MoE family (`SparseMoeBlock`, GPT-OSS's block)."""
    grouped = grouped_mm_fits(x, gate_up, down)
    gather_bytes = experts.numel() * (gate_up[0].numel() + down[0].numel()) * x.element_size()
    if not torch.is_grad_enabled() and (gather_bytes <= GATHER_MAX_BYTES or _capturing(x) and not grouped):
        return "gathered"
    return "grouped" if grouped else "loop"


def _capturing(x: Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the experts compute in: autocast's where it is on (the trainer), else the activations'."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class SparseMoeBlock(nn.Module):
    """A sparse layer's MLP (see the module docstring): `gate` (the router) and `experts`; with
    `shared_expert_intermediate_size` (Qwen3.5-MoE, transformers' `Qwen3_5MoeSparseMoeBlock`) also a `shared_expert`
    MLP every token takes, added times sigmoid(`shared_expert_gate`(x)). fused: the shared expert's gate/up as one
    projection (the generator's copy)."""

    router_name = "gate"  # its router's attribute: `moe_blocks` finds any block that names one (GPT-OSS: "router")
    sigmoid = staticmethod(torch.sigmoid)  # the shared expert's gate

    def __init__(self, cfg: ModelConfig, fused: bool = False) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = (cfg.num_experts, cfg.num_experts_per_tok,
                                                             cfg.norm_topk_prob)
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert: nn.Module | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg.replace(intermediate_size=cfg.shared_expert_intermediate_size), fused)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def route(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """(weights [T, k], experts [T, k]) of router logits [T, E]."""
        return route(logits, self.top_k, self.norm_topk_prob)

    def forward(self, x: Tensor) -> Tensor:
        weights, experts = self.route(self.gate(x))
        out = self.run_experts(x.to(compute_dtype(x)), weights, experts)
        if self.shared_expert is not None:
            out = out + self.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def run_experts(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        gate_up, down = self.experts.gate_up_proj.to(x.dtype), self.experts.down_proj.to(x.dtype)
        path = expert_path(x, experts, gate_up, down)
        if path == "gathered":
            return experts_gathered(x, weights, experts, gate_up, down)
        if path == "grouped":
            return experts_grouped_mm(x, weights, experts, gate_up, down)
        return experts_loop(x, weights, experts, gate_up, down)


class BatchInvariantSparseMoeBlock(SparseMoeBlock):
    """The block in batch-invariant mode (see the module docstring); made by `make_batch_invariant_`."""

    # the shared expert's gate [T, 1]: every element by ATen's SIMD form, whatever T (`pointwise`)
    sigmoid = staticmethod(functools.partial(pointwise, torch.sigmoid))

    def route(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        return route(logits, self.top_k, self.norm_topk_prob, invariant=True)

    def run_experts(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        # the fp32 masters as they are: the invariant linear casts each to x's dtype (and keeps its gradient fp32)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        # (a trainer pack, with gradients, is never captured here: the trainer keeps a batch-invariant MoE eager)
        if not torch.is_grad_enabled() and (experts.numel() <= self.num_experts or _capturing(x)):
            return experts_every_expert(x, weights, experts, gate_up, down)
        return experts_loop(x, weights, experts, gate_up, down, matmul_invariant.linear)


def moe_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """Module name (without a `torch.compile` prefix) -> sparse block, in layer order."""
    return {n.replace("_orig_mod.", ""): m for n, m in model.named_modules()
            if isinstance(getattr(type(m), "router_name", None), str)}
