"""The decoding loop: prepare the rows, then per step shape the scores, sample, read, advance, forward.

It works on :class:`~continuous.layout.Rows` and knows nothing of SequenceState. A call
is a coroutine (:meth:`Decoding.run`) that yields each forward it needs instead of
running it, so that the model's engine steps every running call together. One call
generates for every row at once: rows that finish early become holes in the
following columns, and their logits are kept so that a later call continues them
without recomputing anything.

Logits, constraint masks, weights, sampling and the attention mask stay on the model's
device; the only thing that reaches the host at each step is what the Python loop needs
to know: the chosen ids (and, for beams, which rows they extend).
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Callable, Iterator

import torch

from ..errors import ContextWarning
from ..heal import heal_rows
from ..kv import KVCache
from ..layout import Rows
from ..samplers import RowDraws
from ..transfer import to_device
from .advance import Advance
from .batch import Batch
from .constraints import RowConstraints
from .finish import Finish
from .grid import Grid
from .joined import LEFT
from .options import Options
from .draw import NOTHING_IMPOSED, Draw
from .overlap import Queued
from .prefill import check_context, top_up_steps
from ..models.scheduler import Request, Work, answered
from ..models.table import READY
from .processors import ForkRanking, own, run
from .result import Generation, logprob_texts, rows_after, token_texts
from .rows import RowState
from .speculate import Speculation

__all__ = ["Generation", "Decoding", "READY", "drive"]



def _prepare(model, rows: Rows, weights: torch.Tensor, options: Options):
    """Heal, top up and fork a call's rows; with the text healing removed from each (a coroutine:
    it yields the prefill's forward)."""
    check_context(model, rows, 1)
    removed = [""] * rows.n_rows
    if options.heal and options.max_tokens != 0:  # with no token to generate, nothing could re-spell
        rows, removed = heal_rows(model.tokenizer, rows)
    rows = yield from top_up_steps(model, rows)
    if options.fork > 1:
        rows = rows.select([r for r in range(rows.n_rows) for _ in range(options.fork)])
        weights = weights.repeat_interleave(options.fork)
        removed = [h for h in removed for _ in range(options.fork)]
    return rows, weights, removed


