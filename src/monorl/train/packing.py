"""Pack rollouts into varlen micro-batches: no padding inside sequences, token counts bucketed.

A micro-batch is a flat run of whole sequences (prompt + completion) laid end to end with
`cu_seqlens`. Its length is rounded up to a bucket size (at most 12.5% above it) with filler
sequences whose tokens carry no loss, so compiled code sees only a handful of shapes.

A *static* pack (`static=True`, for the trainer's CUDA graphs) also rounds every other dimension
to a bucket -- sequence count (zero-length entries), completion-token rows (masked) and the
attention's max_seqlen -- so that one captured graph replays any pack of the same `PackShape`.
A static pack can also be padded up to a given larger shape (`pack(shape=...)`): the trainer pads a pack whose
shape has no graph yet to a captured one that holds it (`covering_shape`), when that costs few padded tokens.

Shared prompts (`share_prompts`, the default): the sequences of one prompt group (`group_key`: the step's group
index and the prompt ids) are packed as the prompt once, then each completion, so the model's per-token work (every
projection, norm and MLP) runs on the prompt once per group instead of once per sequence -- GRPO's groups of 8 on
~150-token prompts with 100-token completions train on half the tokens. Attention alone sees each sequence whole
(`SharedPrompts`: the layout above, built by copying rows), so every token's result is what it is unshared, and in
batch-invariant mode bit for bit the generator's. A group is kept in one micro-batch where it fits
(`plan_micro_batches`); the token budget counts whole sequences, as unshared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from monorl.model.attention import SharedPrompts, VarlenContext, positions_of
from monorl.model.pack_layout import bucket_size, filler_lengths, next_pow2, static_max_seqlen
from monorl.model.qwen3_vl import embed_images, pack_images, pack_positions
from monorl.model.vision_config import VisionConfig
from monorl.model.vision_inputs import Grids, VisionInputs
from monorl.model.vision_prompt import ImageInputs


@dataclass
class TrainSequence:
    """One rollout as the trainer sees it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]  # generator log-probs of completion_ids
    advantage: float
    # the KL reference's log-probs of completion_ids, where the sequence brings them (a trainer with a KL
    # reference model scores its packs itself: monorl.train.frozen)
    ref_logprobs: list[float] | None = None
    # the index of its prompt group in the step: a group's sequences share their prompt in a pack (`pack`); None:
    # sequences with equal prompt ids are one group
    group: int | None = None
    # zero loss weight (rollout.mask_truncated: DAPO's overlong filtering): never packed, and 0 response tokens
    # in the step's normalisers, so it neither adds to the loss nor dilutes a token mean
    masked: bool = False
    # per completion token: 1 trains (the model sampled it), 0 is context only (an episode's tool results,
    # environment messages and turn headers): no loss, no gradient, out of every normaliser, no entropy / KL /
    # log-prob diff. None: every completion token trains
    completion_mask: list[int] | None = None
    # a distillation teacher's log-probs of completion_ids, where the sequence brings them (a trainer with a teacher
    # scores its packs itself: monorl.train.frozen)
    teacher_logprobs: list[float] | None = None
    # its images (`ImageInputs`: placeholders expanded): the prompt's, then in an episode those a tool returned
    # (inserted tokens, completion_mask 0); the model takes the tower's embeddings at their placeholders and M-RoPE
    # positions; image tokens are never trained on
    images: ImageInputs | None = None

    def __post_init__(self) -> None:
        if len(self.old_logprobs) != len(self.completion_ids):
            raise ValueError(f"{len(self.old_logprobs)} log-probs for {len(self.completion_ids)} completion tokens")
        if not self.prompt_ids:
            raise ValueError("a training sequence needs at least one prompt token")
        if self.completion_mask is not None and len(self.completion_mask) != len(self.completion_ids):
            raise ValueError(f"{len(self.completion_mask)} mask entries for {len(self.completion_ids)} completion "
                             "tokens")
        if self.images is not None and not len(self.prompt_ids) <= self.images.length <= len(self):
            raise ValueError(f"images laid out for {self.images.length} tokens, the sequence has "
                             f"{len(self.prompt_ids)} prompt + {len(self.completion_ids)} completion tokens")

    @property
    def trained_tokens(self) -> int:
        """Completion tokens that train (0 for a masked sequence): what the step's normalisers count."""
        if self.masked:
            return 0
        return len(self.completion_ids) if self.completion_mask is None else sum(self.completion_mask)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass(frozen=True)
