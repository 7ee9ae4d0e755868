"""``continuous()``: turn a generator into a function of prompts and states."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch

from .decode import Generation, Options, decode
from .errors import SampleMismatch
from .generate.base import SequenceGenerator, make
from .layout import Rows
from .samplers import Greedy, check_seed
from .state import CutShort, SequenceState, shape_rows

__all__ = ["ContinuousGenerator", "continuous"]


def continuous(generator, *, fast_forward: bool = True) -> "ContinuousGenerator":
    """Wrap a generator so that it takes and returns :class:`~continuous.state.SequenceState`.

    Parameters
    ----------
    generator
        A generator from ``continuous.generate``, or an outlines 1.x ``outlines.Generator``
        built on ``outlines.from_transformers(...)`` (its ``Index`` is reused; ``value``
        is then the generated string).
    fast_forward
        Where the constraint allows exactly one continuation, forward those tokens with
        the sampled one in a single call (the text and tokens are the same as one by one;
        ``model.stats.forward_calls`` shows the saving).
    """
    return ContinuousGenerator(generator, fast_forward=fast_forward)


def _from_outlines(generator) -> SequenceGenerator:
    from outlines.generator import SteerableGenerator
    from outlines.models.transformers import Transformers as OutlinesTransformers

    from .models.transformers import transformers

    if not isinstance(generator, SteerableGenerator) or not isinstance(generator.model, OutlinesTransformers):
        raise TypeError("continuous() wraps generators of continuous.generate, or outlines Generators "
                        f"built on outlines.from_transformers; got {type(generator).__name__}")
    processor = generator.logits_processor
    index = getattr(processor, "index", None)
    if processor is not None and index is None:
        raise TypeError(f"the outlines generator's {type(processor).__name__} has no outlines_core Index: "
                        "build it with the default outlines_core backend")
    model = transformers(generator.model.model, generator.model.hf_tokenizer)
    constraint = None
    if index is not None:
        from .engines.outlines_core import from_index

        constraint = from_index(index, model.tokenizer)
    return make(model, Greedy(), constraint, kind="outlines" if index is None else "outlines-regex")


class ContinuousGenerator:
    """A generator that returns SequenceStates. Build it with :func:`continuous`."""

    def __init__(self, generator, fast_forward: bool = True):
        self.generator = generator if isinstance(generator, SequenceGenerator) else _from_outlines(generator)
        self.fast_forward = fast_forward

    @property
    def model(self):
        return self.generator.model

    def __repr__(self) -> str:
        return f"continuous({self.generator.kind} generator, sampler={self.generator.sampler})"

    def __call__(self, prompt, max_tokens: int | None = None, stop_at: str | Sequence[str] | None = None,
                 seed: int | None = None, rng: torch.Generator | None = None, heal: bool = False) -> SequenceState:
        """Generate from prompts or continue a state.

        Parameters
        ----------
        prompt
            A ``str``, a ``list[str]`` (a batch) or a :class:`SequenceState`, whose rows
            are continued: only the tokens its cache does not cover are forwarded.
        max_tokens
            Most tokens generated per row.
        stop_at
            A string or list of strings ending a row when generated (they stay in the
            state's text, not in ``value``).
        seed, rng
            Make sampling reproducible: an int seed, or a ``torch.Generator``.
        heal
            Token healing: back up over the input's last tokens (at most a few) whose text a
            longer token could extend, and make the first generated tokens spell that text
            again; the result's text starts with the input's text, and ``value`` leaves the
            re-spelled text out. The crop keeps the cache.

        Returns
        -------
        SequenceState
            The input continued; ``value`` holds this call's typed results.
        """
        stream = self._stream(prompt, max_tokens=max_tokens, stop_at=stop_at, seed=seed, rng=rng, heal=heal)
        while True:
            try:
                next(stream)
            except StopIteration as done:
                return done.value

    def stream(self, prompt, max_tokens: int | None = None, stop_at: str | Sequence[str] | None = None,
               seed: int | None = None, rng: torch.Generator | None = None, heal: bool = False) -> Iterator[Any]:
        """Like ``__call__``, but yield the text of each new token as it is generated.

        Each item is shaped like ``value``: a ``str`` for one row, else lists over rows
        (``""`` for a row that produced no text this step, e.g. a finished row). The
        final SequenceState is the generator's return value (``StopIteration.value``).

        Raises
        ------
        ValueError
            With beam search: beams reorder at every step, so a piece would not say which
            text it extends; call the generator instead.
        """
        if self.generator.sampler.joint and self.generator.sampler.samples > 1:
            raise ValueError("beam search cannot stream: beams reorder at every step, so a piece would not "
                             "extend a fixed row; call the generator to get the final beams")
        return self._stream(prompt, max_tokens=max_tokens, stop_at=stop_at, seed=seed, rng=rng, heal=heal)

    def _stream(self, prompt, max_tokens, stop_at, seed, rng, heal) -> Iterator[Any]:
        model, sampler = self.generator.model, self.generator.sampler
        rows, weights, batch_size, samples_in = self._rows_of(prompt)
        samples = sampler.samples
        if samples_in != samples:
            if samples_in != 1:
                raise SampleMismatch(f"the state has {samples_in} samples per prompt and the generator's "
                                     f"sampler makes {samples}")
        max_tokens = _check_max_tokens(max_tokens)
        stop_at = _check_stop_at(stop_at)
        rng = _check_rng(seed, rng)
        options = Options(max_tokens=max_tokens, stop_at=stop_at, rng=rng, fast_forward=self.fast_forward,
                          bans=self.generator.ban, heal=bool(heal), fork=samples if samples_in == 1 else 1)
        steps = decode(model, rows, weights.reshape(-1), self.generator.constraint, sampler, options)
        # Arguments are checked above, when stream() is called; the steps run when iterated.
        return self._run(steps, batch_size, samples)

    def _run(self, steps, batch_size: int, samples: int) -> Iterator[Any]:
        while True:
            try:
                pieces = next(steps)
            except StopIteration as done:
                result: Generation = done.value
                break
            yield shape_rows([p or "" for p in pieces], batch_size, samples)
        texts = result.texts
        if result.complete is not None:
            texts = [t if t is None or whole else CutShort(t) for t, whole in zip(texts, result.complete)]
        return SequenceState(self.generator.model, result.rows, result.weights, batch_size, samples,
                             texts, self.generator.parse, result.reasons)

    def _rows_of(self, prompt) -> tuple[Rows, torch.Tensor, int, int]:
        model = self.generator.model
        if isinstance(prompt, SequenceState):
            if prompt.model is not model:
                raise ValueError("this state was made with another model than the generator's")
            return prompt._rows, prompt.weights, prompt.batch_size, prompt.num_samples
        if isinstance(prompt, str):
            prompt = [prompt]
        elif isinstance(prompt, list):
            if not prompt:
                raise ValueError("the list of prompts is empty")
            if not all(isinstance(p, str) for p in prompt):
                raise TypeError("a list prompt must hold only str")
        else:
            raise TypeError(f"prompt must be a str, a list of str or a SequenceState, got {type(prompt).__name__}")
        rows = Rows.from_texts(model.tokenizer, prompt)
        return rows, torch.zeros(len(prompt), 1), len(prompt), 1


def _check_max_tokens(max_tokens):
    if max_tokens is None:
        return None
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(f"max_tokens must be a non-negative int or None, got {max_tokens!r}")
    return max_tokens


def _check_stop_at(stop_at) -> list[str]:
    if stop_at is None:
        return []
    if isinstance(stop_at, str):
        return [stop_at]
    if isinstance(stop_at, (list, tuple)) and all(isinstance(s, str) for s in stop_at):
        return list(stop_at)
    raise TypeError("stop_at must be a str or a list of str")


def _check_rng(seed, rng):
    if seed is not None and rng is not None:
        raise ValueError("give seed or rng, not both")
    if check_seed(seed) is not None:
        return torch.Generator().manual_seed(seed)
    if rng is not None and not isinstance(rng, torch.Generator):
        raise TypeError(f"rng must be a torch.Generator, got {type(rng).__name__}")
    return rng
