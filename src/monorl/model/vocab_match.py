"""Whether a second model (a distillation teacher, a reward model) reads the policy's token ids as the policy does:
its log-probs or scores of the policy's sampled ids mean something only then."""

from __future__ import annotations

from typing import Any

# A few tokens' texts compared besides the sizes: the first ids (specials), and ids spread over the vocabulary
PROBE_IDS = 16
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 12 + 34 = 46\n"


def _probe_ids(vocab_size: int) -> list[int]:
    step = max(1, vocab_size // PROBE_IDS)
    return sorted({*range(min(8, vocab_size)), *range(0, vocab_size, step), vocab_size - 1})


def vocab_mismatch(student: Any, other: Any) -> str | None:
    """None when `other` tokenizes as `student` does (same size, eos, probe ids' texts and a probe text's ids);
    else what differs, in words."""
    if student.vocab_size != other.vocab_size:
        return f"vocab size {other.vocab_size} vs the student's {student.vocab_size}"
    if list(student.eos_token_ids) != list(other.eos_token_ids):
        return f"eos ids {list(other.eos_token_ids)} vs the student's {list(student.eos_token_ids)}"
    for i in _probe_ids(student.vocab_size):
        a, b = student.decode([i]), other.decode([i])
        if a != b:
            return f"token id {i} is {b!r} vs the student's {a!r}"
    try:
        a_ids = student.encode(PROBE_TEXT)
    except ValueError:  # a tokenizer that cannot encode the probe (a char tokenizer's alphabet): ids compared only
        return None
    b_ids = other.encode(PROBE_TEXT)
    if a_ids != b_ids:
        i = next((i for i, (a, b) in enumerate(zip(a_ids, b_ids, strict=False)) if a != b), min(len(a_ids), len(b_ids)))
        return (f"{PROBE_TEXT!r} encodes to {len(b_ids)} ids vs the student's {len(a_ids)}, its token {i} to "
                f"{b_ids[i:i + 1]} vs {a_ids[i:i + 1]}")
    return None


def check_same_vocab(student: Any, other: Any, what: str) -> None:
    """Refuse, in one line, a model whose tokenizer is not the student's (`what`: the setting that named it)."""
    if (why := vocab_mismatch(student, other)) is not None:
        raise ValueError(f"{what} has a different tokenizer than the student (model.path): {why}; it must score the "
                         "student's token ids, so use a model of the same tokenizer")
