"""Each row's constraint during a call: its matcher, and the tokens it allows next on the device.

Matchers write one packed int32 bitmask row per sequence on the host (the engines'
kernels); it is copied to the model's device and unpacked there with a few vectorized
torch ops, so logits never leave the device.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch

from ..engines import Watch, bits, fill_rows
from ..heal import heal_matchers

__all__ = ["RowConstraints"]


class RowConstraints:
    """Per row, the constraint's matcher and the tokens the row may emit next, on a device.

    Matchers write a packed int32 bitmask on the host (a few KB per row even for 128k
    vocabularies) as soon as a row moves; it is copied to the device and unpacked there,
    so logits never leave it. A bitmask row with a single bit says that the constraint
    allows one token only: EOS (the row is done) or a forced token (fast-forward), which
    is by construction the token decoding one by one would choose.

    Parameters
    ----------
    constraint
        A :class:`~continuous.engines.Constraint`, or ``None`` for free text.
    matchers
        One matcher per row instead of the constraint's (healing wraps them).
    rows
        Number of rows.
    vocab_size
        Width of the logits (may exceed the tokenizer's size; extra ids are never allowed).
    n_tokens
        Size of the tokenizer's vocabulary.
    eos
        The EOS id of the constraint (the tokenizer's).
    device
        Where the logits are.
    also_eos
        The ids that end a row (a chat model's end of turn too): allowed wherever EOS is.
    """

    def __init__(self, constraint, rows: int, vocab_size: int, n_tokens: int, eos: int | None,
                 device: torch.device, matchers: list | None = None, also_eos: Sequence[int] = ()):
        self.constraint = constraint
        if matchers is None and constraint is not None:
            matchers = [constraint.matcher() for _ in range(rows)]
        self.matchers = matchers
        self.vocab_size, self.n_tokens, self.eos, self.device = vocab_size, n_tokens, eos, device
        self.also_eos = sorted(set(also_eos) - {eos})
        self.bitmask = torch.zeros((rows, bits.words(vocab_size)), dtype=torch.int32,
                                   pin_memory=device.type == "cuda")
        self.single: list[int | None] = [None] * rows  # the one allowed token of a row, if one
        # Free text may emit any real token; ids past the tokenizer (padded embeddings) never.
        self.free = None
        self._free_bias = None  # free's bias (see bias), made once
        if n_tokens < vocab_size:
            self.free = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.free[:n_tokens] = True
        if self.matchers is not None:
            for r in range(rows):
                self._refresh(r)

    @classmethod
    def of_call(cls, constraint, model, rows, removed: list[str], device: torch.device) -> "RowConstraints":
        """The constraints of a call's rows; rows that healing backed up spell ``removed`` first.

        A constraint with a section that a row may be inside already (a thinking section
        cut by the previous call) resumes each row where its text is."""
        tokenizer = model.tokenizer
        matchers = None
        if constraint is not None:
            resume = getattr(constraint, "resume", None)
            matchers = [constraint.matcher() if resume is None else resume(rows.real_ids(r), rows.texts[r],
                                                                           rows.ends[r]) for r in range(rows.n_rows)]
        return cls(constraint, rows.n_rows, model.vocab_size, len(tokenizer), tokenizer.eos_token_id, device,
                   heal_matchers(tokenizer, rows, removed, matchers) or matchers, also_eos=model.eos_token_ids)

    @classmethod
    def joined(cls, parts: list["RowConstraints"]) -> "RowConstraints":
        """The rows of several calls' constraints of one constraint object, one after the other."""
        joined = copy.copy(parts[0])
        joined.matchers = None if joined.matchers is None else [m for p in parts for m in p.matchers]
        joined.bitmask = torch.cat([p.bitmask for p in parts])
        if joined.device.type == "cuda":
            joined.bitmask = joined.bitmask.pin_memory()
        joined.single = [s for p in parts for s in p.single]
        return joined

    def complete_rows(self, rows: slice) -> list[bool] | None:
        """:meth:`complete` of some rows."""
        return None if self.constraint is None else [m.accepting() for m in self.matchers[rows]]

    def watch(self) -> Watch | None:
        """A new row's watch over what the constraint could not enforce in its grammar (``None``: nothing)."""
        return self.constraint.watch() if self.constraint is not None else None

    def complete(self) -> list[bool] | None:
        """Per row, whether the constraint accepts the text so far (``None`` for free text)."""
        return self.complete_rows(slice(None))

    def _refresh(self, row: int) -> None:
        self.matchers[row].fill(self.bitmask[row])
        self.single[row] = bits.only(self.bitmask[row])

    def allowed(self) -> torch.Tensor | None:
        """Boolean ``[rows, vocab_size]`` on the device, or ``None`` when every token is allowed."""
        if self.matchers is None:
            return self.free
        return self.unpacked(self.bitmask)

    def bias(self) -> torch.Tensor | None:
        """:meth:`allowed` as a bias to add to the logits: 0 where a token is allowed, ``-inf`` where
        not (``[vocab_size]`` for free text; ``None`` when every token is allowed)."""
        if self.matchers is None:
            if self.free is not None and self._free_bias is None:
                self._free_bias = torch.zeros(self.vocab_size, device=self.device).masked_fill_(~self.free, -torch.inf)
            return self._free_bias
        return self.bias_of(self.bitmask)

    def bias_of(self, bitmask: torch.Tensor) -> torch.Tensor:
        """:meth:`unpacked` as a bias (see :meth:`bias`)."""
        bias = bits.bias(bitmask.to(self.device, non_blocking=True), self.vocab_size)
        if self.also_eos:
            bias[:, self.also_eos] = bias[:, self.eos, None].clone()
        if self.free is not None:
            bias[:, self.n_tokens :] = -torch.inf
        return bias

    def unpacked(self, bitmask: torch.Tensor) -> torch.Tensor:
        """Boolean ``[n, vocab_size]`` on the device of packed rows like :attr:`bitmask`'s (or copies
        of them kept from earlier positions)."""
        allowed = bits.unpack(bitmask.to(self.device, non_blocking=True), self.vocab_size)
        if self.also_eos:
            allowed[:, self.also_eos] = allowed[:, self.eos, None].clone()
        return allowed if self.free is None else allowed & self.free

    def advance(self, row: int, token_id: int) -> None:
        """Move a row's matcher past a token it emitted."""
        if self.matchers is not None:
            self.matchers[row].advance(token_id)
            self._refresh(row)

    def consume(self, row: int, token_id: int) -> None:
        """:meth:`advance` without writing the row's mask: :meth:`refresh_all` writes those of the
        rows consumed together, before anything reads them."""
        self.matchers[row].advance(token_id)

    @staticmethod
    def refresh_all(parts: list[tuple["RowConstraints", list[int]]]) -> None:
        """Write the masks (and singles) of the given rows of every part at once: one fill for
        the rows of every call (see :func:`~continuous.engines.fill_rows`)."""
        matchers = [c.matchers[r] for c, rows in parts for r in rows]
        if not matchers:
            return
        block = torch.empty((len(matchers), parts[0][0].bitmask.shape[1]), dtype=torch.int32)
        fill_rows(matchers, block)
        singles, rows_of = bits.only_rows(block), block.numpy()
        at = 0
        for c, rows in parts:
            n, own = len(rows), c.bitmask.numpy()  # written in place: a pinned buffer stays pinned
            every = rows == list(range(len(own)))  # every row, in order (most steps): a slice, not an index
            own[slice(None) if every else rows] = rows_of[at : at + n]
            for r, single in zip(rows, singles[at : at + n]):
                c.single[r] = single
            at += n

    def rollback(self, row: int, n: int) -> None:
        """Undo a row's last ``n`` tokens."""
        if self.matchers is not None and n:
            self.matchers[row].rollback(n)
            self._refresh(row)

    def forced(self, row: int) -> list[int]:
        """The tokens a row's constraint forces next (empty when it has a choice).

        A single allowed token is forced; otherwise the engine may still know a forced
        text and its canonical tokens (llguidance's fast-forward tokens).
        """
        single = self.single[row]
        if single is not None:
            return [] if single == self.eos else [single]
        return self.matchers[row].forced() if self.matchers is not None else []

    def done(self, row: int) -> bool:
        """Whether nothing but EOS may follow in this row."""
        return self.matchers is not None and self.single[row] == self.eos

    def select(self, rows: list[int], index: torch.Tensor | None = None) -> "RowConstraints":
        """Reorder (and duplicate) rows in place, for beams and forks."""
        if self.matchers is not None:
            seen = set()
            picked = []
            for i in rows:  # the first use of a matcher takes it, repeats copy it
                picked.append(self.matchers[i] if i not in seen else self.matchers[i].copy())
                seen.add(i)
            self.matchers = picked
        self.single = [self.single[i] for i in rows]
        self.bitmask = self.bitmask[rows].contiguous()
        if self.device.type == "cuda":
            self.bitmask = self.bitmask.pin_memory()
        return self
