"""Pull a final numeric answer out of free-form model text (GSM8K-style grading).

Order of preference, most explicit first:

1. the last ``\\boxed{...}`` (brace-matched, so ``\\boxed{\\frac{1}{2}}`` works),
2. the text after the last ``####`` (GSM8K's own answer marker),
3. the last "answer is X" / "answer: X",
4. the last number anywhere in the text.

Numbers may carry thousands separators (``1,234``), a currency sign (``$5``, ``-$5``), a percent sign,
a sign (ASCII or Unicode minus), decimals, and a sentence-ending period (``... is 42.``). Everything here is
a pure function of its input.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# A sign only counts as a minus when it is not glued to a preceding word, digit or bracket: in "10-5" the
# '-' is subtraction, in "is -5" it is a sign.
_SIGN = r"(?:(?<![\w)\]}])[-\u2212])?"
# Thousands groups must be exactly three digits, so "1,2,3" reads as three numbers, "1,234" as one.
_NUMBER_RE = re.compile(
    _SIGN + r"(?:\$\s?)?" + _SIGN + r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
    r"|" + _SIGN + r"\$?(?<!\d)\.\d+"
)
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*([^{}]+?)\s*\}\s*\{\s*([^{}]+?)\s*\}")
_SLASH_FRAC_RE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*/\s*(-?\d+(?:\.\d+)?)\s*$")
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:|=)\s*[:=]?\s*", re.IGNORECASE)


@dataclass(frozen=True)
class Extracted:
    """An extracted answer: its value, which rule found it, and the raw text it came from."""

    value: float
    source: str  # "boxed" | "hash" | "answer_is" | "last_number"
    raw: str


def _to_float(token: str) -> float | None:
    s = token.replace("\u2212", "-").replace("$", "").replace(",", "").replace(" ", "")
    neg = s.count("-") % 2 == 1
    s = s.replace("-", "")
    try:
        v = float(s)
    except ValueError:
        return None
    return -v if neg else v


def find_numbers(text: str) -> list[float]:
    """Every number in `text`, in order (commas, `$`, signs and decimals understood)."""
    out = []
    for m in _NUMBER_RE.finditer(text):
        v = _to_float(m.group(0))
        if v is not None:
            out.append(v)
    return out


def parse_number(text: str) -> float | None:
    """The number a short answer string denotes: ``"$1,234.50"``, ``"-7."``, ``"50%"``, ``"\\frac{3}{4}"``,
    ``"3/4"``, ``"x = 12"`` (the last number wins when there are several). None if there is none."""
    s = text.strip()
    s = _FRAC_RE.sub(lambda m: f"{m.group(1)}/{m.group(2)}", s)
    s = re.sub(r"\\text\s*\{[^{}]*\}", " ", s)  # units: \text{ dollars}
    s = s.replace("\\%", "%").replace("\\$", "$").replace("\\,", "").replace("\\!", "")  # \, = thin space
    frac = _SLASH_FRAC_RE.match(s.replace("$", "").replace(",", ""))
    if frac:
        num, den = float(frac.group(1)), float(frac.group(2))
        return num / den if den != 0 else None
    nums = find_numbers(s)
    return nums[-1] if nums else None


def extract_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` (nested braces matched), or None if absent / unclosed."""
    start = text.rfind("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i].isspace():
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1:j]
        # unclosed or brace-less \boxed: try an earlier one
        start = text.rfind("\\boxed", 0, start)
    return None


def extract_after_hash(text: str) -> str | None:
    """Text after the last ``####`` up to the end of that line, or None if there is no marker."""
    k = text.rfind("####")
    if k == -1:
        return None
    return text[k + 4:].split("\n", 1)[0]


def extract_answer_is(text: str) -> str | None:
    """Text after the last "answer is" / "answer:" up to the end of that line, or None."""
    matches = list(_ANSWER_IS_RE.finditer(text))
    if not matches:
        return None
    return text[matches[-1].end():].split("\n", 1)[0]


def extract_number(text: str) -> Extracted | None:
    """The final numeric answer in `text` by the preference order in the module docstring, or None.

    A rule that finds its marker but no number in it falls through to the next rule, so ``\\boxed{}``
    followed by nothing useful still lets a later "answer is 5" count.
    """
    for source, finder in (("boxed", extract_boxed), ("hash", extract_after_hash), ("answer_is", extract_answer_is)):
        raw = finder(text)
        if raw is not None:
            first_only = source != "boxed"  # after a marker, the answer is the first number ("#### 5 apples, 3 pears")
            value = _first_number(raw) if first_only else parse_number(raw)
            if value is not None:
                return Extracted(value, source, raw.strip())
    nums = list(_NUMBER_RE.finditer(text))
    for m in reversed(nums):
        v = _to_float(m.group(0))
        if v is not None:
            return Extracted(v, "last_number", m.group(0).strip())
    return None


def _first_number(raw: str) -> float | None:
    s = _FRAC_RE.sub(lambda m: f"{m.group(1)}/{m.group(2)}", raw)
    frac = re.match(r"\s*\$?(-?\d+(?:\.\d+)?)\s*/\s*(-?\d+(?:\.\d+)?)(?![\d.])", s)
    if frac:
        den = float(frac.group(2))
        return float(frac.group(1)) / den if den != 0 else None
    nums = find_numbers(s)
    return nums[0] if nums else None


def numbers_equal(a: float | None, b: float | None, rel_tol: float = 1e-6, abs_tol: float = 1e-6) -> bool:
    """Numeric equality with a small tolerance (so 0.1 + 0.2 == 0.3); None and non-finite never match."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return False
    return math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol)
