"""Tensor-parallel generation (`generator.tensor_parallel_size N`, vLLM's name): N ranks of one node hold one
generator copy between them, for models whose bf16 copy does not fit one GPU beside the trainer's shard.

Placement, per TP rank r of N (Megatron's):
- q/k/v (one fused `qkv_proj`) column-sharded by heads: rank r owns q heads [r Hq/N, (r+1) Hq/N) and kv heads
  [r Hkv/N, (r+1) Hkv/N) -- the kv heads its q heads read under GQA -- so attention is rank-local, and the KV
  cache holds the rank's kv heads only (the layers and the cache are built from `shard_config`, whose head counts
  are the rank's; the copy's `.config` stays the whole model's);
- gate/up (one fused `gate_up_proj`) column-sharded: rank r owns intermediate columns [r I/N, (r+1) I/N);
- o_proj and down_proj row-sharded (their input features the rank's heads / columns): each rank's product is a
  partial sum, summed over the ranks right after (`row_parallel_sum`, a forward hook on the projection); a bias
  (Llama's attention_bias o_proj) is rank 0's alone, zeros elsewhere, so the sum adds it once;
- the LM head vocabulary-parallel: rank r computes logits [r V/N, (r+1) V/N) and the runner gathers the full row
  on every rank (`gather_vocab`); the sampler then runs unchanged on every rank, keyed by (seed, sequence,
  position), so every rank samples the same token and TP=1 and TP=N draw the same noise per token. The cost: an
  all-gather of [rows, V] logits per step (64 rows x 151,936 x 2 bytes = 19 MB for Qwen3 at bf16) and the sampler
  run N times over, once per rank, instead of a max / sum all-reduce over vocabulary shards;
- a sparse layer's experts each cut like the MLP (their columns; how, per parameter, the experts' class says:
  `TP_SHARDS`), the router whole, the block's output summed over the ranks; GPT-OSS's sink logits by q heads;
- embeddings and norms replicated. A tied head (Qwen3 up to 4B) gets its own [V/N, hidden] copy of its rows of the
  embedding (the embedding itself stays whole on every rank).

Every rank of the group runs the same host-side schedule: the same prompts, the same KV block count
(`Generator.allocate_kv_cache` takes the group's minimum), the same sampled tokens (the logits are equal on every
rank). Weight sync (`TensorParallelPlacement`) gives each rank its slices of the trainer's weights; from an
FSDP-sharded trainer whose FSDP ranks are the TP group (`--nproc N --generator.tensor_parallel_size N`) each rank
cuts its piece from its own shard: column-parallel rows and the head's vocabulary rows are the shard itself,
row-parallel columns take one all-to-all of 1/N of each shard, and only the replicated parameters (embedding,
norms) are all-gathered, one at a time; any other layout all-gathers the shards in buckets and slices them.

Bitwise parity: a row-parallel product is summed over ranks after each rank rounded its partial product, so the
generator's log-probs differ from the trainer's in the last bits (its o / down GEMMs reduce over the whole K in
one order): `logprob_diff` is no longer 0 in batch-invariant mode. Keeping that equality would need the trainer to
split those two products' K as the generator does. What is kept: with `fixed_order=True` (meant for batch-invariant
runs) the partials are all-gathered and summed in rank order in fp32, so a token's result depends neither on the
batch nor on the algorithm NCCL picks by message size (ring or tree, from N = 4), and TP=N runs reproduce each
other -- batch invariance within the generator. The cost: N x an all-reduce's receive bytes per sum. For N = 2 an
all-reduce gives the same bits already (one commutative add, rounded once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from monorl.distributed.world import World, all_gather_single
from monorl.model.config import ModelConfig
from monorl.model.decoder import DecoderForCausalLM, materialize_
from monorl.model.layers import Linear

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output rows sharded
ROW_PARALLEL = ("o_proj", "down_proj")  # input columns sharded; outputs summed over ranks

Take = Callable[[Tensor], Tensor]  # a full source tensor -> this rank's piece of it


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group (size 1: no tensor parallelism)."""

    size: int = 1
    rank: int = 0
    group: Any = None  # the torch.distributed process group of the ranks sharing one generator copy
    fixed_order: bool = False  # row-parallel sums in rank order (module docstring), e.g. in batch-invariant mode

    def min_int(self, n: int) -> int:
        """The least of `n` over the group (so that every rank sizes alike)."""
        if self.size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=_collective_device(self.group))
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def broadcast_int(self, n: int) -> int:
        """The group's first rank's `n` on every rank of the group."""
        if self.size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=_collective_device(self.group))
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
        return int(t.item())


NO_TP = TensorParallel()


