"""Think, then answer: a thinking section of free text before any generator's constraint.

``think=`` on every generator takes ``True`` (the model's own markers), an int (a token
budget with those markers) or a :class:`Think`. The library writes the opening marker
after the prompt (unless the prompt is inside a section already); the model then writes
freely until the closing marker, after which the generator's constraint holds. When a
budget runs out, the library writes the closing marker itself (it is forwarded with the
next step, as fast-forward does). ``state.reasoning[row]`` is the thinking text of the
most recent call; ``value`` reads only the text after the closing marker.

A prompt or state already inside a section (its last opening marker not closed: a state
cut by ``max_tokens`` while it thought, a prompt that began the thoughts) goes on with
it: no second opening marker, and the tokens already in the section count against the
budget. A closing marker it had begun to write is written again whole.

Streams of such a generator yield :class:`Piece` s: strings that say which part they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Think", "Piece", "thinking", "markers", "Answer", "Tagger", "opened", "inside", "turn_tokens"]

#: Thinking markers that models use, as (open, close); ``think=True`` looks for them.
KNOWN_MARKERS = (("<think>", "</think>"), ("<thinking>", "</thinking>"),
                 ("<|begin_of_thought|>", "<|end_of_thought|>"), ("<|START_THINKING|>", "<|END_THINKING|>"))


@dataclass(frozen=True)
class Think:
    """A thinking section: its markers and an optional token budget.

    Parameters
    ----------
    open, close
        The text that opens and closes the section (special tokens or plain text).
    budget
        Most tokens the model may think (``None``: no limit); when they are spent the
        library writes ``close`` and the answer follows.
    """

    open: str = "<think>"
    close: str = "</think>"
    budget: int | None = None

    def __post_init__(self):
        for name in ("open", "close"):
            marker = getattr(self, name)
            if not isinstance(marker, str) or not marker:
                raise ValueError(f"Think's {name} marker must be a non-empty str, got {marker!r}")
        if self.open == self.close:
            raise ValueError(f"Think's open and close markers must differ, both are {self.open!r}")
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                        or self.budget < 0):
            raise ValueError(f"Think's budget must be a non-negative int or None, got {self.budget!r}")


def markers(tokenizer) -> tuple[str, str]:
    """The thinking markers of a tokenizer: a known pair that are tokens of its vocabulary or
    that its chat template writes.

    Raises
    ------
    ValueError
        When neither names any, telling to pass ``Think(open=..., close=...)``.
    """
    vocab = tokenizer.get_vocab()
    template = tokenizer.chat_template if isinstance(getattr(tokenizer, "chat_template", None), str) else ""
    for pair in KNOWN_MARKERS:
        if all(m in vocab for m in pair) or all(m in template for m in pair):
            return pair
    raise ValueError("think=True needs the model's thinking markers, and neither its tokenizer nor its chat "
                     "template names any (such as <think> and </think>): pass "
                     "think=continuous.Think(open=..., close=...) with the markers the model should write")


def thinking(think, tokenizer) -> Think | None:
    """The :class:`Think` a ``think=`` argument asks for (``None``: no thinking section)."""
    if think is None or think is False:
        return None
    if isinstance(think, Think):
        return think
    if think is True:
        return Think(*markers(tokenizer))
    if isinstance(think, int):
        return Think(*markers(tokenizer), budget=think)
    raise TypeError(f"think must be None, True, an int (a token budget) or a continuous.Think, "
                    f"got {type(think).__name__}")


def turn_tokens(tokenizer, think: Think) -> tuple[str, ...]:
    """The texts of the tokenizer's special tokens other than the thinking markers: a section
    never runs across one (they end turns, so an opening marker before one was text)."""
    special = set(tokenizer.all_special_tokens)
    special |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    return tuple(sorted(special - {think.open, think.close, ""}))


def inside(text: str, think: Think, stops: tuple[str, ...] = ()) -> int | None:
    """Where the thinking section that ``text`` leaves open starts (just after its opening
    marker), or ``None`` when it leaves none open: its last opening marker is closed, or
    followed by one of ``stops`` (see :func:`turn_tokens`), or there is none."""
    at = text.rfind(think.open)
    if at < 0:
        return None
    start = at + len(think.open)
    if any(text.find(mark, start) >= 0 for mark in (think.close, *stops)):
        return None
    return start


def _opening(text: str, think: Think, stops: tuple[str, ...]) -> tuple[int, str]:
    """How a row's text starts a call: how many of its characters stay, and what follows them.

    A row outside a section is opened. A row inside one goes on with it; where its text
    ends with the start of the closing marker (a call cut while writing it), that start
    goes, so that the call writes the whole marker and its text holds the section's end.
    """
    start = inside(text, think, stops)
    if start is None:
        return len(text), think.open
    begun = next((k for k in range(len(think.close) - 1, 0, -1)
                  if len(text) - k >= start and text.endswith(think.close[:k])), 0)
    return len(text) - begun, ""


def opened(prompt, think: Think, stops: tuple[str, ...] = ()):
    """``prompt`` with ``think.open`` after every row not inside a thinking section already:
    a prompt that ends with the marker, or a state cut while it thought, goes on with its
    section (less a closing marker it had begun). ``stops`` are the texts a section never
    runs across (:func:`turn_tokens`). Anything but a str, a list of str or a state is left
    as it is, for the call's own checks to refuse."""
    def one(text: str) -> str:
        keep, extra = _opening(text, think, stops)
        return text[:keep] + extra

    if isinstance(prompt, str):
        return one(prompt)
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return [one(p) for p in prompt]
    from .state import SequenceState

    if isinstance(prompt, SequenceState):
        rows = prompt._rows
        cuts, extras = zip(*(_opening(text, think, stops) for text in rows.texts))
        if not any(extras) and list(cuts) == [len(t) for t in rows.texts]:
            return prompt
        return prompt._replace(rows.with_text(prompt.model.tokenizer, cuts, extras))
    return prompt


