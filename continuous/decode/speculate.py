"""Speculative decoding: draft a row's next tokens cheaply, check them in the step's forward.

A drafter proposes what may follow a row: :class:`PromptLookup` copies what followed the
row's last n-gram earlier in its own text (the prompt and what was generated), and
:class:`DraftModel` asks a smaller model that shares the tokenizer. The row's constraint
checks each drafted token as it is proposed (:class:`Guide`). The model forwards the
drafted tokens with the step's own tokens, and acceptance keeps the longest prefix the
model would have chosen: under greedy decoding the drafted tokens equal to its argmax;
under sampling the rejection rule of Leviathan et al. (2023) and Chen et al. (2023),
which leaves the distribution of the output unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..engines import bits

__all__ = ["PromptLookup", "DraftModel", "Draft", "Guide", "Speculation", "as_drafter", "check_speculation",
           "greedy_accepted", "sampled_accepted", "residual", "draw"]


def _check_count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class Draft:
    """What a drafter proposed for one row.

    Attributes
    ----------
    tokens
        The drafted tokens the constraint allows, to forward with the step.
    tail
        The next proposed token, which a check stopped (the constraint forbids it, it ends
        the row, or the constraint forces what follows it): it is not forwarded, but a
        sampled draft still has to be tested there to keep the distribution (``None``: none).
    q
        ``[len(tokens) + (tail is not None), vocab]`` the probabilities each drafted token
        was sampled from, or ``None`` for a deterministic drafter (a point mass).
    """

    tokens: list[int]
    tail: int | None = None
    q: torch.Tensor | None = None

    @property
    def proposed(self) -> list[int]:
        """The tokens acceptance tests: the drafted ones, then the tail."""
        return self.tokens + ([self.tail] if self.tail is not None else [])


class Guide:
    """Checks one row's drafted tokens against its constraint, advancing the row's matcher.

    A drafted token is taken while it is allowed, is not an end of row, keeps the row
    short of ``budget`` drafted tokens, and the constraint neither ends nor forces what
    follows it (the loop's own step takes such a token, with the tokens forced after it,
    exactly as without speculation). :meth:`close` takes the matcher back to before the
    draft: acceptance advances it again over the tokens it keeps, so that between the
    draft and its check the row's constraint is where the row is.

    Parameters
    ----------
    constraints
        The call's :class:`~continuous.decode.constraints.RowConstraints`.
    row
        The row's index.
    stop
        The ids that end a row.
    budget
        Most tokens to take.
    """

    def __init__(self, constraints, row: int, stop, budget: int):
        self.constraints, self.row, self.stop, self.budget = constraints, row, set(stop), budget
        self.masks: list[torch.Tensor] = []  # per taken token, the packed mask it was checked with
        self.forced: list[bool] = []  # per taken token, whether it was the only one allowed
        self.taken = 0

    def allowed(self) -> torch.Tensor | None:
        """Boolean ``[vocab]`` of the tokens allowed next, on the logits' device (``None``: all)."""
        c = self.constraints
        if c.matchers is None:
            return c.free
        return c.unpacked(c.bitmask[self.row : self.row + 1])[0]

    def take(self, token: int) -> bool:
        """Advance past ``token`` if it passes the checks; return whether it did."""
        c, r = self.constraints, self.row
        if self.taken >= self.budget or token in self.stop or not 0 <= token < c.n_tokens:
            return False
        if c.matchers is not None:
            if not bits.has(c.bitmask[r], token):
                return False
            mask = c.bitmask[r].clone()
            c.advance(r, token)
            if c.done(r) or c.forced(r):
                c.rollback(r, 1)
                return False
            self.masks.append(mask)
            self.forced.append(bits.only(mask) == token)
        else:
            self.forced.append(False)
        self.taken += 1
        return True

    def close(self) -> None:
        """Keep what is allowed after the taken tokens, and roll the matcher back over them."""
        c = self.constraints
        if c.matchers is not None:
            self.masks.append(c.bitmask[self.row].clone())
            c.rollback(self.row, self.taken)

    def allowed_at(self) -> torch.Tensor | None:
        """Boolean ``[taken + 1, vocab]``: what was allowed at each taken token, and next (once closed)."""
        c = self.constraints
        if c.matchers is None:
            return c.free
        return c.unpacked(torch.stack(self.masks))