class Decoding:
    """One call over rows, as a coroutine (:meth:`run`) that yields its forwards to whoever
    runs it (the model's engine) and its events: :data:`READY` once its rows are prepared,
    then each step's text pieces (per row, the text that may be streamed now, ``None`` once
    finished). Read :meth:`result` between two events or at the end.

    Iterating it runs it alone, forwarding directly, and gives the pieces.
    """

    def __init__(self, model, rows: Rows, weights: torch.Tensor, constraint, options: Options):
        check_context(model, rows, 1)  # refused now, before the call is queued
        self._inputs = (rows, weights, constraint)
        self._start(model, options)

    def _start(self, model, options: Options) -> None:
        """The state of a call not yet stepped."""
        self.model, self.options, self.sampler = model, options, options.sampler
        self.tokenizer, self.eos = model.tokenizer, set(model.eos_token_ids)
        self.batch: Batch | None = None
        self.unforwarded: list[list[int]] | None = None
        #: Called when the call resumes after a piece, before its next step (on the thread that
        #: steps it): where a stream keeps the state its consumer has seen.
        self.resumed: Callable[[], None] | None = None
        #: Set once the consumer takes the whole answer, not pieces: only the first piece is
        #: yielded (its time is the time to first token), and the last.
        self.whole = False
        self.over = False  # every row finished and flushed: results read the rows as they are
        #: The table that steps this call's rows with others' (:mod:`.joined`), while they are seated there.
        self.table = None
        #: What :meth:`seen` reads once its rows left that table: its rows of it, taken.
        self.taken: tuple | None = None
        #: Called after each step's advance, before the pieces are handed (the rows' departures, in a table).
        self.on_step: Callable[[], None] | None = None

    @classmethod
    def joined(cls, parts: list["Decoding"]) -> "Decoding":
        """One decoding of the rows of ``parts`` (decodings at their first step, with equal
        :attr:`seat_key`), one after the other: their batches side by side, one grid, one advance."""
        first = parts[0]
        self = cls.__new__(cls)
        self._inputs = None
        self._start(first.model, first.options)
        self.batch = Batch.joined([p.batch for p in parts], first.batch.logits.device)
        self.whole = True
        self.pad, self.steps = first.pad, [s for p in parts for s in p.steps]
        self._ready([limit for p in parts for limit in p.limits])
        self.seat_key = None  # a table is never seated in another
        return self

    @property
    def prepared(self) -> bool:
        """Whether its rows are prepared (and :meth:`result` may be read)."""
        return self.batch is not None or self.table is not None or self.taken is not None

    def run(self):
        """The call: prepare the rows (heal, prefill, fork), yield :data:`READY`, then step.

        Yields a :class:`~continuous.models.scheduler.Request` for each forward (send back
        ``(logits, cache)``, or throw its error) and each event (send ``None``).
        """
        rows, weights, constraint = self._inputs
        prepared = yield from _prepare(self.model, rows, weights, self.options)
        self._build(self.model, *prepared, constraint, self.options)
        del prepared  # the prepared rows live on in the batch only (a table takes them over, and lets go)
        yield READY
        yield from self.decode()

    def prepare(self) -> "Decoding":
        """Prepare the rows now, alone (forwarding directly); returns the decoding."""
        steps = self.run()
        for event in drive(steps, self.model):
            if event is READY:
                break
        return self

    def __iter__(self) -> Iterator[list[str | None]]:
        return (event for event in drive(self.run(), self.model) if event is not READY)

    def _build(self, model, rows: Rows, weights: torch.Tensor, removed: list[str], constraint,
               options: Options) -> None:
        n, device = rows.n_rows, rows.logits.device
        # A column per step, room for max_tokens of them up front (rewinds may need more: it doubles).
        steps = max(16, min(options.max_tokens or 0, 1024))
        constraints = RowConstraints.of_call(constraint, model, rows, removed, device)
        states = [RowState.of(self.tokenizer, rows.real_ids(r), rows.texts[r], rows.ends[r],
                              self._watches(constraints, rows.texts[r] + removed[r]), removed[r]) for r in range(n)]
        self.batch = Batch(logits=rows.logits, start=rows.logits,
                           weights=weights.to(device=device, dtype=torch.float32),
                           gained=torch.zeros(n, steps, device=device), cost=torch.zeros(n, device=device),
                           cache=rows.cache, grid=Grid(rows, device), constraints=constraints,
                           draws=RowDraws(n, options.rng) if self.sampler.random else None, states=states,
                           logits_ok=[True] * n)
        self.pad = rows.pad
        # Each row's room is its own: the cache grows past the longest row's context.
        rooms = (model.max_length - rows.attention_mask.sum(1)).tolist()
        limit = options.max_tokens
        self.steps = [room if limit is None else min(limit, room) for room in rooms]
        limits = [Finish.LENGTH if limit is not None and limit <= room else Finish.CONTEXT for room in rooms]
        for r, row in enumerate(states):
            if constraints.done(r) or self.steps[r] <= 0:
                row.finish(Finish.EOS if constraints.done(r) else limits[r])
        self._ready(limits)

    def _ready(self, limits: list[Finish]) -> None:
        """What the steps use, made from the batch and the options (its rows' ``limits``: why each
        ends once it generated ``steps[r]`` tokens)."""
        options, batch = self.options, self.batch
        self.limits = limits
        self.advance = Advance(self.batch, options, self.tokenizer, self.eos, self.steps, limits)
        self.warned = False
        self.token_texts = token_texts(self.tokenizer)
        self.own = own(options, self.pad)
        self.after = [ForkRanking(options.fork)] if self.sampler.joint and options.fork > 1 else []
        self.family = Draw.family_of(self.sampler, self.after, batch.logits)
        # The draw moves the matchers past the sampled tokens and writes their masks with every call's
        # at once; beams reorder their rows first, so theirs move one by one as the rows take them.
        moves = batch.constraints.matchers is not None and not self.sampler.joint
        self.consume = self.advance.consume if moves else None
        eos = self.tokenizer.eos_token_id
        self.sentinel = eos if eos is not None else min(self.eos, default=0)  # what finished rows "emit"
        # The queued step's input is the sampled token whatever the constraint: its mask for
        # the next step is filled on the host while the device runs the step. Beams reorder
        # rows at every step, so they would give back nearly every queued step.
        self.overlap = self.model.overlap and not self.sampler.joint and options.speculate is None
        self.speculation = None if options.speculate is None else Speculation(options.speculate, self.sampler,
                                                                               options.rng)
        self.seat_key = self._seat_key()

    def _seat_key(self):
        """What calls stepped as one (:mod:`.joined`) share: all that their steps read of the call but
        its rows. ``None``: this call steps alone (its own processors, a draft model, beams, or a
        backend whose caches do not stack)."""
        options, constraints = self.options, self.batch.constraints
        if self.own or self.family is None or self.speculation is not None:
            return None
        if not isinstance(self.batch.cache, KVCache):
            return None
        key = (self.family, id(constraints.constraint), constraints.matchers is None, self.sampler, options.stop_at,
               options.fast_forward, options.logprobs, id(options.bans))
        try:
            hash(key)
        except TypeError:  # a sampler of the user's that cannot be told equal to another
            return None
        return key

    def _watches(self, constraints: RowConstraints, before: str) -> list:
        """What watches a row's text for matches to rewind on: the bans, and what the constraint
        could not enforce in its grammar."""
        bans = [self.options.bans.matcher(before)] if self.options.bans is not None else []
        return bans + [w for w in [constraints.watch()] if w is not None]

    def decode(self) -> Iterator[list[str | None]]:
        """Step the prepared rows until every row finished (a coroutine, as :meth:`run`)."""
        batch = self.batch
        identity = list(range(len(batch.states)))
        step = 0
        finished = all(row.finished for row in batch.states)
        drawn = None  # a step's draw, when the forward before it came with it (see _forward)
        while not finished:
            if drawn is None:
                drawn = yield from self._drawn(step)
            if drawn is LEFT:  # its rows were stepped in a table (see .joined), which took them at their end
                return
            if drawn.error is not None:
                if drawn.queued is not None:
                    drawn.queued.give_back(count=False)
                raise drawn.error
            ids, ancestors, weights, queued = drawn.ids, drawn.ancestors, drawn.weights, drawn.queued
            ids_h, ancestors_h, dead = drawn.ids_h, drawn.ancestors_h, drawn.dead
            reordered = ancestors_h is not None and ancestors_h != identity
            if reordered:
                batch.select(ancestors_h, ancestors)
            batch.record(step, drawn.step_gained, drawn.step_cost, drawn.span)
            batch.weights = weights
            chunks, rewound = self.advance(ids_h, dead, step, self._read_logprobs(drawn))
            drawn = None  # taken: the next step's is drawn anew, or comes with the forward's answer
            step += 1
            drafts = self.speculation.draft(self, chunks) if self.speculation is not None else None
            sent, plain, new_ids = self._append(chunks, drafts, ids_h)
            self.unforwarded = chunks  # until the forward below: a snapshot's rows recompute them
            dropped = self._drop(self.on_step(), sent) if self.on_step is not None else 0
            if not self.whole or step == 1:  # a consumer of the whole answer hears of the first piece only
                yield from self._hand(queued)
            if rewound:
                self.model.stats.record_rewound(rewound)
            finished = all(row.finished for row in batch.states)
            if queued is not None:
                if plain and self.grid.all_real and not reordered and not finished:
                    batch.logits, batch.cache = queued.take()
                    self.unforwarded = None
                    continue
                queued.give_back()
            if finished:
                break
            if any(chunks):  # else every row went back to the start of the call: its logits are kept
                keep = 1 + max(map(len, drafts)) if drafts else 1  # the drafts are checked on their logits
                logits, drawn = yield from self._forward(ids if plain else new_ids, sum(map(len, sent)) - dropped,
                                                         plain, keep, step)
                if self.speculation is not None:
                    step += self.speculation.verify(self, logits, step)
                    finished = all(row.finished for row in batch.states)
            self.unforwarded = None
        for row in batch.states:  # a character left incomplete ends the text as replacement characters
            row.flush()
        self.over = True
        last = [row.release() for row in batch.states]
        if any(last):
            yield last

    def _drop(self, rows: list[int], sent: list[list[int]]) -> int:
        """Rows whose calls left a table at this step (see :mod:`.joined`): the slots they just took
        become holes, which the next forward does not compute for anyone; returns how many."""
        end, dropped = len(self.grid.columns), 0
        for r in rows:
            for slot in range(end - len(sent[r]), end):
                self.grid.reject(r, slot)
            dropped += len(sent[r])
        return dropped

    def _drawn(self, step: int):
        """The draw of step ``step``, yielded (what the engine sends back: its outcome, or :data:`LEFT`)."""
        try:
            return (yield self._draw(step))
        except GeneratorExit:
            if self.table is not None:  # closed in a table: its rows so far are its result
                self.table.hand_over(self)
            raise

    def _draw(self, step: int) -> Draw:
        """The ask for the rows' next tokens (see :class:`~.draw.Draw`), after the call's own processors."""
        batch = self.batch
        views = [row.view() for row in batch.states]
        logits = batch.logits if not self.own else run(self.own, batch.logits, batch.weights, step, views).logits
        # The queued step's forward is made on the device's ids before the host reads them.
        overlap = (self.overlap and self.grid.all_real and step + 1 < max(self.steps)
                   and not any(row.finished for row in batch.states) and _alone(self.model))
        return Draw(logits=logits, weights=batch.weights, constraints=batch.constraints, views=views,
                    sampler=self.sampler, rng=self._rng(), sentinel=self.sentinel, after=self.after,
                    imposed=self.speculation.imposed() if self.speculation else NOTHING_IMPOSED,
                    step=step, queue=(lambda ids: Queued(self.model, ids, batch.cache)) if overlap else None,
                    logprobs=self.options.logprobs is not None, family=self.family, consume=self.consume,
                    seat=self if step == 0 and self.whole and self.seat_key is not None else None)

    def _hand(self, queued):
        """Hand the step's pieces to the consumer, who holds them: the call is parked until it asks
        again. A call closed there gives back its queued step."""
        try:
            yield [row.release() for row in self.batch.states]
            if self.resumed is not None:
                self.resumed()
        except GeneratorExit:
            if queued is not None:
                queued.give_back(count=False)
            raise

    def _append(self, chunks: list[list[int]], drafts: list[list[int]] | None, ids: list[int]
                ) -> tuple[list[list[int]], bool, list[list[int]]]:
        """Put each row's tokens and its draft (``None``: none drafted) in the grid; return what is
        forwarded, whether the step is plain (one sampled token per row, as sampled: the forward
        takes the ids where they already are, with no host-to-device copy that would wait for the
        device), and the new ids."""
        states = self.batch.states
        rewound = any(row.history.rewinds for row in states)
        if not (drafts and any(drafts)) and all(len(c) == 1 for c in chunks):  # most steps: one token a row
            tokens = [c[0] for c in chunks]
            slot = self.grid.append_one(tokens, rewound)
            for row in states:
                row.history.slots.append(slot)
            return chunks, tokens == ids, chunks
        sent = [c + d for c, d in zip(chunks, drafts)] if drafts and any(drafts) else chunks
        plain = all(len(c) == 1 and c[0] == t for c, t in zip(sent, ids))
        slots, new_ids = self.grid.append(sent, plain, rewound)
        for row, taken, chunk in zip(states, slots, chunks):
            row.history.slots.extend(taken[: len(chunk)])  # drafted slots join once kept
        return sent, plain, new_ids

    @property
    def grid(self) -> Grid:
        return self.batch.grid

    def _rng(self):
        """What the sampler draws from: each row's own stream, drawn only where the row has a choice."""
        draws = self.batch.draws
        if draws is None:
            return self.options.rng
        draws.choosing = [not row.finished and row.forced_next is None and single is None
                          for row, single in zip(self.batch.states, self.batch.constraints.single)]
        return draws

    def _forward(self, ids, n_real: int, plain: bool, keep: int, step: int):
        """Forward the step's new slots; each row's logits are those after its newest slot.

        Returns the logits of the last ``keep`` slots (``[rows, keep, vocab]``) and ``None``
        when drafts are checked on them; else ``None`` and the draw of step ``step``, which the
        answer came with (the forward's runner took the answer with :meth:`_answered` and ran
        the draw)."""
        batch, grid = self.batch, self.grid
        inputs = ids if plain else to_device(ids, batch.logits.device, torch.long)
        checks = self.speculation is not None  # the drafts' check reads every kept slot's logits
        reply = yield Request(inputs, None if grid.all_real else grid.attention_mask, batch.cache,
                              logits_to_keep=keep, n_real=n_real, holes=grid.holes, last=not checks,
                              then=None if checks else partial(self._answered, plain, step))
        if not checks:
            return None, reply
        logits, batch.cache = reply
        self._took(logits[:, -1], plain)
        return logits, None

    def _answered(self, plain: bool, step: int, logits: torch.Tensor, cache) -> Draw:
        """Take a forward's answer (the newest slot's logits, and the cache); return the draw of
        step ``step``."""
        self.batch.cache = cache
        self._took(logits, plain)
        self.unforwarded = None
        return self._draw(step)

    def _took(self, newest: torch.Tensor, plain: bool) -> None:
        """The logits after each row's newest slot: ``newest``, where the row forwarded a slot."""
        batch = self.batch
        batch.logits = newest if plain else torch.where(self.grid.last_real[:, -1:], newest, batch.logits)

    def _read_logprobs(self, drawn) -> list | None:
        """Per row, the sampled token's log-probability (what its weight gained) and the
        ``options.logprobs`` likeliest tokens with theirs, under the sampler's distribution."""
        k = self.options.logprobs
        if k is None:
            return None
        gained = drawn.gained_h
        if k == 0:  # no alternatives: the distribution is not needed
            return [(g, []) for g in gained]
        logits, ancestors = drawn.logits, drawn.ancestors
        logprobs = self.sampler.logprobs(logits)
        top = (logprobs if ancestors is None else logprobs[ancestors]).topk(min(k, logits.shape[-1]), dim=-1)
        alternatives = [[(t, v) for t, v in zip(ids, values) if v > -float("inf")]
                        for ids, values in zip(top.indices.tolist(), top.values.tolist())]
        return list(zip(gained, alternatives))

    def result(self) -> Generation:
        """What the call produced: once iterated, its result; between two steps, or after the
        iteration stopped early, what it produced so far (the next call forwards the newest
        tokens, which this call did not)."""
        return self.seen()()

    def seen(self) -> Callable[[], Generation]:
        """:meth:`result` as of now, made when called: what it reads is taken now (the rows copied,
        the grid frozen), so the call may go on meanwhile, on another thread."""
        if self.table is not None or self.taken is not None:  # its rows are (or were) stepped in a table
            taken = self.table.take(self) if self.table is not None else self.taken
            return lambda: self._generation(*taken)
        batch = self.batch
        states = batch.states
        if not self.over:
            states = [row.copy() for row in states]  # flushing here must leave the running rows as they are
            for row in states:
                row.flush()
        ok = batch.logits_ok if self.unforwarded is None else [
            ok and not c for ok, c in zip(batch.logits_ok, self.unforwarded)]
        taken = (states, self.grid.frozen(), batch.cache, batch.logits, ok, batch.constraints.complete(),
                 batch.weights, batch.cost_so_far())
        return lambda: self._generation(*taken)

    def _generation(self, states, grid, cache, logits, ok, accepts, weights, cost) -> Generation:
        out = rows_after(self.tokenizer, states, grid, cache, logits, ok, self.pad)
        # A stop string that ends a whole match of the constraint leaves the match whole.
        whole = [a and (row.written.stop is None or row.written.stop[1] == len(row.written.text))
                 for a, row in zip(accepts or [False] * len(states), states)]
        reasons = [row.reason for row in states]
        if Finish.CONTEXT in reasons and not self.warned:
            self.warned = True
            warnings.warn(f"the model's context ({self.model.max_length} tokens) cut rows "
                          f"{[r for r, why in enumerate(reasons) if why == Finish.CONTEXT]} short", ContextWarning,
                          stacklevel=4)
        logprobs = None if self.options.logprobs is None else [
            logprob_texts(self.tokenizer, self.token_texts, row.history.logprobs) for row in states]
        return Generation(out, weights.cpu(), [row.value_text(w) for row, w in zip(states, whole)],
                          complete=whole if accepts is not None else None, reasons=reasons, logprobs=logprobs,
                          costs=cost().tolist())


def _alone(model) -> bool:
    """Whether this call is the only one its model's engine holds: a queued step (see
    :class:`~.overlap.Queued`) forwards alone, so it pays only then."""
    engine = getattr(model, "engine", None)
    return engine is None or engine.running() <= 1


def drive(steps, model):
    """Run a call's coroutine alone: forward each request directly, run its host work alone;
    yield its events."""
    reply, error = None, None
    while True:
        try:
            item = steps.throw(error) if error is not None else steps.send(reply)
        except StopIteration:
            return
        reply, error = None, None
        if isinstance(item, Request):
            try:
                reply = answered(item, *model.forward(item.input_ids, item.attention_mask, item.cache,
                                                      item.logits_to_keep, n_real=item.n_real, holes=item.holes))
                if item.then is not None:
                    work = item.then(*reply)
                    reply = type(work).run_all([work])[0]
            except Exception as exc:  # noqa: BLE001 - raised where the call forwarded
                error = exc
        elif isinstance(item, Work):
            try:
                reply = type(item).run_all([item])[0]
            except Exception as exc:  # noqa: BLE001 - raised where the call asked for it
                error = exc
        else:
            try:
                yield item
            except GeneratorExit:
                steps.close()
                raise