class PackShape:
    """Every size a micro-batch's compiled code and CUDA graph depend on."""

    tokens: int  # T: flat tokens (real + filler)
    seqs: int  # entries in cu_seqlens - 1 (static packs: padded with zero-length entries)
    targets: int  # N: completion-token rows (static packs: padded rows have token_mask 0)
    max_seqlen: int  # the attention's bound on any one sequence's length
    full_tokens: int  # the attention's layout, every sequence whole: T without shared prompts
    copies: int  # the most copies of one token in that layout (columns of `SharedPrompts.copies`; 1 unshared)
    image_grids: Grids = ()  # its images' grids, in order (`VisionInputs.grids`: the tower's shapes follow them)


@dataclass
class MicroBatch:
    input_ids: Tensor  # [T] (T a bucket size)
    ctx: VarlenContext
    logit_index: Tensor  # [N] rows of the hidden states that predict a completion token
    targets: Tensor  # [N] completion tokens
    old_logprobs: Tensor  # [N]
    ref_logprobs: Tensor | None  # [N]
    teacher_logprobs: Tensor | None  # [N]
    seq_ids: Tensor  # [N] index of each token's sequence within the step
    token_mask: Tensor  # [N] fp32, 1 for a real completion token, 0 for a padded row
    num_real_tokens: int  # tokens of its sequences, whole (a shared prompt counted per sequence, as TRL counts)
    num_targets: int  # real completion tokens (rows of token_mask that are 1)
    # the images of its prompts, in the order their placeholder runs lie in input_ids, on the device with their
    # placeholder rows and tables (`pack_images`: a graph replays the pack), and then the unique tokens' M-RoPE
    # positions [3, T] (`model_forward`); None: text only, the context's positions
    images: VisionInputs | None = None
    mrope_positions: Tensor | None = None

    @property
    def shape(self) -> PackShape:
        sh = self.ctx.shared
        T = self.input_ids.numel()
        return PackShape(T, self.ctx.cu_seqlens.numel() - 1, self.targets.numel(), self.ctx.max_seqlen,
                         T if sh is None else sh.expand_index.numel(), 1 if sh is None else sh.copies.shape[1],
                         () if self.images is None else self.images.grids)


def masked_copy(mb: MicroBatch) -> MicroBatch:
    """`mb` with every completion token masked: it runs the same passes (and FSDP collectives) and adds exactly
    zero to the loss, the gradients and the metric sums."""
    return dataclasses.replace(mb, token_mask=torch.zeros_like(mb.token_mask), num_real_tokens=0, num_targets=0)


def token_buckets(max_tokens: int, smallest: int = 64) -> tuple[int, ...]:
    """The bucket sizes (`bucket_size`) from `smallest` up to `max_tokens` (always the last bucket)."""
    out, b = [], smallest
    while b < max_tokens:
        out.append(b)
        b = bucket_size(b + 1, smallest)
    return (*out, max_tokens)


