"""Pull a final numeric answer out of free-form model text (GSM8K-style grading).

Order of preference, most explicit first:

1. the last ``\\boxed{...}`` (brace-matched, so ``\\boxed{\\frac{1}{2}}`` works),
2. the text after the last ``####`` (GSM8K's own answer marker),
3. the last "answer is X" / "answer: X",
4. the last number anywhere in the text.

Numbers may carry thousands separators (``1,234``), a currency sign (``$5``, ``-$5``), a percent sign,
a sign (ASCII or Unicode minus), decimals, and a sentence-ending period (``... is 42.``). Everything here is
a pure function of its input.

Values are exact: every number is parsed from its text into a `fractions.Fraction` (``"3.50"`` is 7/2,
``"3/4"`` and ``"0.75"`` are both 3/4), and `numbers_equal` compares exactly, so ``2,880,001`` never grades
as ``2880000`` and ``0.3`` equals ``0.30``. Extraction is linear in the length of the text, whatever it holds
(a degenerate completion of thousands of unclosed ``\\boxed{`` included). A number longer than Python's
int-from-string limit (4,300 digits by default, see `sys.set_int_max_str_digits`) is no number here: it is
skipped, as text that cannot be an answer.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

# A sign only counts as a minus when it is not glued to a preceding word, digit or bracket: in "10-5" the
# '-' is subtraction, in "is -5" it is a sign.
_SIGN = r"(?:(?<![\w)\]}])[-\u2212])?"
# Thousands groups must be exactly three digits, so "1,2,3" reads as three numbers, "1,234" as one.
_NUMBER_RE = re.compile(
    _SIGN + r"(?:\$\s?)?" + _SIGN + r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
    r"|" + _SIGN + r"\$?(?<!\d)\.\d+"
)
# Each argument starts at its first non-space character and runs to the closing brace (stripped by the
# substitution): no two quantifiers can trade the same characters, so no backtracking blow-up (the pattern
# `\{\s*([^{}]+?)\s*\}` took cubic time on "\frac{" + spaces + "}").
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*([^{}\s][^{}]*)\}\s*\{\s*([^{}\s][^{}]*)\}")
_BOXED_RE = re.compile(r"\\boxed\s*\{")
_BRACE_RE = re.compile(r"[{}]")
_SLASH_FRAC_RE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*/\s*(-?\d+(?:\.\d+)?)\s*$")
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:|=)\s*[:=]?\s*", re.IGNORECASE)


@dataclass(frozen=True)
class Extracted:
    """An extracted answer: its exact value, which rule found it, and the raw text it came from."""

    value: Fraction
    source: str  # "boxed" | "hash" | "answer_is" | "last_number"
    raw: str


def _to_exact(token: str) -> Fraction | None:
    """The exact value of a `_NUMBER_RE` match: signs, `$`, thousands commas and spaces dropped."""
    s = "".join(token.replace("\u2212", "-").replace("$", "").replace(",", "").split())
    neg = s.count("-") % 2 == 1
    s = s.replace("-", "")
    try:
        v = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return -v if neg else v


def _ratio(num: str, den: str) -> Fraction | None:
    """``num / den`` exactly, for two plain decimal strings; None when the denominator is zero."""
    d = Fraction(den)
    return Fraction(num) / d if d != 0 else None


def _sub_fracs(text: str) -> str:
    """``\\frac{a}{b}`` (and ``\\dfrac`` / ``\\tfrac``) rewritten as ``a/b``."""
    return _FRAC_RE.sub(lambda m: f"{m.group(1).strip()}/{m.group(2).strip()}", text)


def find_numbers(text: str) -> list[Fraction]:
    """Every number in `text`, in order, as exact values (commas, `$`, signs and decimals understood)."""
    out = []
    for m in _NUMBER_RE.finditer(text):
        v = _to_exact(m.group(0))
        if v is not None:
            out.append(v)
    return out


def parse_number(text: str) -> Fraction | None:
    """The exact number a short answer string denotes: ``"$1,234.50"``, ``"-7."``, ``"50%"``,
    ``"\\frac{3}{4}"``, ``"3/4"``, ``"x = 12"`` (the last number wins when there are several). None if there
    is none."""
    s = _sub_fracs(text.strip())
    s = re.sub(r"\\text\s*\{[^{}]*\}", " ", s)  # units: \text{ dollars}
    s = s.replace("\\%", "%").replace("\\$", "$").replace("\\,", "").replace("\\!", "")  # \, = thin space
    frac = _SLASH_FRAC_RE.match(s.replace("$", "").replace(",", ""))
    if frac:
        return _ratio(frac.group(1), frac.group(2))
    nums = find_numbers(s)
    return nums[-1] if nums else None


def extract_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` (nested braces matched), or None if absent / unclosed.

    An unclosed later box falls back to an earlier closed one. One pass over the braces from the end of the
    text: a '}' is pushed, a '{' takes the nearest unmatched '}' to its right (the same partner as counting
    depth forward from it), and the first box-opening brace met that has a partner is the answer.
    """
    opens = {m.end() - 1 for m in _BOXED_RE.finditer(text)}  # the '{' of each \boxed{
    if not opens:
        return None
    closes: list[int] = []
    for m in reversed(list(_BRACE_RE.finditer(text, min(opens)))):
        i = m.start()
        if text[i] == "}":
            closes.append(i)
        elif closes:
            j = closes.pop()
            if i in opens:
                return text[i + 1:j]
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
        v = _to_exact(m.group(0))
        if v is not None:
            return Extracted(v, "last_number", m.group(0).strip())
    return None


def _first_number(raw: str) -> Fraction | None:
    s = _sub_fracs(raw)
    frac = re.match(r"\s*\$?(-?\d+(?:\.\d+)?)\s*/\s*(-?\d+(?:\.\d+)?)(?![\d.])", s)
    if frac:
        return _ratio(frac.group(1), frac.group(2))
    nums = find_numbers(s)
    return nums[0] if nums else None


_Number = numbers.Real | Decimal  # what numbers_equal takes


def _as_fraction(x: _Number | None) -> Fraction | None:
    """`x` as an exact Fraction; None for None, NaN and infinities.

    A float only holds about 15 significant decimal digits, so it is read at that precision: 0.1 + 0.2 is
    0.3, and float artefacts never decide a grade. Ints, Fractions and Decimals are taken exactly.
    """
    if x is None:
        return None
    if isinstance(x, numbers.Rational):  # int, bool, Fraction, numpy integers
        return Fraction(x.numerator, x.denominator)
    if isinstance(x, Decimal):
        return Fraction(x) if x.is_finite() else None
    if isinstance(x, numbers.Real):
        f = float(x)
        return Fraction(format(f, ".15g")) if math.isfinite(f) else None
    raise TypeError(f"numbers_equal takes numbers (int, float, Fraction, Decimal) or None, got {type(x).__name__}")


def numbers_equal(a: _Number | None, b: _Number | None) -> bool:
    """Exact numeric equality: integers must match exactly (2880001 != 2880000), decimals compare as decimals
    (3.50 == 3.5, 0.75 == 3/4), floats are read at 15 significant digits (see `_as_fraction`). None, NaN and
    infinities never match."""
    fa, fb = _as_fraction(a), _as_fraction(b)
    return fa is not None and fb is not None and fa == fb
