"""The sizes of a static pack of flat sequences, shared by the trainer's packs (`monorl.train.packing`) and the
generator's prefills (`monorl.generate`): buckets of token counts, a static max_seqlen, the filler sequences that pad
a pack to its bucket. Few distinct shapes, so each is compiled and captured in a CUDA graph once."""

from __future__ import annotations


def bucket_size(n: int, smallest: int = 16) -> int:
    """Round n up to a bucket: a multiple of `smallest`, and above 8 * smallest one of 8 steps per power
    of two, so padding stays within 12.5% (8400 -> 9216) and a run sees few distinct sizes."""
    if n <= smallest:
        return smallest
    step = max(smallest, 1 << ((n.bit_length() - 1) - 3))
    return -(-n // step) * step


def next_pow2(n: int, smallest: int = 1) -> int:
    return max(smallest, 1 << max(0, n - 1).bit_length())


def static_max_seqlen(lengths: list[int], size: int) -> int:
    """A static pack's max_seqlen: the longest sequence rounded up to a power of two (>= 16), at most the pack."""
    return min(next_pow2(max(lengths), 16), size)


def filler_lengths(lengths: list[int], size: int, chunk: int, static: bool, count: int | None = None) -> list[int]:
    """Sequence lengths of a pack padded to `size` tokens: `lengths`, then filler sequences of at most `chunk` tokens
    (each attends only to itself); static: then zero-length entries up to a power-of-two count (>= 8), or to
    `count` where given."""
    out = [*lengths, *_chunks(size - sum(lengths), chunk)]
    return out + [0] * ((count or next_pow2(len(out), 8)) - len(out)) if static else out


def _chunks(n: int, chunk: int) -> list[int]:
    return [min(chunk, n - s) for s in range(0, n, chunk)]
