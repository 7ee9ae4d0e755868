"""A generator's constraint inside transformers' own loop: ``model.generate(..., logits_processor=...)``."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from .decode.constraints import RowConstraints
from .generate.base import SequenceGenerator

__all__ = ["logits_processor", "ConstraintLogitsProcessor"]


def logits_processor(generator) -> "ConstraintLogitsProcessor":
    """A transformers logits processor that holds ``model.generate`` to a generator's constraint.

    Parameters
    ----------
    generator
        A generator of ``continuous.generate`` (or one wrapped by ``continuous()``) on a
        local model; give ``generate`` the same HF model and tokenizer.

    Returns
    -------
    ConstraintLogitsProcessor
        A transformers ``LogitsProcessor``: pass it as ``model.generate(...,
        logits_processor=...)``, alone or in a list with others. Greedy, sampling and
        beam search work (each sequence's state follows its tokens); build one per
        ``generate`` call.

    Raises
    ------
    TypeError
        For anything but a generator.
    ValueError
        For a generator that needs to rewind while decoding, which ``model.generate``
        cannot do: one with ``ban=``, or a JSON schema whose keywords the grammar does not
        enforce (``uniqueItems``, ``not``...: ``constraint.dropped``), with the reason.

    Examples
    --------
    >>> gen = generate.choice(model, ["yes", "no"])               # doctest: +SKIP
    >>> out = model.model.generate(ids, logits_processor=logits_processor(gen))  # doctest: +SKIP
    """
    from .wrapper import ContinuousGenerator

    if isinstance(generator, ContinuousGenerator):
        generator = generator.generator
    if not isinstance(generator, SequenceGenerator):
        raise TypeError(f"logits_processor takes a generator of continuous.generate, got {type(generator).__name__}")
    rewinds = "its ban= list" if generator.ban is not None else None
    dropped = getattr(generator.constraint, "dropped", None)
    if rewinds is None and dropped:
        rewinds = f"its schema's {', '.join(sorted(dropped))}, which the grammar does not enforce,"
    if rewinds is not None:
        raise ValueError(f"this generator enforces {rewinds} by rewinding while decoding, which model.generate "
                         "cannot do: generate with continuous(generator) instead")
    return ConstraintLogitsProcessor(generator)


class ConstraintLogitsProcessor(LogitsProcessor):
    """Masks what a generator's constraint forbids after each sequence's generated tokens.

    The first call takes ``input_ids`` as the prompts. Each sequence's matcher is found
    by its generated tokens, so sequences that beam search reorders or duplicates keep
    theirs; a sequence that emitted an end id is left alone (``generate`` pads it).
    """

    def __init__(self, generator: SequenceGenerator):
        model = generator.model
        self.constraint = generator.constraint
        self.tokenizer, self.eos = model.tokenizer, model.tokenizer.eos_token_id
        self.ends = set(model.eos_token_ids)
        self.start: int | None = None
        self.matchers: dict[tuple[int, ...], object] = {}

    # ``generate`` takes a list of processors: this one passes as the list of itself too.
    def __iter__(self):
        return iter([self])

    def __len__(self) -> int:
        return 1

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.constraint is None:
            return scores
        if self.start is None or input_ids.shape[1] <= self.start:
            self.start, self.matchers = input_ids.shape[1], {}
        generated = [tuple(row) for row in input_ids[:, self.start:].tolist()]
        live = [r for r, ids in enumerate(generated) if not self.ends & set(ids)]
        matchers = {}
        for r in live:
            ids = generated[r]
            if ids not in matchers:
                matchers[ids] = self._matcher(ids)
        self.matchers = matchers
        # A sequence shared by two beams shares its matcher: masks are read, never advanced here.
        rows = RowConstraints(None, len(live), scores.shape[-1], len(self.tokenizer), self.eos, scores.device,
                              matchers=[matchers[generated[r]] for r in live],
                              also_eos=tuple(self.ends - {self.eos}))
        allowed = rows.allowed()
        out = scores.clone()
        out[live] = scores[live].masked_fill(~allowed, -torch.inf)
        return out

    def _matcher(self, ids: tuple[int, ...]):
        """The matcher after ``ids``: the parent sequence's, moved past its last token."""
        parent = self.matchers.get(ids[:-1]) if ids else None
        if parent is None:
            matcher = self.constraint.matcher()
            for t in ids:
                matcher.advance(t)
            return matcher
        matcher = parent.copy()
        matcher.advance(ids[-1])
        return matcher
