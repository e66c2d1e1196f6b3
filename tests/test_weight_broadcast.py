"""Disaggregated placement on CPU (gloo, three real processes): one generator rank and two FSDP2 trainer ranks.
After a trainer step the generator's fused bf16 copy, written in place by `WeightBroadcast`, equals bitwise what
`sync_weights_` writes from the full trainer model in one process; the version travels with it; LoRA too (merged
into the fused copy, or into a copy with the same adapters); a generator polls for an update without blocking;
rollouts reach every trainer; a copy that does not fit is the same one-line error on every rank; the colocated
sync's bucketed gather takes awkward shapes whole. Bad placements are refused in one line before any process group
exists."""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from pathlib import Path
from queue import Queue
from threading import Thread
from typing import Any
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp

from monorl.distributed import fsdp
from monorl.distributed.fsdp import shard_model_, shard_rows
from monorl.distributed.placement import Placement, PlacementSection, check_placement
from monorl.distributed.weight_sync import sync_weights_
from monorl.distributed.world import SINGLE, close_world, init_world
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.lora import LoRAConfig, apply_lora_
from monorl.rl.ranks.rollout_transfer import recv_rollouts, send_rollouts
from monorl.rl.ranks.weight_broadcast import Entry, WeightBroadcast, plan_messages
from monorl.train.packing import TrainSequence
from monorl.train.trainer import Trainer, TrainerConfig

WORLD = 3  # trainers 0 and 1, generator 2
# odd rows: FSDP2's uneven split; the embedding and LM head each larger than a layer: they go in row chunks
CONFIG = dataclasses.replace(model_shape("tiny-untied"), vocab_size=1025)
LORA = LoRAConfig(rank=4, alpha=8.0)
ROLLOUTS = [{"tokens": [1, 2, 3], "reward": 0.5}, {"tokens": [4], "reward": -1.0}]  # a generator's share
SEQS = [TrainSequence([5, 9, 2, 7, 11], [3, 4, 5, 6], [0.0] * 4, 0.0),
        TrainSequence([8, 1, 3], [12, 40, 7, 7, 2, 9], [0.0] * 6, 0.0)]


def policy(lora: bool) -> torch.nn.Module:
    model = build_model(CONFIG, seed=0)
    if lora:
        apply_lora_(model, LORA, seed=1)
        with torch.no_grad():  # B starts at zero: make the merge visible from the first publication
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    return model


def train_step(model: torch.nn.Module, world: Any = None) -> None:
    cfg = TrainerConfig(lr=1e-2, warmup_steps=1, schedule="constant")
    tr = Trainer(model, cfg, total_steps=1, **({"world": world} if world is not None else {}))
    tr.sft_step(SEQS)


KINDS = ("full", "lora", "unmerged")  # full fine-tuning; LoRA merged into the fused copy; LoRA kept as adapters


