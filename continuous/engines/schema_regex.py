"""outlines_core's JSON Schema compiler, with exact integer bounds and calendar dates.

outlines_core turns a schema into one regular expression, writing integer bounds and
string formats loosely. Here bounded integers and the ``date`` and ``date-time``
formats are swapped for markers before compiling and for exact regexes after, so the
language is the schema's: ``{"type": "integer", "minimum": 3, "maximum": 120}`` takes
3 to 120 and nothing else, ``2023-02-31`` is not a date.
"""

from __future__ import annotations

import json
import math

from outlines_core.json_schema import build_regex_from_schema

from .formats import DATE, DATE_TIME

__all__ = ["schema_regex", "integer_range", "natural_range"]


def _digit_span(lo: str, hi: str) -> str:
    """Regex of the decimal strings from ``lo`` to ``hi``, both of the same length."""
    if not lo:
        return ""
    if lo[0] == hi[0]:
        return lo[0] + _group(_digit_span(lo[1:], hi[1:]))
    rest = len(lo) - 1
    parts = []
    first, last = int(lo[0]), int(hi[0])
    # The first and last digits take the whole span below them when their tail is
    # 0...0 or 9...9; otherwise they get their own, narrower, branch.
    if lo[1:] != "0" * rest:
        parts.append(lo[0] + _group(_digit_span(lo[1:], "9" * rest)))
        first += 1
    tail_hi = hi[1:] == "9" * rest
    if not tail_hi:
        last -= 1
    if first <= last:
        digits = str(first) if first == last else f"[{first}-{last}]"
        parts.append(digits + ("[0-9]" + (f"{{{rest}}}" if rest > 1 else "") if rest else ""))
    if not tail_hi:
        parts.append(hi[0] + _group(_digit_span("0" * rest, hi[1:])))
    return "|".join(parts)


def _group(pattern: str) -> str:
    return pattern if "|" not in pattern else f"({pattern})"


def natural_range(low: int, high: int | None) -> str:
    """Regex of the decimal integers ``n`` with ``low <= n <= high`` (``high=None``: no bound).

    ``0 <= low``; no leading zeros, exactly as JSON writes integers.
    """
    parts = []
    digits = len(str(low))
    while high is None or digits <= len(str(high)):
        a = max(low, 10 ** (digits - 1) if digits > 1 else 0)
        if high is None and a == 10 ** (digits - 1):
            # From here every longer integer is in range.
            parts.append(f"[1-9][0-9]{{{digits - 1},}}")
            break
        b = 10**digits - 1 if high is None else min(high, 10**digits - 1)
        parts.append(_digit_span(str(a), str(b)))
        digits += 1
    return "|".join(parts)


def integer_range(low: int | None, high: int | None) -> str:
    """Regex of the JSON integers ``n`` with ``low <= n <= high`` (``None``: no bound).

    Negative integers are written ``-`` and their absolute value; ``-0`` is never produced.
    """
    if low is not None and high is not None and low > high:
        raise ValueError(f"no integer lies in [{low}, {high}]")
    parts = []
    if low is None or low < 0:  # the negative part: -|n| with |n| in [max(1, -high), -low]
        small = 1 if high is None or high >= 0 else -high
        parts.append("-" + _group(natural_range(small, None if low is None else -low)))
    if high is None or high >= 0:
        parts.append(natural_range(max(low or 0, 0), high))
    return "(" + "|".join(parts) + ")"


def _bound(node: dict, key: str, exclusive: str, up: bool):
    """The integer bound of a schema node on one side, or ``None``.

    Draft 4 writes exclusiveness as a boolean beside the bound; later drafts as a
    number. Non-integer bounds round inwards.
    """
    bounds = []
    if isinstance(node.get(key), (int, float)) and not isinstance(node.get(key), bool):
        value = node[key]
        strict = node.get(exclusive) is True
        bounds.append(_inward(value, strict, up))
    if isinstance(node.get(exclusive), (int, float)) and not isinstance(node.get(exclusive), bool):
        bounds.append(_inward(node[exclusive], True, up))
    if not bounds:
        return None
    return max(bounds) if up else min(bounds)