def plan_micro_batches(lengths: Sequence[int], max_tokens: int,
                       groups: Sequence[object] | None = None) -> list[list[int]]:
    """First-fit decreasing: group sequence indices into bins of at most `max_tokens` tokens. groups (a key per
    sequence, e.g. its prompt): the sequences of one key go into one bin together (a group of more than
    `max_tokens` tokens is cut into runs that fit first), so a shared prompt is packed once."""
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"sequence {i} has {n} tokens, more than micro_batch_tokens={max_tokens}")
    members: dict[object, list[int]] = {}
    for i in range(len(lengths)):
        members.setdefault(i if groups is None else groups[i], []).append(i)
    items: list[list[int]] = []
    for idx in members.values():
        run, size = [], 0
        for i in idx:
            if run and size + lengths[i] > max_tokens:
                items.append(run)
                run, size = [], 0
            run.append(i)
            size += lengths[i]
        items.append(run)
    bins: list[list[int]] = []
    room: list[int] = []
    for item in sorted(items, key=lambda it: -sum(lengths[i] for i in it)):
        n = sum(lengths[i] for i in item)
        for b, r in enumerate(room):
            if n <= r:
                bins[b] += item
                room[b] -= n
                break
        else:
            bins.append(list(item))
            room.append(max_tokens - n)
    return [sorted(b) for b in bins]


def covering_shape(shape: PackShape, have: Iterable[PackShape], slack: float, floor: int = 0) -> PackShape | None:
    """The cheapest of `have` that a static pack of `shape` can be padded to: every size at least `shape`'s, the
    same prompt layout (shared or not) and image grids, and its tokens, attention tokens and completion rows -- what
    the work grows with -- each at most n + slack * max(n, floor) for `shape`'s n. floor (the trainer's
    micro_batch_tokens): a small pack (a rank's last micro-batch) may grow by slack of a whole micro-batch, since that
    costs little next to the capture it saves. None if none is."""
    def fits(h: PackShape) -> bool:
        grows = ((h.tokens, shape.tokens), (h.full_tokens, shape.full_tokens), (h.targets, shape.targets))
        return ((h.copies > 1) == (shape.copies > 1) and h.image_grids == shape.image_grids and h.seqs >= shape.seqs
                and h.max_seqlen >= shape.max_seqlen and h.copies >= shape.copies
                and all(n <= big <= n + slack * max(n, floor) for big, n in grows))
    return min(filter(fits, have), key=lambda h: (h.full_tokens, h.tokens, h.targets, h.seqs, h.max_seqlen,
                                                  h.copies), default=None)


