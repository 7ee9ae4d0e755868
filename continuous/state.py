"""SequenceState: a value that feels like a string and carries the model's KV cache."""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from .errors import BatchMismatch, CacheResetWarning, SampleMismatch, SlicingError
from .layout import Rows

__all__ = ["SequenceState", "CacheBytes", "CutShort", "shape_rows"]


class CacheBytes(NamedTuple):
    """KV cache bytes of a state: freed with it (``alone``) and kept with other states (``shared``)."""

    alone: int
    shared: int


#: Per cache buffer (or swarm session), the live states on it.
_HOLDERS: "weakref.WeakKeyDictionary[object, weakref.WeakSet]" = weakref.WeakKeyDictionary()


def shape_rows(items: Sequence[Any], batch_size: int, num_samples: int) -> Any:
    """Shape per-row items as outlines v0 shaped results.

    One row: the item; one prompt: a list over samples; one sample: a list over prompts;
    otherwise a list (batch) of lists (samples).
    """
    items = list(items)
    if batch_size == 1 and num_samples == 1:
        return items[0]
    if batch_size == 1 or num_samples == 1:
        return items
    return [items[b * num_samples:(b + 1) * num_samples] for b in range(batch_size)]


class CutShort(str):
    """A row's generated text that its constraint did not accept whole (``value`` raises for it)."""


#: What ``value``'s error says cut a row short, by its finish reason.
_CUT_BY = {
    "length": "max_tokens",
    "stop": "a stop string",
    "context": "the end of the model's context",
    "ban_exhausted": "bans: every way on was banned (a banned phrase, or a value its schema forbids; see the "
                     "BanExhausted warning)",
    None: "max_tokens, a stop string or the end of the context",
}