class Answer:
    """A generator's parser, given only the text after the thinking section's closing marker."""

    def __init__(self, parse: Callable[[str], Any], close: str):
        self.parse, self.close = parse, close

    def reasoning(self, text: str) -> str:
        """The thinking text of a row's generated text (all of it while the section is open)."""
        return self.parts(text)[0]

    def parts(self, text: str) -> tuple[str, str]:
        """A row's generated text as its thinking and its answer (``""`` while the section is open)."""
        reasoning, closed, answer = text.partition(self.close)
        return reasoning, answer if closed else ""

    def __call__(self, text: str) -> Any:
        at = text.find(self.close)
        if at < 0:
            raise ValueError(f"the thinking section never ended (no {self.close!r})")
        return self.parse(text[at + len(self.close):])


class Piece(str):
    """A streamed piece of a generator with a thinking section.

    It is the text, as any piece, and says what it holds: ``kind`` is ``"reasoning"``
    for thinking (the closing marker included) and ``"answer"`` for a piece that holds
    text after the closing marker. A piece in which the thinking ends holds both (the
    closing marker is often forwarded with the answer's first tokens): ``reasoning`` and
    ``answer`` are always its two parts, markers left out.
    """

    kind: str
    reasoning: str
    answer: str

    def __new__(cls, text: str, kind: str, reasoning: str, answer: str):
        piece = super().__new__(cls, text)
        piece.kind, piece.reasoning, piece.answer = kind, reasoning, answer
        return piece


class Tagger:
    """Turns each step's pieces (one per row) into :class:`Piece` s, finding each row's closing marker."""

    def __init__(self, close: str):
        self.close = close
        self.seen: list[str] = []  # per row, the text streamed so far
        self.ends: list[int | None] = []  # per row, where its closing marker ends (None: still thinking)

    def __call__(self, pieces: list[str]) -> list[Piece]:
        while len(self.seen) < len(pieces):
            self.seen.append("")
            self.ends.append(None)
        return [self._tag(r, piece) for r, piece in enumerate(pieces)]

    def _tag(self, r: int, piece: str) -> Piece:
        start = len(self.seen[r])
        self.seen[r] += piece
        if self.ends[r] is None and (at := self.seen[r].find(self.close)) >= 0:
            self.ends[r] = at + len(self.close)
        end, text = self.ends[r], self.seen[r]
        if end is None:
            return Piece(piece, "reasoning", piece, "")
        answer = text[max(start, end):]
        # The closing marker ends the thinking: a piece that holds no answer yet is reasoning.
        kind = "answer" if answer or start >= end else "reasoning"
        return Piece(piece, kind, text[start:max(start, end - len(self.close))], answer)