def pack(seqs: Sequence[TrainSequence], indices: Sequence[int], buckets: Sequence[int], device: torch.device | str,
         attn_backend: str = "sdpa", pad_id: int = 0, static: bool = False, share_prompts: bool = True,
         shape: PackShape | None = None, vision: VisionConfig | None = None) -> MicroBatch:
    """Lay out `seqs[indices]` end to end, then pad to the smallest bucket that fits with filler sequences.
    static: also pad the sequence count, completion rows and max_seqlen to buckets (see `PackShape`).
    share_prompts: the sequences of one prompt group (`group_key`) hold their prompt once (module docstring).
    shape (static): pad to this shape instead of the buckets' (`covering_shape`); ValueError if the pack cannot
    take it. vision: the model's tower config, for a pack with images (their tables: `pack_images`)."""
    if shape is not None and not static:
        raise ValueError("pack(shape=...) pads a static pack")
    group_size: dict[tuple, int] = {}
    for i in indices:
        key = group_key(seqs[i])
        group_size[key] = group_size.get(key, 0) + 1
    share = share_prompts and max(group_size.values(), default=0) > 1
    ids: list[int] = []  # the unique tokens (the model's input)
    seq_rows: list[list[int]] = []  # each sequence's tokens as rows of `ids`: the attention's layout
    prompt_rows: dict[tuple, list[int]] = {}
    lengths: list[int] = []
    logit_index: list[int] = []
    targets: list[int] = []
    old: list[float] = []
    mask: list[float] = []  # 1 trains, 0 context only (an episode's inserted tokens)
    ref: list[float] = []
    teacher: list[float] = []
    seq_ids: list[int] = []
    images: list[ImageInputs] = []  # in the order of their placeholders in `ids` (a shared prompt's once)
    spans: list[tuple[int, int]] = []  # each image's placeholder rows in `ids`
    for i in indices:
        s = seqs[i]
        p = len(s.prompt_ids)
        key = group_key(s)
        if share and group_size[key] > 1:
            # the prompt's last token stays each sequence's own: it predicts the first completion token, and one row
            # gathered for several targets would get their gradients summed in an order nothing fixes (CPU threads)
            if key not in prompt_rows:
                prompt_rows[key] = list(range(len(ids), len(ids) + p - 1))
                if s.images is not None:  # (its last prompt token, a sequence's own, is text: the chat's header)
                    images.append(s.images)
                    spans += [(len(ids) + a, len(ids) + b) for a, b in s.images.spans]
                ids += s.prompt_ids[:-1]
            start = len(ids)
            ids += s.prompt_ids[-1:] + s.completion_ids
            rows = prompt_rows[key] + list(range(start, len(ids)))
        else:
            start = len(ids)
            ids += s.prompt_ids + s.completion_ids
            rows = list(range(start, len(ids)))
            if s.images is not None:
                images.append(s.images)
                spans += [(start + a, start + b) for a, b in s.images.spans]
        seq_rows.append(rows)
        lengths.append(len(s))
        # hidden state at position t predicts token t+1
        logit_index += rows[p - 1:len(s) - 1]
        targets += s.completion_ids
        mask += s.completion_mask if s.completion_mask is not None else [1.0] * len(s.completion_ids)
        old += s.old_logprobs
        if s.ref_logprobs is not None:
            ref += s.ref_logprobs
        if s.teacher_logprobs is not None:
            teacher += s.teacher_logprobs
        seq_ids += [i] * len(s.completion_ids)
    real, full_real, num_targets = len(ids), sum(lengths), len(targets)
    size = _bucket(real, buckets) if shape is None else shape.tokens
    if size is None:
        raise ValueError(f"{real} tokens do not fit the largest bucket {max(buckets)}")
    if shape is not None and (real > size or (share and full_real + 1 > shape.full_tokens)
                              or max(lengths) > shape.max_seqlen or num_targets > shape.targets):
        raise ValueError(f"a pack of {real} tokens ({num_targets} completion tokens) does not fit {shape}")
    # filler sequences: attend only to themselves, carry no loss; no longer than the longest real
    # sequence (static: than max_seqlen), so the attention's cost and bound do not grow
    max_seqlen = (static_max_seqlen(lengths, size) if shape is None else shape.max_seqlen) if static else None
    chunk = max_seqlen or max(lengths)
    ids += [pad_id] * (size - real)
    count = None if shape is None else shape.seqs
    shared, positions = None, None  # unshared: the context derives the positions from the lengths
    if share:
        # the attention's layout: the sequences whole, then fillers of its own, at least one row of them: the
        # fillers of `ids` are its last row's (its output and gradients, nothing reads or adds them), and its
        # fillers copy row 0, which nothing adds back (`SharedPrompts.copies` never lists them)
        full_size = _bucket(full_real + 1, buckets) or bucket_size(full_real + 1)
        if static:
            full_size = full_size if shape is None else shape.full_tokens
            max_seqlen = static_max_seqlen(lengths, full_size) if shape is None else shape.max_seqlen
            chunk = max_seqlen
        expand = host_tensor([r for rows in seq_rows for r in rows], torch.long)
        positions = torch.zeros(size, dtype=torch.long)  # each unique token's, from any of its copies; fillers 0
        positions[expand] = positions_of(lengths)
        lengths = filler_lengths(lengths, full_size, chunk, static, count)
        shared = SharedPrompts(expand_index=torch.cat([expand, expand.new_zeros(full_size - full_real)]).to(device),
                               copies=copies_table(expand, size, full_size, static,
                                                   None if shape is None else shape.copies).to(device))
    else:
        lengths = filler_lengths(lengths, size, chunk, static, count)
    mrope, prepared = None, None
    if images:
        if vision is None:
            raise ValueError("a pack with images needs the model's vision config (pack(vision=...))")
        prepared = pack_images(vision, images, spans, device)  # on the device now: the forward reads no host data
        # each unique token's M-RoPE position, from any of its copies (the sequences' layout); fillers 0
        full = pack_positions([len(seqs[i]) for i in indices], [seqs[i].images for i in indices])
        mrope = torch.zeros(3, size, dtype=torch.long)
        mrope[:, host_tensor([r for rows in seq_rows for r in rows], torch.long)] = full
    has_ref = all(seqs[i].ref_logprobs is not None for i in indices)
    has_teacher = all(seqs[i].teacher_logprobs is not None for i in indices)
    n_rows = (bucket_size(num_targets) if shape is None else shape.targets) if static else num_targets
    pad = n_rows - num_targets  # padded rows: row 0, token 0, sequence indices[0], mask 0

    def rows(values: list, fill, dtype: torch.dtype) -> Tensor:
        return host_tensor(values + [fill] * pad, dtype).to(device)

    mb = MicroBatch(
        input_ids=host_tensor(ids, torch.long).to(device),
        ctx=VarlenContext.from_lengths(lengths, device, attn_backend, max_seqlen=max_seqlen, shared=shared,
                                       positions=positions),
        logit_index=rows(logit_index, 0, torch.long),
        targets=rows(targets, 0, torch.long),
        old_logprobs=rows(old, 0.0, torch.float32),
        ref_logprobs=rows(ref, 0.0, torch.float32) if has_ref else None,
        teacher_logprobs=rows(teacher, 0.0, torch.float32) if has_teacher else None,
        seq_ids=rows(seq_ids, indices[0], torch.long),
        token_mask=rows([float(m) for m in mask], 0.0, torch.float32),
        num_real_tokens=full_real,
        num_targets=num_targets,
        images=prepared,
        mrope_positions=None if mrope is None else mrope.to(device),
    )
    if shape is not None and mb.shape != shape:  # e.g. more filler sequences than the shape's entries
        raise ValueError(f"a pack of {real} tokens padded to {shape} took {mb.shape}")
    return mb


