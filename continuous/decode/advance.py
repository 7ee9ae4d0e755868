"""One step of every row: take the sampled token and those the constraint forces, end, or rewind."""

from __future__ import annotations

from .batch import Batch
from .finish import Finish
from .options import Options
from .rows import MAX_REWINDS, RowState, StopStrings, warn_exhausted

__all__ = ["Advance"]


class Advance:
    """How a call's rows take each step's tokens.

    Parameters
    ----------
    batch
        The call's rows (reordered in place by beams: this reads it at each step).
    options
        The call's options.
    tokenizer
        The model's tokenizer (a rewind decodes a row's text again).
    ends
        The ids that end a row.
    steps, limits
        Per row, the most tokens it may generate, and the reason it ends when it has.
    """

    def __init__(self, batch: Batch, options: Options, tokenizer, ends: set[int], steps: list[int],
                 limits: list[Finish]):
        self.batch, self.options, self.tokenizer, self.eos = batch, options, tokenizer, ends
        self.steps, self.limits = steps, limits
        self.stops = StopStrings(options.stop_at)
        self.joint = options.sampler.joint
        self._consumed: dict[int, int | None] = {}  # row -> its lone allowed token before :meth:`consume` moved it

    def consume(self, ids: list[int], dead: list[int]) -> list[int]:
        """Move the matchers of the rows that take their sampled token past it, leaving their
        masks to be written together (:meth:`~.constraints.RowConstraints.refresh_all`, by the
        draw); returns those rows. The step's :meth:`__call__` then takes them on from there."""
        constraints, states = self.batch.constraints, self.batch.states
        if constraints.matchers is None:
            return []
        taken = [r for r, t in enumerate(ids) if not states[r].finished and not dead[r] and t not in self.eos]
        self._consumed = {r: constraints.single[r] for r in taken}  # what the sampled token was chosen among
        for r in taken:
            constraints.consume(r, ids[r])
        return taken

    def __call__(self, ids: list[int], dead: list[int], step: int, logprobs: list | None
                 ) -> tuple[list[list[int]], int]:
        """Each row takes its sampled token, then any the constraint forces (fast-forward), and
        rewinds on a banned match; returns each row's tokens to forward and the forwarded tokens
        rewinds took back. ``logprobs`` holds, per row, the sampled token's log-probability
        and the top alternatives, when the call records them. Rows :meth:`consume` moved this
        step go on from there."""
        chunks, rewound = [], 0
        for r, t in enumerate(ids):
            row, chunk, matches = self.batch.states[r], [], []
            if row.finished or dead[r]:
                if not row.finished:
                    self._no_token(r, row)
                chunks.append(chunk)
                continue
            if t in self.eos:
                row.end(t, step)
                if logprobs is not None:
                    row.history.logprobs.append((t, *logprobs[r]))
            else:
                chunk, matches = self._take(r, t, step, logprobs[r] if logprobs is not None else None)
            if row.finished and not matches:
                matches = row.ending()  # a phrase at the very end waited for what follows
            if matches:
                chunk, undone = self._rewind(r, matches, chunk)
                rewound += undone
            chunks.append(chunk)
        self._consumed = {}  # this step's: nothing else may read them
        return chunks, rewound

    def _no_token(self, r: int, row: RowState) -> None:
        """Row ``r`` is left with no allowed token: every one starts a banned match, the logits
        processors forbade them all, or (beam search) the prompt has fewer ways on than beams."""
        if row.history.bans.get(len(row.tokens)):
            warn_exhausted(r, row)
        elif not self.joint:
            warn_exhausted(r, row, "the logits processors leave no token the constraint allows")
        else:  # an extra beam gets a -inf weight: it ends here, with no value
            row.dead = True
            row.finish(Finish.EOS)

    def _take(self, r: int, t: int, step: int, logprob: tuple | None) -> tuple[list[int], list]:
        """Row ``r`` takes token ``t``, then any the constraint forces (fast-forward); returns
        them and the banned matches they make."""
        row, chunk, constraints = self.batch.states[r], [t], self.batch.constraints
        consumed = r in self._consumed
        # A token the constraint forced (the only one allowed) was not chosen: it carries no weight.
        single = self._consumed[r] if consumed else constraints.single[r]
        sampled = None if t in (row.forced_next, single) else step
        row.forced_next = None
        while True:
            if not consumed:
                constraints.advance(r, chunk[-1])
            consumed = False
            matches = row.add(chunk[-1], sampled, self.stops)
            if logprob is not None:
                # A forced token was the only one allowed: probability 1, whatever the steps.
                forced = (0.0, [(chunk[-1], 0.0)][: self.options.logprobs])
                row.history.logprobs.append((chunk[-1], *(logprob if sampled is not None else forced)))
            sampled = None
            if constraints.done(r):
                row.finish(Finish.EOS)
            elif len(row.tokens) >= self.steps[r]:
                row.finish(self.limits[r])
            if matches or row.finished:
                return chunk, matches
            forced = constraints.forced(r)
            if forced and not self.options.fast_forward:
                row.forced_next = forced[0]  # the next step takes it
            if not forced or not self.options.fast_forward:
                return chunk, matches
            chunk.append(forced[0])

    def _rewind(self, r: int, matches: list, chunk: list[int]) -> tuple[list[int], int]:
        """Take row ``r`` back to where the first banned match that does not stand starts; return
        what is left of its chunk and how many forwarded tokens went.

        The row's weight loses the removed tokens' log-probabilities, its constraint rolls
        back, and the slots of removed tokens already in the grid become holes.
        """
        batch, row = self.batch, self.batch.states[r]
        forwarded = len(row.history.slots)
        # A soft ban sampled again where it was down-weighted stands: the next match counts.
        undone = next(filter(None, (row.rewind(match, self.tokenizer) for match in matches)), None)
        if undone is None:
            return chunk, 0
        batch.give_back(r, undone.steps)
        batch.constraints.rollback(r, undone.removed)
        for slot in undone.slots:
            batch.grid.hole_at(r, slot)
        chunk = chunk[: max(0, len(chunk) - undone.removed)]
        if row.history.rewinds > MAX_REWINDS:
            warn_exhausted(r, row)
        rewound = forwarded - len(row.history.slots)
        if not undone.removed:  # only the end was taken back: the row's logits are still after its last token
            return chunk, rewound
        if not chunk and row.tokens:  # the last kept token comes back to give its logits
            chunk = [row.tokens[-1]]
            batch.grid.hole_at(r, row.history.slots.pop())
            rewound += 1
        elif not chunk:  # back to the start of the call: its logits were kept
            batch.logits = batch.logits.clone()
            batch.logits[r] = batch.start[r]
        return chunk, rewound
