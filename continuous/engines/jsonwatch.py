"""What a relaxed JSON grammar does not enforce, enforced while decoding.

A :class:`JsonWatch` follows one row's JSON text as it is generated. Each time a value
completes (a string, a number, an array item, an object) it checks, on that value, the
subschemas that apply at its place in the document and hold a keyword the grammar
dropped (``not``, ``uniqueItems``, ``if``/``then``...). A value that breaks one is a
match, as a banned phrase is, with its span: the row rewinds to the first token it chose
within the value (the tokens the grammar forced could not be otherwise, the first choice
decided the value) and forbids that token there, so generation goes on within the schema.
An object that lacks a property (also one of the members of a ``oneOf`` of ``required``)
is matched at its closing brace, so the row writes more before closing it; an object that
its last members break (a second exclusive member), from the first of them; an array
that lacks an item it must contain, at its last item. An item
that repeats an earlier one of a ``uniqueItems`` array is caught as soon as it completes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from . import Match
from .schema import place, validator

__all__ = ["JsonWatch", "Checks"]

#: Errors about something missing: the fix is more content before the closing bracket.
_MISSING = frozenset({"required", "minContains", "contains", "dependentRequired", "dependencies", "minItems",
                      "minProperties"})

class Checks:
    """The subschemas of a schema that hold dropped keywords, found by their place in a document.

    Parameters
    ----------
    schema
        The whole schema (normalized, not relaxed).
    dropped
        The keywords the grammar does not enforce.
    """

    def __init__(self, schema, dropped: set[str]):
        import regex

        self.schema, self.dropped, self._regex = schema, dropped, regex
        self._validator = validator(schema)
        self._cache: dict[tuple, list] = {}

    def at(self, path: tuple) -> list:
        """The subschemas that apply at ``path`` (keys and indexes) and hold a dropped keyword."""
        found = self._cache.get(path)
        if found is None:
            nodes = self._expand(self.schema)
            for step in path:
                nodes = [n for node in nodes for sub in self._step(node, step) for n in self._expand(sub)]
            found = self._cache[path] = [n for n in nodes if self.dropped & set(n)]
        return found

    def errors(self, subschema, value) -> list:
        return list(self._validator.evolve(schema=subschema).iter_errors(value))

    def _expand(self, node) -> list:
        """The node, what its ``$ref`` points to, and its ``allOf`` members (which all apply)."""
        if not isinstance(node, dict):
            return []
        out = [node]
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            target = self._pointer(ref)
            if target is not None and target is not node:
                out += self._expand(target)
        for member in node.get("allOf", ()):
            out += self._expand(member)
        return out

    def _pointer(self, ref: str):
        node = self.schema
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def _step(self, node: dict, step) -> list:
        """The subschemas of ``node`` for its member ``step`` (a key, or an index of an array)."""
        if isinstance(step, int):
            prefix = node.get("prefixItems", [])
            if step < len(prefix):
                return [prefix[step]]
            items = node.get("items")
            return [items] if isinstance(items, dict) else []
        out = [sub for name, sub in node.get("properties", {}).items() if name == step]
        out += [sub for pattern, sub in node.get("patternProperties", {}).items()
                if self._regex.search(pattern, step)]
        extra = node.get("additionalProperties")
        if not out and isinstance(extra, dict):
            out.append(extra)
        return out


@dataclass
class _Frame:
    kind: str  # "{" or "["
    start: int
    path: tuple
    key: str | None = None
    index: int = 0
    items: list = field(default_factory=list)  # completed items, where uniqueItems applies
    last: tuple | None = None  # the span of its last completed member
    members: list = field(default_factory=list)  # where an object's members start: the comma before, or the key


@dataclass
class _Scan:
    """Where the scanner is: open containers, and the scalar being read."""

    stack: list = field(default_factory=list)
    scalar: int | None = None  # where the scalar being read starts
    string: bool = False
    escape: bool = False
    key: bool = False  # the string being read is an object's key

    def copy(self) -> "_Scan":
        frames = [_Frame(f.kind, f.start, f.path, f.key, f.index, list(f.items), f.last, list(f.members))
                  for f in self.stack]
        return _Scan(frames, self.scalar, self.string, self.escape, self.key)


class JsonWatch:
    """One row's watch over a relaxed JSON constraint (feed, finish, hold back, rewind, copy)."""

    def __init__(self, checks: Checks):
        self.checks = checks
        self.text = ""
        self.scan = _Scan()
        self.marks: list[tuple[int, _Scan]] = [(0, _Scan())]  # the scan after each piece, for rewinds
        self.broken: str | None = None  # what the last violation broke, in words (for the exhausted warning)

    def feed(self, piece: str) -> list[Match]:
        """Add text; return the innermost value it completes that breaks the schema (as a value match)."""
        found = []
        for i, c in enumerate(piece, len(self.text)):
            self.text += c
            found += self._char(i, c)
        self.marks.append((len(self.text), self.scan.copy()))
        # A piece may complete an item and its array at once: the innermost value is what to change.
        return [max(found, key=lambda m: (m.start, m.end))] if found else []

    def finish(self) -> list[Match]:
        """The violations that the end of the text completes (a number that ends the document)."""
        scan = self.scan
        if scan.scalar is not None and not scan.string and not scan.stack:
            return self._complete(scan.scalar, len(self.text), (), None)
        return []

    def held(self) -> int:
        """Trailing characters a rewind may still take back: from the outermost open value on."""
        starts = [f.start for f in self.scan.stack] + ([self.scan.scalar] if self.scan.scalar is not None else [])
        return len(self.text) - min(starts) if starts else 0

    def rewind(self, length: int) -> None:
        while self.marks[-1][0] > length:
            self.marks.pop()
        at, scan = self.marks[-1]
        rest, self.text, self.scan = self.text[at:length], self.text[:at], scan.copy()
        for i, c in enumerate(rest, at):
            self.text += c
            self._char(i, c)

    def copy(self) -> "JsonWatch":
        new = JsonWatch.__new__(JsonWatch)
        new.checks, new.text, new.scan, new.marks = self.checks, self.text, self.scan.copy(), list(self.marks)
        new.broken = self.broken
        return new

    # ------------------------------------------------------------------ scanning
    def _char(self, i: int, c: str) -> list:
        scan = self.scan
        if scan.string:
            if scan.escape:
                scan.escape = False
            elif c == "\\":
                scan.escape = True
            elif c == '"':
                scan.string = False
                return self._scalar_end(i + 1)
            return []
        found = self._scalar_end(i) if scan.scalar is not None and c in ",]} \t\n\r" else []
        frame = scan.stack[-1] if scan.stack else None
        if c == '"':
            scan.string, scan.scalar = True, i
            scan.key = frame is not None and frame.kind == "{" and frame.key is None
            if scan.key and frame.index == 0:
                frame.members.append(i)
        elif c in "{[":
            scan.stack.append(_Frame(c, i, self._path()))
        elif c in "}]":
            scan.stack.pop()
            found += self._complete(frame.start, i + 1, frame.path, scan.stack[-1] if scan.stack else None, frame)
        elif c == ",":
            frame.key, frame.index = None, frame.index + 1
            if frame.kind == "{":
                frame.members.append(i)
        elif c not in ": \t\n\r" and scan.scalar is None:
            scan.scalar = i
        return found

    def _path(self) -> tuple:
        frame = self.scan.stack[-1] if self.scan.stack else None
        if frame is None:
            return ()
        return frame.path + ((frame.key,) if frame.kind == "{" else (frame.index,))

    def _scalar_end(self, end: int) -> list:
        scan, start = self.scan, self.scan.scalar
        scan.scalar = None
        frame = scan.stack[-1] if scan.stack else None
        if scan.key:
            scan.key = False
            frame.key = json.loads(self.text[start:end])
            return []
        return self._complete(start, end, self._path(), frame)

    def _complete(self, start: int, end: int, path: tuple, parent: _Frame | None, own: _Frame | None = None) -> list:
        """Check a completed value against what applies at its place; where to rewind if it fails."""
        if parent is not None:
            parent.last = (start, end)
        subschemas = self.checks.at(path)
        unique = parent is not None and parent.kind == "[" and any(
            s.get("uniqueItems") for s in self.checks.at(parent.path))
        if not subschemas and not unique:
            return []
        value = json.loads(self.text[start:end])
        if unique:
            if value in parent.items:
                self.broken = f"'uniqueItems' at {place(parent.path)}"
                return [Match(start, end, value=True)]  # a repeated item: another one, or the end of the array
            parent.items.append(value)
        errors = [e for s in subschemas for e in self.checks.errors(s, value)]
        if not errors:
            return []
        keywords = ", ".join(sorted({f"'{e.validator}'" for e in errors}))
        self.broken = f"{keywords} at {place(path)}"
        if own is not None and all(_missing(e) for e in errors):
            # An object lacking a property writes more before its brace; an array lacking
            # an item changes its last one (its length may be at its bound).
            if own.kind == "[" and own.last is not None:
                return [Match(own.last[0], own.last[1], value=True)]
            return [Match(end - 1, end, value=True)]
        if own is not None and own.kind == "{" and len(own.members) == len(value):
            return [self._members_to_drop(own, value, subschemas, end)]
        return [Match(start, end, value=True)]

    def _members_to_drop(self, own: _Frame, value: dict, subschemas: list, end: int) -> Match:
        """Where an object that breaks its schema goes back to: the fewest last members
        without which nothing but missing members is wrong (a second exclusive member, say),
        from the comma before them, so the row closes the object or writes other members."""
        keys = list(value)
        for k in range(len(keys) - 1, -1, -1):
            kept = {key: value[key] for key in keys[:k]}
            if all(_missing(e) for s in subschemas for e in self.checks.errors(s, kept)):
                return Match(own.members[k], end - 1, value=True)
        return Match(own.start, end, value=True)


def _missing(error) -> bool:
    """Whether an error is about something missing, also when a branch of a ``oneOf`` or
    ``anyOf`` fails only for that (none of two exclusive members is there yet)."""
    if error.validator in _MISSING:
        return True
    if error.validator not in ("oneOf", "anyOf") or not error.context:
        return False
    branches: dict = {}
    for e in error.context:
        branches.setdefault(e.relative_schema_path[0], []).append(e)
    return any(all(_missing(e) for e in errors) for errors in branches.values())