def generator_copy(kind: str = "full", config: Any = CONFIG) -> torch.nn.Module:
    """The generator's copy: fused bf16, or for "unmerged" (a batch-invariant LoRA run's) unfused with the same
    adapters, fp32 beside a bf16 base (one message then holds two dtypes)."""
    if kind == "unmerged":
        model = apply_lora_(build_model(config, seed=None), LORA, base_dtype=torch.bfloat16)
    else:
        model = build_model(config, dtype=torch.bfloat16, seed=None, fused=True)
    return model.requires_grad_(False).eval()


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def worker(rank: int, port: int, out: str, device_type: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)

    world = init_world(device_type, timeout_s=60)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    placement = Placement.build(world, PlacementSection(generator_ranks=1))
    result: dict[str, Any] = {"role": placement.role, "trainers": placement.trainers,
                              "generators": placement.generators, "from_rank0": world.broadcast(f"r{rank}")}
    if placement.role == "trainer":  # the trainer World's collectives run among the trainers alone
        result["trainer_sum"] = int(placement.trainer_world.all_reduce_(torch.tensor([rank + 1], device=device)).item())
        result["awkward"] = awkward_gathers(placement.trainer_world.group, device)
    for key in KINDS:
        lora = key != "full"
        if placement.role == "trainer":
            model = policy(lora).to(device)
            shard_model_(model, device, group=placement.trainer_world.group)
            colocated_copy = generator_copy(key).to(device)  # what sync_weights_ writes from the sharded trainers
            wb = WeightBroadcast(placement, model)
            wb.send_(0)
            sync_weights_(colocated_copy, model)  # gathers block by block: a trainer-group collective
            first = state(colocated_copy)
            rollouts = recv_rollouts(placement)  # the generator's step, made with version 0
            train_step(model, placement.trainer_world)
            wb.send_(1)
            # a sync's all-gathers in buckets of a few parameters (the first took the whole model in one)
            with mock.patch.object(fsdp, "GATHER_BUCKET_BYTES", 4096):
                sync_weights_(colocated_copy, model)
            full = {n: p.full_tensor().cpu() for n, p in model.named_parameters()}  # a trainer-group collective
            result[f"{key} rollouts"] = rollouts
            if placement.trainer_index == 0:
                result[key] = {"trained": full, "first": first, "second": state(colocated_copy)}
        else:
            gen = generator_copy(key).to(device)
            ptrs = [p.data_ptr() for p in gen.parameters()]
            wb = WeightBroadcast(placement, gen)
            deadline = time.monotonic() + 60
            while not wb.pending():  # polled as between decode steps: version 0 is announced by now or soon
                assert time.monotonic() < deadline, "version 0 never announced"
                time.sleep(0.01)
            v0 = wb.receive_()
            first = state(gen)
            # the trainers wait for this step's rollouts before they train: nothing can be announced yet
            quiet = not wb.pending()
            send_rollouts(placement, ROLLOUTS)
            v1 = wb.receive_()
            result[key] = {"versions": (v0, v1), "first": first, "second": state(gen), "quiet": quiet,
                           "in_place": [p.data_ptr() for p in gen.parameters()] == ptrs,
                           "bytes": (wb.publication_bytes(True), wb.publication_bytes(False)),
                           "buffer_bytes": wb.buffer_bytes}
    result["async"] = run_ahead(placement, device)
    # a copy that does not fit: the generator finds it, every rank raises its one line
    try:
        WeightBroadcast(placement, policy(False) if placement.role == "trainer"
                        else generator_copy(config=dataclasses.replace(CONFIG, intermediate_size=96)))
    except ValueError as e:
        result["error"] = str(e)
    torch.save(result, Path(out) / f"rank{rank}.pt")
    close_world(world)


# `gather_into_` (the colocated sync's bucketed gather) on shapes the models above do not have: fewer rows than
# trainers, uneven splits, 1-D; buckets down to one row, where a trainer holds none of some buckets' rows
AWKWARD_SHAPES = [(3, 4), (1, 5), (7,), (4, 2), (5, 3)]
AWKWARD_BUCKETS = [None, 64, 1]  # the default (one bucket); a few rows; a row each


def awkward_gathers(group: Any, device: torch.device) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    g = torch.Generator().manual_seed(0)
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s, generator=g)) for s in AWKWARD_SHAPES])
    want = [p.detach().clone() for p in params]
    fully_shard(params.to(device), mesh=DeviceMesh.from_group(group, device.type))
    got = {}
    for bucket in AWKWARD_BUCKETS:
        dst = [torch.full(s, float("nan"), device=device) for s in AWKWARD_SHAPES]
        fsdp.gather_into_(list(zip(params, dst, strict=True)), bucket)
        got[bucket] = [d.cpu() for d in dst]
    return {"want": want, "got": got}


STEPS, K = 4, 1


def run_ahead(placement: Placement, device: torch.device) -> dict[str, Any]:
    """The disaggregated loop's order with staleness K = 1: the generator produces step s from any version
    >= s - K, taking an update when one is announced; the trainers receive rollouts in a thread (the bounded
    buffer), so neither blocking channel waits on the other; the trainers publish after every step but the last,
    and the generator takes every version they publish."""
    if placement.role == "trainer":
        model = policy(False).to(device)
        shard_model_(model, device, group=placement.trainer_world.group)
        trainer = Trainer(model, TrainerConfig(lr=1e-2, warmup_steps=1, schedule="constant"), total_steps=STEPS,
                          world=placement.trainer_world)
        wb = WeightBroadcast(placement, model)
        buffer: Queue = Queue(maxsize=K + 1)
        receiver = Thread(target=lambda: [buffer.put(recv_rollouts(placement)) for _ in range(STEPS)])
        receiver.start()
        wb.send_(trainer.step_count)
        lags = []
        for step in range(STEPS):
            (made,) = buffer.get()
            lags.append(trainer.step_count - made["version"])
            trainer.sft_step(SEQS)
            if step < STEPS - 1:
                wb.send_(trainer.step_count)
        receiver.join()
        return {"lags": lags}
    gen = generator_copy().to(device)
    wb = WeightBroadcast(placement, gen)
    wb.receive_()
    versions = []
    for step in range(STEPS):
        while wb.version < step - K or wb.pending():
            wb.receive_()
        versions.append(wb.version)
        send_rollouts(placement, [{"step": step, "version": wb.version}])
    while wb.version < STEPS - 1:  # every published version is taken: none is left mid-broadcast
        wb.receive_()
    return {"versions": versions, "last": wb.version}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(tmp_path_factory.mktemp("bcast"), "cpu")