@dataclass(frozen=True)
class PromptLookup:
    """Drafts by copying: what followed the row's last ``ngram`` tokens earlier in its text.

    As transformers' prompt lookup decoding (``prompt_lookup_num_tokens``), it needs no
    second model: the longest of the last ``ngram``..1 tokens that occurred before, at
    its most recent occurrence, proposes the (up to ``k``) tokens that followed it there.
    It pays where the output copies its input (extraction, quotes, edits).

    Parameters
    ----------
    k
        Most tokens drafted per step.
    ngram
        Longest n-gram matched.
    """

    k: int = 8
    ngram: int = 3

    def __post_init__(self):
        _check_count(self.k, "k")
        _check_count(self.ngram, "ngram")

    def propose(self, ids: Sequence[int], k: int | None = None) -> list[int]:
        """Up to ``k`` (default ``self.k``) tokens that followed the latest earlier match of
        the longest n-gram ending ``ids``; empty when none occurred before."""
        k = self.k if k is None else k
        n = len(ids)
        if n < 2 or k < 1:
            return []
        arr = np.asarray(ids, dtype=np.int64)
        for size in range(min(self.ngram, n - 1), 0, -1):
            # Windows that end before the last token: each is followed by at least one token.
            windows = np.lib.stride_tricks.sliding_window_view(arr[: n - 1], size)
            hits = np.flatnonzero((windows == arr[n - size :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + size
                return arr[start : start + k].tolist()
        return []

    def session(self) -> "PromptLookup":
        """What drafts for one call (it keeps nothing between steps)."""
        return self

    def draft(self, row: int, ids: list[int], guide: Guide, sampler, rng, vocab: int) -> Draft:
        """One row's draft: the proposal's tokens while the guide takes them."""
        tokens = []
        for t in self.propose(ids, guide.budget):
            if not guide.take(t):
                return Draft(tokens, t)
            tokens.append(t)
        return Draft(tokens)


class DraftModel:
    """Drafts with a smaller model sharing the tokenizer (transformers' assisted generation).

    Each row keeps its own cache of the draft model across steps, cropped to what the
    row kept; drafting runs under the row's constraint, greedily or by sampling with the
    call's sampler (whose probabilities acceptance then uses).

    Parameters
    ----------
    model
        A :func:`continuous.models.transformers` model with the same tokenizer.
    k
        Most tokens drafted per step.
    """

    def __init__(self, model, k: int = 5):
        if not callable(getattr(model, "forward", None)) or not hasattr(model, "tokenizer"):
            raise TypeError(f"a draft model must be a continuous.models.transformers model, got "
                            f"{type(model).__name__}")
        self.model, self.k = model, _check_count(k, "k")

    def __repr__(self) -> str:
        return f"DraftModel({self.model!r}, k={self.k})"

    def session(self) -> "_DraftRows":
        return _DraftRows(self.model)


class _DraftRows:
    """A draft model's caches for the rows of one call: per row, the ids its cache covers."""

    def __init__(self, model):
        self.model = model
        self.rows: dict[int, tuple[list[int], object]] = {}

    def _next_logits(self, row: int, ids: list[int]) -> torch.Tensor:
        """Logits after ``ids``, forwarding only what the row's cache does not share with them."""
        known, cache = self.rows.get(row, ([], None))
        same = 0
        for a, b in zip(known, ids):
            if a != b:
                break
            same += 1
        same = min(same, len(ids) - 1)  # the last token is forwarded again for its logits
        if cache is not None and same < cache.length:
            cache.release(same)  # the view is dropped: the next forward appends in place
            cache = cache.crop(same)
        logits, cache = self.model.forward(torch.tensor([ids[same:]]), None, cache, logits_to_keep=1)
        self.rows[row] = (list(ids), cache)
        return logits[0, -1]

    def draft(self, row: int, ids: list[int], guide: Guide, sampler, rng, vocab: int) -> Draft:
        """Up to ``guide.budget`` tokens, each chosen under the constraint's mask."""
        if len(ids) + guide.budget > self.model.max_length:
            return Draft([])
        logits, tokens, qs = self._next_logits(row, ids), [], []
        for j in range(guide.budget):
            scores = _widen(logits, vocab)
            allowed = guide.allowed()
            if allowed is not None:
                scores = scores.masked_fill(~allowed.to(scores.device), -torch.inf)
            if bool(torch.isneginf(scores).all()):
                break
            if sampler.random:
                q = sampler.logprobs(scores[None])[0].exp()
                t = draw(q, rng)
                qs.append(q)
            else:
                t = int(scores.argmax())
            if not guide.take(t):
                return Draft(tokens, t, torch.stack(qs) if qs else None)
            tokens.append(t)
            if j + 1 < guide.budget:
                logits = self._next_logits(row, ids + tokens)
        return Draft(tokens, None, torch.stack(qs) if qs else None)


def _widen(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The draft model's logits at the target's width (ids it lacks are never drafted)."""
    n = logits.shape[-1]
    if n >= vocab:
        return logits[:vocab].float()
    return torch.cat([logits.float(), logits.new_full((vocab - n,), -torch.inf, dtype=torch.float32)])


def as_drafter(speculate, model):
    """The drafter a call's ``speculate=`` names: a :class:`PromptLookup`, a :class:`DraftModel`,
    or a model (drafting with :class:`DraftModel`'s default ``k``).

    Raises
    ------
    TypeError
        For anything else.
    ValueError
        For a draft model whose tokenizer differs from the model's.
    """
    if speculate is None or isinstance(speculate, (PromptLookup, DraftModel)):
        drafter = speculate
    elif callable(getattr(speculate, "forward", None)) and hasattr(speculate, "tokenizer"):
        drafter = DraftModel(speculate)
    else:
        raise TypeError(f"speculate= takes continuous.PromptLookup(...) or a models.transformers model that "
                        f"shares the tokenizer, got {type(speculate).__name__}")
    if isinstance(drafter, DraftModel) and drafter.model.tokenizer is not model.tokenizer:
        mine, theirs = model.tokenizer, drafter.model.tokenizer
        if len(mine) != len(theirs) or mine.get_vocab() != theirs.get_vocab():
            raise ValueError("the draft model's tokenizer is not the model's: drafted ids would mean other "
                             "tokens; use a draft model of the same family (same vocabulary)")
    return drafter


def check_speculation(drafter, sampler, processors) -> None:
    """Refuse speculation where a row cannot keep a draft alone.

    Raises
    ------
    ValueError
        With beam search (beams re-rank every row at every step), and with logits
        processors (they would have to see each drafted token's prefix).
    """
    if drafter is None:
        return
    if sampler.joint and sampler.samples > 1:
        raise ValueError("speculate= does not work with beam search: beams re-rank every row at every step, so a "
                         "row cannot keep a draft alone; use greedy or multinomial sampling")
    if processors:
        raise ValueError("speculate= does not work with logits_processors, repetition_penalty, logit_bias or "
                         "presence or frequency penalties: they would have to run on each drafted token's prefix")


def greedy_accepted(scores: torch.Tensor, proposed: torch.Tensor) -> torch.Tensor:
    """Boolean ``[n]``: whether each proposed token is the argmax of the scores at its position.

    ``scores`` is ``[>= n, vocab]`` (masked by the constraint), ``proposed`` ``[n]``.
    """
    n = proposed.shape[0]
    return scores[:n].argmax(-1) == proposed


def sampled_accepted(p: torch.Tensor, q: torch.Tensor | None, proposed: torch.Tensor, u: torch.Tensor
                     ) -> torch.Tensor:
    """Boolean ``[n]``: the rejection rule's verdict on each proposed token.

    A token ``x`` drawn from ``q`` is accepted with probability ``min(1, p(x) / q(x))``;
    ``q=None`` is a point mass (a deterministic drafter): accepted with probability ``p(x)``.

    Parameters
    ----------
    p
        ``[>= n, vocab]`` the model's probabilities (after the constraint and the sampler's filters).
    q
        ``[n, vocab]`` the draft's probabilities, or ``None``.
    proposed
        ``[n]`` the proposed tokens.
    u
        ``[n]`` uniform draws in ``[0, 1)``.
    """
    n = proposed.shape[0]
    px = p[:n].gather(1, proposed[:, None]).squeeze(1).double()
    qx = 1.0 if q is None else q.gather(1, proposed[:, None]).squeeze(1).double()
    return u.to(px.device) * qx < px


def residual(p: torch.Tensor, q: torch.Tensor | None, rejected: int, rng: torch.Generator) -> int:
    """A token drawn from ``norm(max(0, p - q))``: what replaces a rejected proposal.

    With ``q=None`` (a point mass on ``rejected``) that is ``p`` without ``rejected``.
    Where ``p == q`` nothing is left, and any draw from ``p`` is right.
    """
    if q is None:
        left = p.clone()
        left[rejected] = 0
    else:
        left = (p - q).clamp(min=0)
    if not bool(left.sum() > 0):
        left = p
    return draw(left, rng)


def draw(weights: torch.Tensor, rng: torch.Generator | None) -> int:
    """An index drawn with probability proportional to ``weights`` (``[vocab]``, >= 0), from a CPU generator."""
    cdf = weights.detach().double().cpu().cumsum(0)
    u = torch.rand((), generator=rng, dtype=torch.float64)
    return min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), weights.shape[0] - 1)


class Speculation:
    """One call's speculation: the step object the decoding loop calls.

    :meth:`draft` runs after the step's rows took their tokens: it drafts what follows
    each row under its constraint, and the loop forwards the drafts after the step's
    tokens (in the same grid columns; a snapshot between the two keeps each row's own
    tokens only), with ``logits_to_keep`` covering them. :meth:`verify` runs after that
    forward: each row takes the drafted tokens acceptance keeps as if its own steps had
    generated them (its history and text, its matcher, its weight and the batch's step
    columns, the cost), and the slots of the rest become holes; the newest slots that no
    row kept are cropped off, cache included, so that the next step writes over them (a
    swarm session rewinds within that step: a draft costs one round trip, rejected or not,
    and leaves nothing in the session). Under sampling, a row
    whose check decided its next token (a rejected draft's replacement) has it imposed at
    the next step by :meth:`override`.

    Parameters
    ----------
    drafter
        A :class:`PromptLookup` or a :class:`DraftModel`.
    sampler
        The call's sampler.
    rng
        The call's generator: this call's draws are seeded from it.
    """

    def __init__(self, drafter, sampler, rng: torch.Generator | None):
        self.session, self.k, self.sampler = drafter.session(), drafter.k, sampler
        self.rng = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,), generator=rng)))
        self.drafts: dict[int, tuple[Draft, Guide, int]] = {}  # row -> its draft, guide, and tokens before it
        self.next: dict[int, tuple[int, float]] = {}  # row -> the token imposed next, and its log-probability

    def draft(self, dec, chunks: list[list[int]]) -> list[list[int]]:
        """Per row of ``dec`` (the :class:`~continuous.decode.loop.Decoding`), the drafted tokens
        to forward after its chunk of the step (empty where it drafts nothing)."""
        batch, out = dec.batch, []
        self.drafts.clear()
        for r, (row, chunk) in enumerate(zip(batch.states, chunks)):
            budget = min(self.k, dec.steps[r] - len(row.tokens) - 1)  # the next step's token still fits
            if row.finished or not chunk or row.forced_next is not None or budget < 1:
                out.append([])
                continue
            guide = Guide(batch.constraints, r, dec.eos, budget)
            d = self.session.draft(r, [*row.written.context, *row.tokens], guide, self.sampler, self.rng,
                                   dec.model.vocab_size)
            guide.close()
            # A sampled tail is tested even alone: skipping it would depend on what was drawn.
            if d.tokens or (d.tail is not None and self.sampler.random):
                self.drafts[r] = (d, guide, len(row.tokens))
            out.append(d.tokens)
        return out

    def verify(self, dec, logits: torch.Tensor, step: int) -> int:
        """Keep, per row, what acceptance keeps of its draft; return how many step columns the
        kept tokens took in the batch, from ``step`` on.

        ``logits`` is the forward's ``[rows, keep, vocab]``, right-aligned (each row's newest slot last).
        """
        batch, m, end = dec.batch, logits.shape[1], len(dec.grid.columns)
        kept_lps, picks, drafted = {}, {}, 0
        for r, (d, guide, at) in self.drafts.items():
            n = len(d.tokens)
            raw = logits[r, m - 1 - n :]
            kept, lps = self._keep(dec, r, d, guide, self._scores(batch.states[r], guide, at, raw), step)
            for slot in range(end - n + kept, end):
                dec.grid.reject(r, slot)
            self._cost(batch, r, guide, raw[:kept])
            drafted += n
            kept_lps[r], picks[r] = lps, m - 1 - n + kept
        dec.model.stats.record_draft(drafted, sum(map(len, kept_lps.values())))
        _crop(batch, dec.grid.drop_empty_tail())
        if picks:  # each row's logits are those after its last kept token
            rows = torch.tensor(list(picks), device=logits.device)
            batch.logits = batch.logits.clone()
            batch.logits[rows] = logits[rows, torch.tensor(list(picks.values()), device=logits.device)]
        self.drafts.clear()
        return self._gain(batch, kept_lps, step)

    def _scores(self, row, guide: Guide, at: int, logits: torch.Tensor) -> torch.Tensor:
        """The scores at each drafted position as the loop's processors would shape them there:
        the constraint's mask, then the row's bans."""
        allowed = guide.allowed_at()
        scores = logits if allowed is None else logits.masked_fill(~allowed, -torch.inf)
        bans = row.history.bans
        shifts = [(j, t, f) for j in range(scores.shape[0]) for t, f in bans.get(at + j, {}).items()]
        if shifts:
            scores = scores.clone()
            for j, t, f in shifts:
                scores[j, t] = -torch.inf if f == 0 else scores[j, t] + float(np.log(f))
        return scores

    def _keep(self, dec, r: int, d: Draft, guide: Guide, scores: torch.Tensor, step: int
              ) -> tuple[int, list[float]]:
        """Test row ``r``'s proposal and take what passes; return how many drafted tokens it
        kept and their log-probabilities. What decides the row's next token is imposed."""
        proposed = d.proposed
        logp = self.sampler.logprobs(scores)
        x = torch.tensor(proposed, device=scores.device)
        if self.sampler.random:
            u = torch.rand(len(proposed), generator=self.rng, dtype=torch.float64)
            ok = sampled_accepted(logp.exp(), d.q, x, u)
        else:
            ok = greedy_accepted(scores, x)
        ok_h, lps = torch.stack([ok.double(), logp[: len(proposed)].gather(1, x[:, None])[:, 0].double()]).tolist()
        first_no = ok_h.index(0.0) if 0.0 in ok_h else len(proposed)
        passed = min(first_no, len(d.tokens))
        kept = self._take(dec, r, d, guide, logp, lps, passed, step)
        if kept < passed:
            return kept, lps[:kept]
        if first_no < len(proposed):
            q = None if d.q is None else d.q[first_no]
            t = residual(logp[first_no].exp(), q, proposed[first_no], self.rng)
            self._impose(r, t, float(logp[first_no, t]))
        elif d.tail is not None:
            self._impose(r, d.tail, lps[-1])
        return kept, lps[:kept]

    def _take(self, dec, r: int, d: Draft, guide: Guide, logp: torch.Tensor, lps: list[float], n: int,
              step: int) -> int:
        """Row ``r`` takes its first ``n`` drafted tokens as its own steps would have; returns how
        many it took. A token that would end the row or make a match (a stop string, a ban)
        is left to the next step, which takes it as the loop does without speculation."""
        batch, stops, top = dec.batch, dec.advance.stops, dec.options.logprobs
        row, first = batch.states[r], len(dec.grid.columns) - len(d.tokens)
        watched = bool(row.history.watchers or stops.strings)
        for j, t in enumerate(d.tokens[:n]):
            saved = row.copy() if watched else None
            if row.add(t, None if guide.forced[j] else step + j, stops) or row.finished:
                batch.states[r] = saved
                self._impose(r, t, lps[j])
                return j
            batch.constraints.advance(r, t)
            row.history.slots.append(first + j)
            if top is not None:
                row.history.logprobs.append((t, *_record(logp[j], t, lps[j], guide.forced[j], top)))
        return n

    def _impose(self, r: int, token: int, logprob: float) -> None:
        # Greedy decoding chooses the same token at the next step by itself.
        if self.sampler.random:
            self.next[r] = (token, logprob)

    @staticmethod
    def _cost(batch, r: int, guide: Guide, logits: torch.Tensor) -> None:
        """Add to row ``r``'s cost what the constraint removed at its kept positions, as their steps would have."""
        if batch.constraints.constraint is None or not len(logits):
            return
        masked = logits.masked_fill(~guide.allowed_at()[: len(logits)], -torch.inf)
        removed = torch.logsumexp(logits.float(), -1) - torch.logsumexp(masked.float(), -1)
        batch.settle()
        batch.cost = batch.cost.clone()
        batch.cost[r] += removed.sum()

    @staticmethod
    def _gain(batch, kept_lps: dict[int, list[float]], step: int) -> int:
        """Each kept token's log-probability joins its row's weight one position at a time, as
        its steps would have added it, each recorded in a step column of its own (rewinds give
        it back); returns how many columns that took."""
        columns = max(map(len, kept_lps.values()), default=0)
        for j in range(columns):
            gained = torch.zeros(len(batch.states), dtype=torch.float32)
            for r, lps in kept_lps.items():
                if j < len(lps):
                    gained[r] = lps[j]
            gained = gained.to(batch.weights.device)
            batch.record(step + j, gained)
            batch.weights = batch.weights + gained
        return columns

    def imposed(self) -> dict[int, tuple[int, float]]:
        """Row -> ``(token, log-probability)`` that checks decided for this step's rows, taken
        instead of what the sampler draws (then forgotten)."""
        imposed, self.next = self.next, {}
        return imposed


def _crop(batch, width: int) -> None:
    """Crop the cache to the grid's ``width`` slots: the next forward writes where the dropped
    drafts were, in place (on a swarm, the session rewinds within that same step)."""
    if width < batch.cache.length:
        batch.cache.release(width)
        batch.cache = batch.cache.crop(width)


def _record(logp: torch.Tensor, token: int, lp: float, forced: bool, top: int) -> tuple:
    """A kept token's ``(logprob, [(id, logprob), ...])`` as the loop records a sampled one."""
    if forced:
        return (0.0, [(token, 0.0)][:top])
    values, ids = logp.topk(min(top, logp.shape[-1]))
    return (lp, [(t, v) for t, v in zip(ids.tolist(), values.tolist()) if v > -np.inf])
