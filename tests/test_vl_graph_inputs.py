"""A pack with images replays a trainer CUDA graph (#59): its images' device inputs are made at pack time
(`VisionInputs`), so the tower's forward and backward read nothing from the host; the images' grids are part of the
pack's shape, so the graph key tells packs of other grids apart. CPU checks; tests/test_trainer_graphs_gpu.py replays
such packs on CUDA."""

from __future__ import annotations

import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from monorl.compile import clone_tensors, copy_into
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.mrope import mrope_positions
from monorl.model.qwen3_vl import embed_images
from monorl.model.vision_config import VisionConfig
from monorl.model.vision_prompt import ImageInputs, placeholder_runs
from monorl.train.packing import TrainSequence, covering_shape
from monorl.train.trainer import Trainer, TrainerConfig


def synthetic_images(ids: list[int], grids: list[list[int]], vision: VisionConfig, seed: int) -> ImageInputs:
    """`ImageInputs` of expanded prompt `ids` with random pixels (what `encode_with_images` makes of pictures)."""
    g = torch.Generator().manual_seed(seed)
    positions, nxt = mrope_positions(ids, grids, vision.image_token_id, vision.spatial_merge_size)
    patches = sum(t * h * w for t, h, w in grids)
    return ImageInputs(torch.randn(patches, vision.patch_dim, generator=g), torch.tensor(grids), positions, nxt,
                       placeholder_runs(ids, grids, vision))


def vl_train_sequences(vision: VisionConfig, grids: list[list[list[int]]], seed: int, samples: int = 2,
                       completion: int = 5) -> list[TrainSequence]:
    """A prompt group of `samples` per entry of `grids` (that prompt's images), then one text-only sequence: random
    text tokens below the vision ids (the lengths follow the grids only, the tokens and pixels the seed)."""
    g = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(3, vision.vision_start_token_id, (n,), generator=g).tolist()

    out = []
    for k, image_grids in enumerate(grids):
        ids = text(3)
        for t, h, w in image_grids:
            ids += [vision.vision_start_token_id] + [vision.image_token_id] * (t * h * w // 4)
            ids += [vision.vision_end_token_id] + text(2)
        im = synthetic_images(ids, image_grids, vision, seed=100 * seed + k)
        out += [TrainSequence(ids, text(completion), [-1.0] * completion, 1.0, group=k, images=im)
                for _ in range(samples)]
    return out + [TrainSequence(text(7), text(completion), [-1.0] * completion, 1.0)]


def test_image_grids_are_part_of_the_graph_key():
    """Packs of equal grids (other pixels and tokens) share a graph key, and one pack's inputs copy into the other's
    graph buffers; a pack of other grids of the same sizes otherwise gets its own key and is never padded to the
    first's shape."""
    model = build_model(model_shape("tiny-vl"), seed=0)
    vision = model.config.vision
    tr = Trainer(model, TrainerConfig(micro_batch_tokens=512), total_steps=1, static_shapes=True)
    a, same, other = ([tr._micro_batches(vl_train_sequences(vision, grids, seed))[0] for grids, seed in
                       (([[[1, 4, 6]], [[1, 2, 2], [1, 4, 4]]], 0), ([[[1, 4, 6]], [[1, 2, 2], [1, 4, 4]]], 1),
                        ([[[1, 6, 4]], [[1, 2, 2], [1, 4, 4]]], 0))])
    assert a.shape.image_grids == ((1, 4, 6), (1, 2, 2), (1, 4, 4))  # a group's images once (shared prompts)
    assert dataclasses.replace(other.shape, image_grids=a.shape.image_grids) == a.shape  # only the grids differ
    key = [tr._graph_key(mb, 5, 1.0) for mb in (a, same, other)]
    assert key[0] == key[1] != key[2]
    assert not torch.equal(a.images.pixel_values, same.images.pixel_values)
    assert covering_shape(same.shape, [a.shape], 0.5) == a.shape
    assert covering_shape(other.shape, [a.shape], 0.5) is None
    static = clone_tensors(a)  # a graph's buffers, then the next pack of its key copied in (`TrainGraphs.replay`)
    copy_into(static, same)
    assert torch.equal(static.images.pixel_values, same.images.pixel_values)
    assert static.images.pixel_values.data_ptr() != same.images.pixel_values.data_ptr()
    (text_only,) = tr._micro_batches(vl_train_sequences(vision, [], 0))
    assert text_only.images is None and text_only.shape.image_grids == ()


class HostDataOps(TorchDispatchMode):
    """Records each op that reads a tensor back to the host (`.item()`, `.tolist()` of a device tensor), makes one
    from host data (`torch.tensor`) or takes a CPU tensor: on a device other than the CPU, where a CUDA graph captures
    the work, each is a host sync or a host-to-device copy (run on the meta device, any CPU tensor stands out)."""

    HOST = ("aten._local_scalar_dense", "aten.lift_fresh", "aten.lift_fresh_copy")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if str(func.overloadpacket) in self.HOST or any(t.device.type == "cpu" for t in tensors):
            self.seen.append(str(func))
        return func(*args, **kwargs)


def test_the_tower_reads_nothing_from_the_host():
    """The images' embeddings of a pack (`embed_images` on its `VisionInputs`, the tower's forward and backward) run
    no op that reads the host or takes host data: on the meta device nothing touches a CPU tensor."""
    model = build_model(model_shape("tiny-vl"), "meta", seed=None).train()
    vision = model.config.vision
    tr = Trainer(model, TrainerConfig(micro_batch_tokens=512), total_steps=1, static_shapes=True)
    (mb,) = tr._micro_batches(vl_train_sequences(vision, [[[1, 4, 6]], [[1, 2, 2], [2, 4, 4]]], 0))
    assert mb.images.pixel_values.device.type == "meta"
    with HostDataOps() as mode:
        embeds, (rows, deepstack) = embed_images(model, mb.input_ids, mb.images)
        (embeds.sum() + sum(d.sum() for d in deepstack)).backward()
    assert mode.seen == []
    assert all(p.grad is not None for p in model.model.visual.parameters())