def run_ranks(out: Path, device_type: str) -> list[dict[str, Any]]:
    mp.spawn(worker, args=(free_port(), str(out), device_type), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def colocated(trained: dict[str, torch.Tensor] | None, kind: str) -> dict[str, torch.Tensor]:
    """What `sync_weights_` writes in one process from the full trainer model (`trained`: its weights after the
    step, gathered from the trainers; None: the seed's)."""
    model = policy(kind != "full")
    if trained is not None:
        model.load_state_dict(trained)
    gen = generator_copy(kind)
    sync_weights_(gen, model)
    return state(gen)


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for n in want:
        assert got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]), n


@pytest.mark.parametrize("bucket", AWKWARD_BUCKETS)
def test_gather_into_awkward_shapes(ranks: list[dict[str, Any]], bucket: int | None) -> None:
    for r in ranks[:2]:
        for got, want in zip(r["awkward"]["got"][bucket], r["awkward"]["want"], strict=True):
            assert torch.equal(got, want)


def test_roles(ranks: list[dict[str, Any]]) -> None:
    assert [r["role"] for r in ranks] == ["trainer", "trainer", "generator"]
    assert ranks[0]["trainers"] == (0, 1) and ranks[0]["generators"] == (2,)
    assert [r["from_rank0"] for r in ranks] == ["r0"] * 3
    assert ranks[0]["trainer_sum"] == ranks[1]["trainer_sum"] == 1 + 2


def assert_received_colocated_weights(ranks: list[dict[str, Any]], kind: str) -> None:
    gen, colo = ranks[2][kind], ranks[0][kind]
    assert gen["versions"] == (0, 1) and gen["quiet"]  # `pending` polls without blocking: no update yet
    assert gen["in_place"]  # same storage: the generator's CUDA graphs stay valid
    assert_bitwise(gen["first"], colo["first"])  # what sync_weights_ writes from the sharded trainers, colocated
    assert_bitwise(gen["second"], colo["second"])
    # the step changed what the generator holds (a transfer that sent nothing would fail above or here)
    assert any(not torch.equal(gen["first"][n], gen["second"][n]) for n in gen["first"])


@pytest.mark.parametrize("kind", KINDS)
def test_generator_copy_equals_colocated_sync_bitwise(ranks: list[dict[str, Any]], kind: str) -> None:
    assert_received_colocated_weights(ranks, kind)
    # and what it writes in one process from the full trainer model
    assert_bitwise(ranks[2][kind]["first"], colocated(None, kind))
    assert_bitwise(ranks[2][kind]["second"], colocated(ranks[0][kind]["trained"], kind))


@pytest.mark.gpu
def test_nccl_generator_copy_equals_colocated_sync_bitwise(tmp_path: Path) -> None:
    """The same on three GPUs (NCCL weight groups, FSDP2 in bf16 mixed precision, gloo for headers and rollouts)."""
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs")
    ranks = run_ranks(tmp_path, "cuda")
    for kind in KINDS:
        assert_received_colocated_weights(ranks, kind)
    assert {r["error"] for r in ranks} == {ranks[0]["error"]}


def test_two_trainers_train_as_one(ranks: list[dict[str, Any]]) -> None:
    """The FSDP2 step on the trainer group is the one-process step (up to the order of the gradient sum,
    which AdamW magnifies where a gradient is near zero: a trainer group summing the wrong gradients is off by ~lr)."""
    model = policy(False)
    train_step(model)
    for n, p in model.named_parameters():
        torch.testing.assert_close(ranks[0]["full"]["trained"][n], p.detach(), rtol=1e-3, atol=1e-4)