def model_forward(model: nn.Module, mb: MicroBatch) -> Tensor:
    """The model's final hidden states of a micro-batch: where its prompts hold images, the tower's embeddings at
    their placeholders (the tower runs in this forward: it trains unless frozen) and the M-RoPE positions. Its inputs
    are all on the device (`pack`): a trainer CUDA graph captures it, the tower included."""
    if mb.images is None:
        return model(mb.input_ids, mb.ctx.positions, mb.ctx)
    embeds, deepstack = embed_images(model, mb.input_ids, mb.images)
    return model(mb.input_ids, mb.mrope_positions, mb.ctx, inputs_embeds=embeds, deepstack=deepstack)


_NUMPY = {torch.long: np.int64, torch.float32: np.float32}


def host_tensor(values: list, dtype: torch.dtype) -> Tensor:
    """A CPU tensor of a list of Python numbers, through numpy: ~3x faster than `torch.tensor(list)` (a pack builds
    ~50k elements a step on the host while the GPU waits)."""
    return torch.from_numpy(np.asarray(values, dtype=_NUMPY[dtype]))


def group_key(s: TrainSequence) -> tuple:
    """What makes sequences one prompt group in a pack: their group index (where the loop gave one), prompt and
    images (one `ImageInputs` object per prompt group: prompts of equal tokens hold other pictures behind their
    placeholders)."""
    if s.images is not None and s.images.length > len(s.prompt_ids):
        return (id(s),)  # images past its prompt (an episode's tool results): its own
    return s.group, tuple(s.prompt_ids), None if s.images is None else id(s.images)


def copies_table(expand: Tensor, size: int, full_size: int, static: bool, width: int | None = None) -> Tensor:
    """`SharedPrompts.copies` of a layout whose full row f copies unique row expand[f] (the real rows only): each
    unique row's full rows in order, `full_size` (a zero row) where it has fewer than the widest; a row no full row
    copies (a filler) gets the last full row, a filler's. static: the width a power of two, or `width` where given."""
    counts = torch.bincount(expand, minlength=size)
    least = max(1, int(counts.max()))
    if width is not None and width < least:
        raise ValueError(f"a copies table {width} wide for a row copied {least} times")
    width = (width or next_pow2(least)) if static else least
    order = torch.sort(expand, stable=True).indices  # full rows grouped by their unique row, in order
    rank = torch.arange(expand.numel()) - (torch.cumsum(counts, 0) - counts)[expand[order]]
    table = torch.full((size, width), full_size, dtype=torch.long)
    table[expand[order], rank] = order
    table[counts == 0, 0] = full_size - 1
    return table


