"""Pack rollouts into varlen micro-batches: no padding inside sequences, token counts bucketed.

A micro-batch is a flat run of whole sequences (prompt + completion) laid end to end with
`cu_seqlens`. Its length is rounded up to one of a few bucket sizes with a filler sequence whose
tokens carry no loss, so compiled code sees only a handful of shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from monorl.model.attention import VarlenContext


@dataclass
class TrainSequence:
    """One rollout as the trainer sees it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]  # generator log-probs of completion_ids
    advantage: float
    ref_logprobs: list[float] | None = None

    def __post_init__(self) -> None:
        if len(self.old_logprobs) != len(self.completion_ids):
            raise ValueError(f"{len(self.old_logprobs)} log-probs for {len(self.completion_ids)} completion tokens")
        if not self.prompt_ids:
            raise ValueError("a training sequence needs at least one prompt token")

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class MicroBatch:
    input_ids: Tensor  # [T] (T a bucket size)
    ctx: VarlenContext
    logit_index: Tensor  # [N] rows of the hidden states that predict a completion token
    targets: Tensor  # [N] completion tokens
    old_logprobs: Tensor  # [N]
    ref_logprobs: Tensor | None  # [N]
    seq_ids: Tensor  # [N] index of each token's sequence within the step
    num_real_tokens: int


def token_buckets(max_tokens: int, smallest: int = 64) -> tuple[int, ...]:
    """Powers of two from `smallest` up to `max_tokens` (which is always the last bucket)."""
    out, b = [], smallest
    while b < max_tokens:
        out.append(b)
        b *= 2
    return (*out, max_tokens)


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: group sequence indices into bins of at most `max_tokens` tokens."""
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"sequence {i} has {n} tokens, more than micro_batch_tokens={max_tokens}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return [sorted(b) for b in bins]


def pack(seqs: Sequence[TrainSequence], indices: Sequence[int], buckets: Sequence[int], device: torch.device | str,
         attn_backend: str = "sdpa", pad_id: int = 0) -> MicroBatch:
    """Lay out `seqs[indices]` end to end, then pad to the smallest bucket that fits with a filler sequence."""
    ids: list[int] = []
    lengths: list[int] = []
    logit_index: list[int] = []
    targets: list[int] = []
    old: list[float] = []
    ref: list[float] = []
    seq_ids: list[int] = []
    for i in indices:
        s = seqs[i]
        start = len(ids)
        ids += s.prompt_ids + s.completion_ids
        lengths.append(len(s))
        p = len(s.prompt_ids)
        # hidden state at position t predicts token t+1
        logit_index += range(start + p - 1, start + len(s) - 1)
        targets += s.completion_ids
        old += s.old_logprobs
        if s.ref_logprobs is not None:
            ref += s.ref_logprobs
        seq_ids += [i] * len(s.completion_ids)
    real = len(ids)
    size = next((b for b in buckets if b >= real), None)
    if size is None:
        raise ValueError(f"{real} tokens do not fit the largest bucket {max(buckets)}")
    # filler sequences: attend only to themselves, carry no loss; no longer than the longest real
    # sequence, so the padded-batch attention does not grow
    chunk = max(lengths)
    for s in range(real, size, chunk):
        lengths.append(min(chunk, size - s))
    ids += [pad_id] * (size - real)
    has_ref = all(seqs[i].ref_logprobs is not None for i in indices)
    return MicroBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        ctx=VarlenContext.from_lengths(lengths, device, attn_backend),
        logit_index=torch.tensor(logit_index, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=torch.long, device=device),
        old_logprobs=torch.tensor(old, dtype=torch.float32, device=device),
        ref_logprobs=torch.tensor(ref, dtype=torch.float32, device=device) if has_ref else None,
        seq_ids=torch.tensor(seq_ids, dtype=torch.long, device=device),
        num_real_tokens=real,
    )


def make_micro_batches(seqs: Sequence[TrainSequence], max_tokens: int, device: torch.device | str,
                       attn_backend: str = "sdpa", buckets: Sequence[int] | None = None) -> list[MicroBatch]:
    buckets = tuple(buckets) if buckets else token_buckets(max_tokens)
    plan = plan_micro_batches([len(s) for s in seqs], max_tokens)
    return [pack(seqs, idx, buckets, device, attn_backend) for idx in plan]