def test_frozen_weights_are_sent_once(ranks: list[dict[str, Any]]) -> None:
    full_bytes, later = ranks[2]["full"]["bytes"]
    assert later == full_bytes  # full fine-tuning: every weight changes
    c = CONFIG
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    projections = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.intermediate_size * c.hidden_size
    lora_full, lora_later = ranks[2]["lora"]["bytes"]
    assert lora_full == full_bytes and lora_later == c.num_layers * projections * 2  # the merged projections, bf16
    adapters = sum(LORA.rank * (i + o) for i, o in [(c.hidden_size, q), (c.hidden_size, kv), (c.hidden_size, kv),
                                                    (q, c.hidden_size), (c.hidden_size, c.intermediate_size),
                                                    (c.hidden_size, c.intermediate_size),
                                                    (c.intermediate_size, c.hidden_size)])
    assert ranks[2]["unmerged"]["bytes"][1] == c.num_layers * adapters * 4  # the fp32 adapters alone
    # the buffer holds one message: one trainer's share of a layer (the largest unit of this model)
    assert projections <= ranks[2]["full"]["buffer_bytes"] < projections + 256
    assert projections < -(-c.vocab_size // 2) * c.hidden_size * 2  # so a trainer's embedding share went in chunks


def test_generators_run_ahead_by_at_most_k_versions(ranks: list[dict[str, Any]]) -> None:
    gen = ranks[2]["async"]
    assert gen["last"] == STEPS - 1 and all(step - K <= v <= step for step, v in enumerate(gen["versions"]))
    assert ranks[0]["async"]["lags"] == ranks[1]["async"]["lags"]
    assert all(0 <= lag <= K for lag in ranks[0]["async"]["lags"])


def test_rollouts_reach_every_trainer(ranks: list[dict[str, Any]]) -> None:
    assert all(r[f"{k} rollouts"] == ROLLOUTS for r in ranks[:2] for k in KINDS)


def test_a_copy_that_does_not_fit_fails_every_rank_in_one_line(ranks: list[dict[str, Any]]) -> None:
    errors = {r["error"] for r in ranks}
    assert len(errors) == 1
    msg = errors.pop()
    assert "\n" not in msg and msg.startswith("weight sync: ") and "gate_up_proj" in msg


@pytest.mark.parametrize("g, n, words", [(1, 1, "needs several processes"), (3, 3, "leaves no trainer among 3"),
                                         (5, 2, "use at most 1")])
def test_bad_placements_are_one_line(g: int, n: int, words: str) -> None:
    with pytest.raises(ValueError) as e:
        check_placement(PlacementSection(generator_ranks=g), n)
    assert words in str(e.value) and "\n" not in str(e.value)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="generator_ranks must be an integer >= 0"):
            PlacementSection(generator_ranks=bad)  # type: ignore[arg-type]


def test_colocated_placement_has_one_role() -> None:
    p = Placement.build(SINGLE, PlacementSection())
    assert p.role == "both" and not p.disaggregated and p.trainer_world is SINGLE


@pytest.mark.parametrize("rows, parts", [(129, 2), (64, 2), (5, 3), (2, 4), (0, 2)])
def test_shard_rows_is_fsdp2_split(rows: int, parts: int) -> None:
    chunks = torch.arange(rows).chunk(parts) if rows else ()
    for t in range(parts):
        lo, hi = shard_rows(rows, t, parts)
        want = chunks[t].tolist() if t < len(chunks) else []
        assert list(range(lo, hi)) == want


def test_messages_cover_every_row_once_and_a_big_matrix_goes_in_layer_sized_chunks() -> None:
    manifest = [Entry("model.embed_tokens.weight", (101, 8), "model.embed_tokens.weight", True),
                Entry("model.layers.0.mlp.down_proj.weight", (8, 6), "model.layers.0", False),
                Entry("model.layers.0.input_layernorm.weight", (8,), "model.layers.0", True),
                Entry("model.norm.weight", (8,), "model.norm.weight", True)]
    dtypes = [torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16]
    for full in (True, False):
        msgs = plan_messages(manifest, dtypes, 3, full)
        layer = [m.nbytes for m in msgs if m.unit == "model.layers.0"]
        assert max(m.nbytes for m in msgs) == max(layer)  # the embedding (101 x 8) comes in layer-sized chunks
        rows: dict[tuple[int, int], list[int]] = {}
        for m in msgs:
            for p in m.pieces:
                assert p.offset % 16 == 0
                rows.setdefault((p.entry, m.trainer), []).extend(range(p.lo, p.hi))
        for i, e in enumerate(manifest):
            for t in range(3):
                want = list(range(*shard_rows(e.shape[0], t, 3))) if full or not e.frozen else []
                assert rows.get((i, t), []) == want, (e.name, t)