def _collective_device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def tensor_parallel_group(rank: int, world_size: int, size: int, fixed_order: bool = False) -> TensorParallel:
    """This rank's group of `size` consecutive ranks ([k N, (k+1) N): one node's GPUs when N divides the GPUs per
    node). Every rank of the job must call it (creating groups is a collective); size 1 creates none."""
    if size < 1 or world_size % size:
        raise ValueError(f"generator.tensor_parallel_size={size} does not divide the {world_size} ranks")
    if size == 1:
        return NO_TP
    mine = None
    for k in range(world_size // size):
        ranks = list(range(k * size, (k + 1) * size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = TensorParallel(size, rank - k * size, group, fixed_order)
    assert mine is not None
    return mine


def generation_world(world: World, tp: TensorParallel) -> World:
    """The ranks as generation shares the step's prompt groups: one member per TP group (the group's ranks generate
    the same groups together), for `World.share`; `world` itself without tensor parallelism."""
    return world if tp.size == 1 else World(rank=world.rank // tp.size, size=world.size // tp.size)


def gathered_once(items: list, tp: TensorParallel) -> list:
    """What a rank hands `World.gather_lists` of what its TP group generated: its first rank's items alone, so
    that each group's results come back once, in group order."""
    return items if tp.rank == 0 else []


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """Refuse, in one line, a degree that does not divide the model's heads, kv heads, MLP width or vocabulary."""
    if size < 1:
        raise ValueError(f"generator.tensor_parallel_size must be >= 1, got {size}")
    if size > 1 and "linear_attention" in cfg.layer_types:
        raise ValueError(f"generator.tensor_parallel_size={size}: Gated DeltaNet (linear_attention) layers are not "
                         "sharded yet (their heads and state rows): use 1 for a Qwen3.5 model")
    if size > 1 and cfg.shared_expert_intermediate_size:
        raise ValueError(f"generator.tensor_parallel_size={size}: a shared expert (Qwen3.5-MoE) is not sharded yet: "
                         "use 1")
    sizes = [("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads),
             ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)]
    for what, n in sizes + ([("moe_intermediate_size", cfg.moe_intermediate_size)] if cfg.is_moe else []):
        if n % size:
            raise ValueError(f"generator.tensor_parallel_size={size} does not divide the model's {what}={n}: each "
                             f"rank holds an equal share (use a divisor of {n})")


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """One rank's config: its heads, kv heads and MLP columns, every expert's too (the KV cache and the layers'
    shapes follow)."""
    check_tensor_parallel(cfg, size)
    return cfg.replace(num_heads=cfg.num_heads // size, num_kv_heads=cfg.num_kv_heads // size,
                       intermediate_size=cfg.intermediate_size // size,
                       moe_intermediate_size=cfg.moe_intermediate_size // size)


def build_tensor_parallel_model(cfg: ModelConfig, tp: TensorParallel, device: torch.device | str,
                                dtype: torch.dtype, fused: bool = True) -> DecoderForCausalLM:
    """This rank's shard of the generator's copy (uninitialised: weight sync fills it), its row-parallel
    projections summed over the group after each forward."""
    with torch.device("meta"):
        model = DecoderForCausalLM(shard_config(cfg, tp.size), fused)
        model.lm_head = Linear(cfg.hidden_size, cfg.vocab_size // tp.size, bias=False)  # tied too: its own rows
    materialize_(model, device, dtype)
    # its config stays the model's (an exported config.json, the vocabulary the engine checks), as an FSDP-sharded
    # policy's does; the layers are built from the rank's shard of it
    model.config = cfg
    experts: dict[str, dict] = {}  # a sparse layer's stacked experts, by attribute name: their `TP_SHARDS`
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if leaf in ROW_PARALLEL:
            module.row_parallel = True  # `fused_kernels.project` must not hand its parts on unsummed
            module.register_forward_hook(lambda _m, _inp, out: row_parallel_sum(out, tp))
        elif getattr(module, "router_name", None):  # a sparse block (`moe.moe_blocks`' test): each expert's down
            module.register_forward_hook(lambda _m, _inp, out: row_parallel_sum(out, tp))  # projection row-parallel
        if (shards := getattr(module, "TP_SHARDS", None)) is not None:
            if experts.setdefault(leaf, shards) != shards:
                raise ValueError(f"tensor parallelism: two expert layouts named {leaf!r} in one model")
    model.weight_place = TensorParallelPlacement(tp, experts)  # what `weight_sync.sync_weights_` cuts for this rank
    return model


def row_parallel_sum(out: Tensor, tp: TensorParallel) -> Tensor:
    """The sum over the group of each rank's partial product: an all-reduce, or (`tp.fixed_order`) the partials
    all-gathered and summed in rank order in fp32, the same bits on every rank whatever the batch."""
    if tp.size == 1:
        return out
    if not tp.fixed_order:
        dist.all_reduce(out, group=tp.group)
        return out
    parts = _all_gather(out, tp)
    acc = parts[0].float()
    for i in range(1, tp.size):
        acc += parts[i]
    return acc.to(out.dtype)


def gather_vocab(logits: Tensor, tp: TensorParallel) -> Tensor:
    """[rows, V/N] logits of this rank's vocabulary shard -> the full [rows, V] on every rank (exact: each logit is
    one rank's dot product over the whole hidden size, as without TP)."""
    if tp.size == 1:
        return logits
    return _all_gather(logits, tp).permute(1, 0, 2).reshape(logits.shape[0], -1)


def _all_gather(t: Tensor, tp: TensorParallel) -> Tensor:
    """[N, *t.shape]: every rank's `t`, in rank order (one collective into one tensor)."""
    parts = t.new_empty((tp.size * t.shape[0], *t.shape[1:]))
    all_gather_single(parts, t.contiguous(), group=tp.group)
    return parts.view(tp.size, *t.shape)


def _rows(t: Tensor, tp: TensorParallel, dim: int) -> Tensor:
    n = t.shape[dim] // tp.size
    return t.narrow(dim, tp.rank * n, n)


@dataclass(frozen=True)
class Slice:
    """A Take: this rank's 1/N of a tensor along `dim` (0: a column-parallel projection's output rows or the head's
    vocabulary rows; 1: a row-parallel projection's input columns)."""

    tp: TensorParallel
    dim: int

    def __call__(self, t: Tensor) -> Tensor:
        return _rows(t, self.tp, self.dim)

    def from_shard(self, local: Tensor, whole: torch.Size) -> Tensor:
        """The slice straight from this rank's FSDP shard (`local`: rows [r R/N, (r+1) R/N) of a `whole`-shaped
        tensor sharded by rows over the TP group's ranks: `TensorParallelPlacement.fits_shard`): rows are the shard
        itself; columns take one all-to-all of 1/N of the shard (each rank sends every other its columns of its
        rows)."""
        if self.dim == 0:
            return local
        n = self.tp.size
        cols = whole[1] // n
        send = torch.stack([local[:, j * cols:(j + 1) * cols] for j in range(n)])  # [N, R/N, cols]
        got = torch.empty_like(send)
        dist.all_to_all_single(got, send, group=self.tp.group)  # got[k]: rank k's rows of my columns
        return got.reshape(whole[0], cols)


@dataclass(frozen=True)
class ExpertSlice:
    """A Take for a sparse layer's stacked experts: every expert's 1/N of its MLP columns along `dim`, as the
    experts' class declares (`TP_SHARDS`): "halves" cuts the gate half and the up half alike (Qwen3-MoE's
    `gate_up_proj` [E, 2I, H]); "once" keeps a bias the row-parallel sum adds once on rank 0 (zeros elsewhere)."""

    tp: TensorParallel
    dim: int
    how: str = ""

    def __call__(self, t: Tensor) -> Tensor:
        if self.how == "once":
            return t if self.tp.rank == 0 else torch.zeros_like(t)
        if self.how == "halves":
            return torch.cat([_rows(half, self.tp, self.dim) for half in t.chunk(2, dim=self.dim)], dim=self.dim)
        return _rows(t, self.tp, self.dim)


class TensorParallelPlacement:
    """For weight sync (`monorl.distributed.weight_sync.sync_weights_(place=...)`): (source name, destination name) ->
    the Take that cuts this rank's piece from the full source tensor (a `Slice`, or the bias rule below), or None
    for a whole copy; and whether a source's FSDP shard lets `Slice.from_shard` cut it (`fits_shard`)."""

    def __init__(self, tp: TensorParallel, experts: dict[str, dict] | None = None) -> None:
        self.tp = tp
        self.experts = experts or {}  # a sparse layer's experts, by attribute name: their `TP_SHARDS`

    def fits_shard(self, param: Any) -> bool:
        """Whether `param` (an FSDP2 parameter) is sharded by rows evenly over exactly the TP group's ranks, in
        their order (a run whose FSDP ranks are one TP group: `--nproc N --generator.tensor_parallel_size N`)."""
        from torch.distributed.tensor import DTensor, Shard  # a one-process run never imports DTensor (~1.5 s)

        if not isinstance(param, DTensor) or tuple(param.placements) != (Shard(0),) or param.device_mesh.ndim != 1:
            return False
        return (dist.get_process_group_ranks(param.device_mesh.get_group())
                == dist.get_process_group_ranks(self.tp.group) and all(d % self.tp.size == 0 for d in param.shape[:2]))

    def __call__(self, src: str, dst: str) -> Take | None:
        tp = self.tp
        module, _, leaf = src.rpartition(".")
        proj = module.rpartition(".")[2]
        if proj in COLUMN_PARALLEL:
            return Slice(tp, 0)
        if proj in ROW_PARALLEL:
            if leaf == "bias":  # added once: by rank 0
                return (lambda t: t) if tp.rank == 0 else torch.zeros_like
            return Slice(tp, 1)
        if dst == "lm_head.weight":  # the head's vocabulary rows (a tied head: the embedding's)
            return Slice(tp, 0)
        if leaf == "sinks":  # GPT-OSS's sink logit per q head: the rank's heads'
            return Slice(tp, 0)
        if proj in self.experts:  # a sparse layer's stacked experts (the router stays whole)
            return ExpertSlice(tp, *self.experts[proj][leaf])
        return None