def _inward(value, strict: bool, up: bool) -> int:
    if up:  # a lower bound: the smallest integer above (or at) it
        n = math.ceil(value)
        return n + 1 if strict and n == value else n
    n = math.floor(value)
    return n - 1 if strict and n == value else n


_UNSIGNED = r"(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-][0-9]+)?"  # outlines_core's JSON number, no sign


def _real_bound(node: dict, key: str, exclusive: str, pick):
    """The tighter of a node's plain and exclusive numeric bounds on one side, or ``None``."""
    values = [node[k] for k in (key, exclusive)
              if isinstance(node.get(k), (int, float)) and not isinstance(node.get(k), bool)]
    return pick(values) if values else None


def _exclusive_max(node: dict) -> bool:
    value = node.get("exclusiveMaximum")
    return value is True or (isinstance(value, (int, float)) and not isinstance(value, bool)
                             and value <= node.get("maximum", value))


class _Exact:
    """Schema nodes whose regex we write ourselves, each swapped in for a unique marker.

    outlines_core writes a ``const`` integer as its digits, so a node replaced by a
    marker constant leaves those digits in the regex, where the exact regex goes.
    """

    def __init__(self, schema_str: str):
        self.base = 730194628551
        while str(self.base) in schema_str:
            self.base += 1
        self.patterns: list[str] = []

    def mark(self, pattern: str) -> dict:
        self.patterns.append(pattern)
        return {"const": int(f"{self.base}{len(self.patterns):04d}")}

    def substitute(self, regex: str) -> str:
        for k, pattern in enumerate(self.patterns, 1):
            regex = regex.replace(f"{self.base}{k:04d}", f"({pattern})")
        return regex

    def rewrite(self, node):
        """The schema with bounded integers and dates replaced by markers."""
        if isinstance(node, list):
            return [self.rewrite(n) for n in node]
        if not isinstance(node, dict):
            return node
        node = {k: self.rewrite(v) for k, v in node.items()}
        kind = node.get("type")
        # Keywords that narrow the integers further stay with outlines_core (and the
        # validation of ``value``).
        if kind == "integer" and not {"multipleOf", "enum", "const"} & set(node):
            low = _bound(node, "minimum", "exclusiveMinimum", up=True)
            high = _bound(node, "maximum", "exclusiveMaximum", up=False)
            if low is not None or high is not None:
                return self.mark(integer_range(low, high))
        if kind == "number" and not {"multipleOf", "enum", "const"} & set(node):
            # A regex cannot bound a real number simply, but it can fix its sign; the
            # bounds themselves are checked on ``value``.
            low = _real_bound(node, "minimum", "exclusiveMinimum", max)
            if low is not None and low >= 0:
                return self.mark(_UNSIGNED)
            high = _real_bound(node, "maximum", "exclusiveMaximum", min)
            if high is not None and (high < 0 or (high == 0 and _exclusive_max(node))):
                return self.mark("-" + _UNSIGNED)
        if kind == "string" and node.get("format") in ("date", "date-time"):
            return self.mark('"' + (DATE if node["format"] == "date" else DATE_TIME) + '"')
        return node


def schema_regex(document, whitespace_pattern: str | None = None) -> str:
    """outlines_core's regex of a JSON schema, with exact integer bounds and calendar dates.

    Raises
    ------
    ValueError
        When the compiler refuses the schema, with its reason.
    """
    text = json.dumps(document)
    try:
        exact = _Exact(text)
        pattern = build_regex_from_schema(json.dumps(exact.rewrite(document)), whitespace_pattern)
    except Exception as exc:  # the compiler raises plain ValueError/TypeError with its reason
        raise ValueError(f"cannot build a constraint from this JSON schema: {exc}") from exc
    return exact.substitute(pattern)