class SequenceState:
    """The text of ``batch_size * num_samples`` rows, their weights and their KV cache.

    Rows are batch-major (row ``b * num_samples + s``). A state is a value: no
    operation changes it; slicing, adding and continuing return new states that share
    whatever cache is still valid. Build states by calling a
    :class:`~continuous.wrapper.ContinuousGenerator`.

    As a container of rows, ``iter`` yields each row's text and ``len`` counts the rows;
    as a string, ``text in state`` looks for ``text`` in the rows' texts and
    ``bool(state)`` is False only when every text is empty. Attributes are read-only,
    the tensors it exposes are copies, ``copy``/``deepcopy`` give the state itself (it is
    a value), and pickling raises ``TypeError`` (it holds the model and its cache).

    Attributes
    ----------
    token_ids, attention_mask
        ``[rows, length]`` LongTensors; the mask is 0 on padding and holes.
    weights
        ``[batch_size, num_samples]`` cumulative log-probability of the generated tokens.
    kv_cache
        The backend's cache object, ``None`` once reset.
    batch_size, num_samples, model
    tokens_cached
        Prompt tokens of the call that made this state which the model's prefix cache
        supplied (over every row; 0 without a prefix cache).
    """

    __slots__ = ("_rows", "_weights", "batch_size", "num_samples", "model", "_values", "_parse", "_reasons",
                 "_logprobs", "_costs", "_scores", "tokens_cached", "__weakref__")

    def __init__(self, model, rows: Rows, weights: torch.Tensor, batch_size: int, num_samples: int, *,
                 values: Sequence[str] | None = None, parse: Callable[[str], Any] | None = None,
                 reasons: Sequence[str | None] | None = None, logprobs: Sequence[list] | None = None,
                 costs: Sequence[float] | None = None, choice_scores: Sequence[dict] | None = None,
                 tokens_cached: int = 0):
        if rows.n_rows != batch_size * num_samples:
            raise ValueError(f"{rows.n_rows} rows is not {batch_size} prompts x {num_samples} samples")
        init = object.__setattr__  # attributes are read-only once built (__setattr__ below)
        init(self, "_rows", rows)
        init(self, "_weights", weights.reshape(batch_size, num_samples))
        init(self, "batch_size", batch_size)
        init(self, "num_samples", num_samples)
        init(self, "model", model)
        init(self, "_values", tuple(values) if values is not None else None)
        init(self, "_parse", parse)
        init(self, "_reasons", tuple(reasons) if reasons is not None else None)
        init(self, "_logprobs", tuple(logprobs) if logprobs is not None else None)
        init(self, "_costs", tuple(costs) if costs is not None else None)
        init(self, "_scores", tuple(choice_scores) if choice_scores is not None else None)
        init(self, "tokens_cached", tokens_cached)
        if rows.cache is not None:
            _HOLDERS.setdefault(rows.cache.storage()[0], weakref.WeakSet()).add(self)

    def __setattr__(self, name, value):
        raise AttributeError(f"a SequenceState is a value: its attribute {name!r} cannot be set "
                             "(build a new state by slicing, adding or generating)")

    def __delattr__(self, name):
        raise AttributeError(f"a SequenceState is a value: its attribute {name!r} cannot be deleted")

    # A state is a value, so a copy may be the state itself (as for str and tuple); it
    # keeps its model and cache, and every tensor it exposes is a fresh copy.
    def __copy__(self) -> "SequenceState":
        return self

    def __deepcopy__(self, memo) -> "SequenceState":
        return self

    def __reduce_ex__(self, protocol):
        raise TypeError("a SequenceState cannot be pickled: it holds the model and its KV cache. "
                        "Pickle its text (list(state)), token_ids or value instead, and rebuild a state "
                        "by calling a generator on the text")

    # ------------------------------------------------------------------ reading
    # Tensors are shared between states (a slice or a sum reuses its operand's), so
    # each property gives a copy: changing it in place cannot change any state.
    @property
    def weights(self) -> torch.Tensor:
        """``[batch_size, num_samples]`` cumulative log-probability of the generated tokens (a copy)."""
        return self._weights.clone()

    @property
    def token_ids(self) -> torch.Tensor:
        """``[rows, length]`` token ids, padded (a copy)."""
        return self._rows.token_ids.clone()

    @property
    def attention_mask(self) -> torch.Tensor:
        """``[rows, length]``, 0 on padding and holes (a copy)."""
        return self._rows.attention_mask.clone()

    @property
    def kv_cache(self):
        return self._rows.cache

    @property
    def cached_lengths(self) -> torch.Tensor:
        """Per row, how many leading tokens the cache covers (0 when reset)."""
        return self._rows.cached_lengths()

    @property
    def value(self) -> Any:
        """The typed result of the most recent generation call (``None`` before any).

        A beam search row that was left with no allowed token (more beams than valid
        continuations) has weight ``-inf`` and value ``None``.

        Raises
        ------
        ValueError
            When a row's generated text does not parse (e.g. ``max_tokens`` cut a JSON
            document short); the state itself stays usable.
        """
        if self._values is None:
            return None
        parsed = []
        for r, text in enumerate(self._values):
            if text is None:  # a beam search row left with no allowed token (weight -inf)
                parsed.append(None)
                continue
            if isinstance(text, CutShort):
                reason = self._reasons[r] if self._reasons is not None else None
                raise ValueError(f"row {r}'s generated text {str(text)!r} is not a whole match of its "
                                 f"constraint: it was cut short by {_CUT_BY.get(reason, _CUT_BY[None])}")
            try:
                parsed.append(self._parse(text) if self._parse is not None else text)
            except Exception as exc:
                raise ValueError(f"row {r}'s generated text {text!r} does not parse: {exc}") from exc
        return shape_rows(parsed, self.batch_size, self.num_samples)

    @property
    def reasoning(self) -> list[str | None] | None:
        """Per row, the thinking text of the most recent call, for a generator given ``think=``
        (else ``None``); ``value`` reads only the text after it."""
        split = getattr(self._parse, "reasoning", None)
        if self._values is None or split is None:
            return None
        return [split(text) if text is not None else None for text in self._values]

    @property
    def finish_reasons(self) -> list[str | None] | None:
        """Per row, why the most recent generation call stopped it (``None`` before any call).

        ``"eos"`` (an end-of-sequence id, or the constraint complete), ``"stop"`` (a
        ``stop_at`` string), ``"length"`` (``max_tokens``), ``"context"`` (the model's
        context ran out; the call warned) or ``"ban_exhausted"`` (every way on was banned).
        """
        return list(self._reasons) if self._reasons is not None else None

    @property
    def logprobs(self) -> list[list[tuple]] | None:
        """Per row, for each token the most recent call generated: ``(text, logprob,
        [(alternative_text, logprob), ...])``, when the call was given ``logprobs=k``
        (else ``None``).

        ``logprob`` is under the distribution the sampler drew from (after temperature,
        top-k, top-p, min-p and the constraint): a row's log-probabilities sum to what the
        call added to its weight. A token the constraint forced has log-probability 0. A row
        that ended by sampling an end id has a last entry for it (its weight counts it).
        """
        return [list(r) for r in self._logprobs] if self._logprobs is not None else None

    @property
    def constraint_cost(self) -> list[float] | None:
        """Per row, the nats the constraint removed in the most recent call (``None`` before any):
        the sum over the call's steps of ``-log`` of the probability mass that the constraint
        allowed (after the logits processors, before the sampler's temperature and filters);
        0 where the model never wanted a forbidden token, and for free text. A token forced
        at a step costs ``-log`` of its probability; tokens that fast-forward forwards with
        a step's token are not steps (``fast_forward=False`` makes every token one)."""
        return list(self._costs) if self._costs is not None else None

    @property
    def choice_scores(self) -> list[dict] | None:
        """Per row, each option's log-probability under the model after the prompt, when the
        most recent call was a ``generate.choice(..., scores=...)`` (else ``None``).

        A dict keyed like ``value`` (the option's string, or its Enum member or Literal
        value); the sum of the option's tokens' log-softmax, or their mean with
        ``scores="mean"``. Raw model probabilities: no sampler setting or constraint applies.
        """
        return [dict(r) for r in self._scores] if self._scores is not None else None

    @property
    def cache_bytes(self) -> CacheBytes:
        """The KV cache memory this state keeps in this process, in bytes.

        States grown from one computation (a conversation's turns, slices, samples of a
        prompt) share one buffer: ``alone`` is what dropping this state would free (the
        buffer, when no other live state uses it), ``shared`` what it keeps with other live
        states (freed with the last of them). Both count the buffer's whole capacity. A
        swarm state's cache is on its servers: 0 here.
        """
        cache = self._rows.cache
        if cache is None:
            return CacheBytes(0, 0)
        owner, nbytes = cache.storage()
        if any(state is not self for state in _HOLDERS.get(owner, ())):
            return CacheBytes(0, nbytes)
        return CacheBytes(nbytes, 0)

    def __iter__(self) -> Iterator[str]:
        """The full text of each row, in row order."""
        return iter(self._rows.texts)

    def __len__(self) -> int:
        """The number of rows: what iteration yields (use ``len(str(state))`` for characters)."""
        return self._rows.n_rows

    def __contains__(self, text) -> bool:
        """Whether some row's text contains ``text`` (for one row, as ``text in str(state)``)."""
        if not isinstance(text, str):
            raise TypeError(f"'in <SequenceState>' requires a str, not {type(text).__name__}")
        return any(text in t for t in self._rows.texts)

    def __bool__(self) -> bool:
        """False only when every row's text is empty, as for ``str``."""
        return any(self._rows.texts)

    def __str__(self) -> str:
        texts = self._rows.texts
        return texts[0] if len(texts) == 1 else str(list(texts))

    def __repr__(self) -> str:
        preview = [t if len(t) <= 40 else t[:18] + "..." + t[-19:] for t in self._rows.texts]
        return (f"SequenceState(batch_size={self.batch_size}, num_samples={self.num_samples}, "
                f"length={self._rows.token_ids.shape[1]}, cached_lengths={self.cached_lengths.tolist()}, "
                f"texts={preview!r})")

    def drop_cache(self) -> "SequenceState":
        """The same state with its cache released: the next call recomputes everything."""
        return self._replace(self._rows.drop_cache())

    def _replace(self, rows: Rows, weights=None, batch_size=None, num_samples=None, values=..., reasons=...,
                 logprobs=..., costs=..., choice_scores=...):
        return SequenceState(
            self.model, rows, self._weights if weights is None else weights,
            self.batch_size if batch_size is None else batch_size,
            self.num_samples if num_samples is None else num_samples,
            values=self._values if values is ... else values, parse=self._parse,
            reasons=self._reasons if reasons is ... else reasons,
            logprobs=self._logprobs if logprobs is ... else logprobs,
            costs=self._costs if costs is ... else costs,
            choice_scores=self._scores if choice_scores is ... else choice_scores,
        )

    # ------------------------------------------------------------------ indexing
    def __getitem__(self, key) -> "SequenceState | str | list":
        batch_key, sample_key, char_key = self._split_key(key)
        if isinstance(char_key, slice) and char_key.step not in (None, 1):
            raise ValueError(f"slice step must be 1, got {char_key.step}")
        batches = _positions(batch_key, self.batch_size, "batch")
        samples = _positions(sample_key, self.num_samples, "sample")
        rows = [b * self.num_samples + s for b in batches for s in samples]
        state = self
        if rows != list(range(self._rows.n_rows)):
            state = self._replace(
                self._rows.select(rows), self._weights.reshape(-1)[rows], len(batches), len(samples),
                None if self._values is None else [self._values[r] for r in rows],
                None if self._reasons is None else [self._reasons[r] for r in rows],
                None if self._logprobs is None else [self._logprobs[r] for r in rows],
                None if self._costs is None else [self._costs[r] for r in rows],
                None if self._scores is None else [self._scores[r] for r in rows],
            )
        if isinstance(char_key, slice):
            try:
                return state._prefix(char_key)
            except SlicingError as exc:
                warnings.warn(f"{exc}: the KV cache is dropped", CacheResetWarning, stacklevel=2)
                return state._reencoded(char_key)
        if isinstance(char_key, int) and not isinstance(char_key, bool):
            chars = []
            for r, text in enumerate(state._rows.texts):
                if not -len(text) <= char_key < len(text):
                    raise IndexError(f"character index {char_key} is out of range for row {r} "
                                     f"({len(text)} characters)")
                chars.append(text[char_key])
            return shape_rows(chars, state.batch_size, state.num_samples)
        raise TypeError(f"character key must be an int or a slice, got {type(char_key).__name__}")

    def _split_key(self, key) -> tuple:
        parts = key if isinstance(key, tuple) else (key,)
        everything = slice(None)
        if len(parts) == 3:
            return parts
        if len(parts) == 2:
            if self.num_samples == 1:
                return parts[0], everything, parts[1]
            if self.batch_size == 1:
                return everything, parts[0], parts[1]
            raise IndexError(f"this state has {self.batch_size} prompts and {self.num_samples} samples: "
                             "index it as state[batch, sample, chars]")
        if len(parts) == 1:
            if self.batch_size == 1 and self.num_samples == 1:
                return everything, everything, parts[0]
            raise IndexError(f"this state has {self.batch_size} prompts and {self.num_samples} samples: "
                             "index it as state[batch, sample, chars] (or leave out a dimension of size 1)")
        raise IndexError(f"a state takes at most 3 keys (batch, sample, chars), got {len(parts)}")

    def _prefix(self, key: slice) -> "SequenceState":
        """Keep the first characters of every row, and the cache up to the cut."""
        rows = self._rows
        bounds = [key.indices(len(t))[:2] for t in rows.texts]
        if any(start > 0 for start, _ in bounds):
            raise SlicingError("a slice that starts after character 0 changes every position")
        cuts = [max(start, stop) for start, stop in bounds]
        if all(c >= len(t) for c, t in zip(cuts, rows.texts)):
            return self
        return self._replace(rows.with_text(self.model.tokenizer, cuts, [""] * rows.n_rows))

    def _reencoded(self, key: slice) -> "SequenceState":
        texts = [t[key] for t in self._rows.texts]
        return self._replace(Rows.from_texts(self.model.tokenizer, texts))

    # ------------------------------------------------------------------ adding
    def __add__(self, other) -> "SequenceState":
        rows = self._rows
        if isinstance(other, str):
            suffixes = [other] * rows.n_rows
            weights = self._weights
        elif isinstance(other, list):
            if not all(isinstance(t, str) for t in other):
                raise TypeError("a state can be added a str, a list of str or a SequenceState")
            if len(other) == rows.n_rows:
                suffixes = list(other)
            elif len(other) == self.batch_size:
                suffixes = [t for t in other for _ in range(self.num_samples)]
            else:
                raise BatchMismatch(f"cannot add {len(other)} texts to a state of {self.batch_size} prompts "
                                    f"x {self.num_samples} samples: give one text per row "
                                    f"({rows.n_rows}) or per prompt ({self.batch_size})")
            weights = self._weights
        elif isinstance(other, SequenceState):
            if other.model is not self.model:
                raise ValueError("cannot add states of different models")
            if other.batch_size != self.batch_size:
                raise BatchMismatch(f"cannot add a state of {other.batch_size} prompts to one of "
                                    f"{self.batch_size} prompts")
            if other.num_samples != self.num_samples:
                raise SampleMismatch(f"cannot add a state of {other.num_samples} samples to one of "
                                     f"{self.num_samples} samples")
            suffixes = list(other._rows.texts)
            weights = self._weights + other._weights
        else:
            return NotImplemented
        new = rows.with_text(self.model.tokenizer, [len(t) for t in rows.texts], suffixes)
        return self._replace(new, weights)

    def __radd__(self, other) -> "SequenceState":
        if not isinstance(other, str):
            return NotImplemented
        if not other:  # nothing goes before the text: no position changes, so the cache stays
            return self
        warnings.warn("text put before a state changes every position: the KV cache is dropped",
                      CacheResetWarning, stacklevel=2)
        texts = [other + t for t in self._rows.texts]
        return self._replace(Rows.from_texts(self.model.tokenizer, texts))


def _positions(key, size: int, name: str) -> list[int]:
    """The indices a batch or sample key selects."""
    if isinstance(key, bool) or not isinstance(key, (int, slice)):
        raise TypeError(f"{name} key must be an int or a slice, got {type(key).__name__}")
    if isinstance(key, int):
        if not -size <= key < size:
            raise IndexError(f"{name} index {key} is out of range (size {size})")
        return [key % size]
    if key.step not in (None, 1):
        raise ValueError(f"slice step must be 1, got {key.step}")
    picked = list(range(*key.indices(size)))
    if not picked:
        raise IndexError(f"{name} slice {key} selects nothing out of {size}")
    return picked