def _bucket(n: int, buckets: Sequence[int]) -> int | None:
    return next((b for b in buckets if b >= n), None)


def token_share(seqs: Sequence[TrainSequence], rank: int, ranks: int, share_prompts: bool = True) -> range:
    """The contiguous slice of the step's `seqs` that `rank` of `ranks` trains: cut where each rank's packed tokens
    (a shared prompt once per group, masked sequences none) come nearest an equal share, between prompt groups where
    there are at least as many groups as ranks. Balanced by tokens, not by sequences: a rank given the long
    completions no longer sets the step's pace while the others wait in FSDP's collectives. Every rank computes the
    same cuts from the same list."""
    cuts = [i for i in range(len(seqs)) if i == 0 or group_key(seqs[i - 1]) != group_key(seqs[i])]
    # fewer groups than ranks: cut anywhere (every rank then packs its part's prompt once: a constant)
    anywhere = len(cuts) < ranks
    cost = [0 if s.masked else len(s.completion_ids) + (
        len(s.prompt_ids) if not share_prompts or (not anywhere and i in cuts) else 0) for i, s in enumerate(seqs)]
    cuts = [*(range(len(seqs)) if anywhere else cuts), len(seqs)]
    total, cum, acc = sum(cost), [], 0
    for c in [0, *cost]:
        acc += c
        cum.append(acc)
    bounds = [0]
    for r in range(1, ranks):
        # each rank after this one keeps at least one group (or sequence) where there are enough
        room = cuts[: len(cuts) - (ranks - r)] if len(cuts) > ranks else cuts
        target, lo = total * r / ranks, bounds[-1]
        options = [i for i in room if i > lo] or [i for i in cuts if i >= lo]
        bounds.append(min(options, key=lambda i: (abs(cum[i] - target), i)))
    bounds.append(len(seqs))
    return range(bounds[rank], bounds[rank + 1])


def make_micro_batches(seqs: Sequence[TrainSequence], max_tokens: int, device: torch.device | str,
                       attn_backend: str = "sdpa", buckets: Sequence[int] | None = None,
                       static: bool = False, indices: Sequence[int] | None = None,
                       share_prompts: bool = True,
                       cover: Callable[[MicroBatch], PackShape | None] | None = None,
                       vision: VisionConfig | None = None) -> list[MicroBatch]:
    """The packed micro-batches of `seqs` (of `seqs[indices]`: one rank's share of the step), masked sequences
    left out (their indices stay the step's: seq_ids index the step's advantages). share_prompts: see `pack`.
    cover (static): given a pack, a larger shape to pad it to instead (`covering_shape`), or None. vision: see
    `pack`."""
    buckets = tuple(buckets) if buckets else token_buckets(max_tokens)
    keep = [i for i in (range(len(seqs)) if indices is None else indices) if not seqs[i].masked]
    groups = [group_key(seqs[i]) for i in keep] if share_prompts else None
    plan = plan_micro_batches([len(seqs[i]) for i in keep], max_tokens, groups)
    out = []
    for idx in plan:
        members = [keep[j] for j in idx]
        mb = pack(seqs, members, buckets, device, attn_backend, static=static, share_prompts=share_prompts,
                  vision=vision)
        if static and cover is not None and (shape := cover(mb)) is not None and shape != mb.shape:
            try:
                mb = pack(seqs, members, buckets, device, attn_backend, static=True, share_prompts=share_prompts,
                          shape=shape, vision=vision)
            except ValueError:  # the layout did not take it (too many filler sequences): the pack as it was
                pass
        out.append(mb)
    return out
