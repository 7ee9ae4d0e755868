"""Lark grammars made ready for llguidance's parser: alternations of literals as lexemes.

llguidance's Earley parser holds one item per alternative of each rule it predicts, and
a row of more than :data:`MAX_ALTERNATIVES` items fails while decoding. An alternation of
string literals (``w: "abcd" | "efgh" | ...``) is a single token of the language, so it is
compiled as one terminal, which the lexer serves as one regular expression whatever its
size. A rule with more alternatives of another kind is refused when it is built.
"""

from __future__ import annotations

import re

__all__ = ["lexemes", "MAX_ALTERNATIVES"]

#: The most items llguidance's parser takes in one row (its ``max_items_in_row``).
MAX_ALTERNATIVES = 2000

_RULE = re.compile(r"(?P<head>[?!]?(?P<name>[a-z_][a-z_0-9]*)\s*:)(?P<body>.*)", re.S)
_LITERAL = r'"(?:[^"\\\n]|\\.)*"i?'
_LITERALS = re.compile(rf"\s*{_LITERAL}(?:\s*\|\s*{_LITERAL})+\s*")
#: What a body's alternatives are counted past: string literals, regexes, comments.
_OPAQUE = re.compile(rf"{_LITERAL}|/(?:[^/\\\n]|\\.)+/[imslux]*|//[^\n]*")


def lexemes(grammar: str) -> str:
    """The grammar with each rule that is an alternation of string literals made a terminal.

    ``w: "a" | "b"`` becomes ``w: W_LITERALS`` and ``W_LITERALS: "a" | "b"``: the same
    language, lexed as one token.

    Raises
    ------
    ValueError
        For a rule with more alternatives than llguidance's parser takes at once, naming it.
    """
    out = []
    for head, name, body in _rules(grammar):
        if name is None:
            out.append(head)
            continue
        terminal = f"{name.upper()}_LITERALS"
        if _LITERALS.fullmatch(body) and terminal not in grammar:
            out.append(f"{head} {terminal}\n{terminal}: {body.strip()}\n")
            continue
        _check_alternatives(name, body)
        out.append(head + body)
    return "".join(out)


def _rules(grammar: str):
    """The grammar's pieces in order: ``(head, name, body)`` of each rule (its continuation
    lines, those that start with ``|``, included), ``(line, None, "")`` of other lines."""
    lines = grammar.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        rule = _RULE.fullmatch(lines[i])
        if rule is None:
            yield lines[i], None, ""
            i += 1
            continue
        body = rule["body"]
        i += 1
        while i < len(lines) and lines[i].lstrip().startswith("|"):
            body += lines[i]
            i += 1
        yield rule["head"], rule["name"], body


def _check_alternatives(name: str, body: str) -> None:
    bare = _OPAQUE.sub("x", body)
    depth, count = 0, 1
    for char in bare:
        depth += (char in "([") - (char in ")]")
        count += char == "|" and depth == 0
    if count > MAX_ALTERNATIVES:
        raise ValueError(f"rule {name!r} has {count} alternatives, and llguidance's parser takes at most "
                         f"{MAX_ALTERNATIVES} at a time: write an alternation of literals alone in its rule "
                         "(it is then lexed as one token), or split the rule into groups")
