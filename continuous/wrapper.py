"""``continuous()``: turn a generator into a function of prompts and states."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from .decode import Decoding, Generation, Options
from .decode.speculate import as_drafter, check_speculation
from .errors import SampleMismatch
from .generate.base import SequenceGenerator, make
from .generate.types import parser_of
from .layout import Rows
from .samplers import Greedy, Multinomial, Sampler, check_seed
from .state import CutShort, SequenceState, shape_rows

__all__ = ["ContinuousGenerator", "Stream", "AsyncStream", "continuous"]


def continuous(generator, *, fast_forward: bool = True, output_type: Any = None) -> "ContinuousGenerator":
    """Wrap a generator so that it takes and returns :class:`~continuous.state.SequenceState`.

    Parameters
    ----------
    generator
        A generator from ``continuous.generate``, or an outlines 1.x ``outlines.Generator``
        built on ``outlines.from_transformers(...)``, with the ``outlines_core`` backend
        (its ``Index`` is reused) or the ``llguidance`` one (its grammar is compiled
        here: JSON whitespace is then bounded as in ``generate.json``, and a JSON
        ``value`` is parsed and validated).
    fast_forward
        Where the constraint allows exactly one continuation, forward those tokens with
        the sampled one in a single call (the text and tokens are the same as one by one;
        ``model.stats.forward_calls`` shows the saving).
    output_type
        For an outlines generator (which does not keep it): the Python type its output
        type was, so that ``value`` comes back as that type (read as JSON, else from the
        text as pydantic reads strings).
    """
    return ContinuousGenerator(generator, fast_forward=fast_forward, output_type=output_type)


def _from_outlines(generator, output_type) -> SequenceGenerator:
    from outlines.generator import SteerableGenerator
    from outlines.models.transformers import Transformers as OutlinesTransformers

    from .models.transformers import transformers

    if not isinstance(generator, SteerableGenerator) or not isinstance(generator.model, OutlinesTransformers):
        raise TypeError("continuous() wraps generators of continuous.generate, or outlines Generators "
                        f"built on outlines.from_transformers; got {type(generator).__name__}")
    model = transformers(generator.model.model, generator.model.hf_tokenizer)
    processor = generator.logits_processor
    parse = parser_of(output_type) if output_type is not None else None
    if processor is None:
        return make(model, None, None, parse or str, kind="outlines")
    if getattr(processor, "index", None) is not None:  # the outlines_core backend
        from .engines.outlines_core import from_index

        return make(model, None, from_index(processor.index, model.tokenizer), parse or str, kind="outlines-regex")
    if isinstance(getattr(processor, "grammar", None), str):  # the llguidance backend
        from . import generate

        try:
            spec = json.loads(processor.grammar)["grammars"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            spec = {"lark_grammar": processor.grammar}  # a Lark grammar as given
        if spec.get("json_schema") is not None:
            made = generate.json(model, spec["json_schema"])
        else:
            made = generate.cfg(model, spec["lark_grammar"])
        return replace(made, parse=parse or made.parse, kind="outlines-" + made.kind)
    raise TypeError(f"the outlines generator's {type(processor).__name__} is neither outlines_core's nor "
                    "llguidance's: build it with one of these backends")


class ContinuousGenerator:
    """A generator that returns SequenceStates. Build it with :func:`continuous`."""

    def __init__(self, generator, fast_forward: bool = True, output_type: Any = None):
        if isinstance(generator, SequenceGenerator):
            if output_type is not None:
                raise ValueError("output_type= is for outlines generators: those of continuous.generate "
                                 "already give typed values (pass the type to generate.json or choice)")
            self.generator = generator
        else:
            self.generator = _from_outlines(generator, output_type)
        self.fast_forward = fast_forward

    @property
    def model(self):
        return self.generator.model

    def __repr__(self) -> str:
        return f"continuous({self.generator.kind} generator, sampler={self.generator.sampler})"

    def __call__(self, prompt, max_tokens: int | None = None, stop_at: str | Sequence[str] | None = None,
                 seed: int | None = None, rng: torch.Generator | None = None, heal: bool = False, *,
                 sampler: Sampler | None = None, temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None, min_p: float | None = None, repetition_penalty: float | None = None,
                 logits_processors: Sequence[Any] | None = None, logprobs: int | None = None,
                 speculate: Any = None) -> SequenceState:
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
        sampler
            This call's sampler instead of the generator's (same number of samples).
        temperature, top_p, top_k, min_p
            Shorthand for ``sampler=multinomial(...)`` with the generator's number of
            samples; ``temperature=0`` alone means greedy.
        repetition_penalty
            transformers' repetition penalty (above 1 discourages the row's earlier tokens,
            prompt included).
        logits_processors
            transformers ``LogitsProcessor`` objects (``(input_ids, scores) -> scores``),
            run unchanged on each step's scores before the constraint; ``input_ids`` holds
            each row's tokens, left-padded.
        logprobs
            Keep each generated token's log-probability and its ``logprobs`` likeliest
            alternatives with theirs, in :attr:`SequenceState.logprobs`.
        speculate
            Speculative decoding: ``continuous.PromptLookup(k=8, ngram=3)`` drafts by copying
            from the row's own text, and a ``models.transformers`` model sharing the
            tokenizer drafts as an assistant. Each step forwards the drafted tokens with its
            own and keeps those the model would have chosen: greedy outputs are the same as
            without it, sampled ones have the same distribution. Not with beam search,
            ``logits_processors`` or ``repetition_penalty``. ``model.stats.tokens_drafted``
            and ``tokens_accepted`` count the drafts.

        Returns
        -------
        SequenceState
            The input continued; ``value`` holds this call's typed results.
        """
        return self._stream(prompt, max_tokens, stop_at, seed, rng, heal, sampler, temperature, top_p, top_k,
                            min_p, repetition_penalty, logits_processors, logprobs, speculate).run()

    def stream(self, prompt, *args, **kwargs) -> "Stream":
        """Like ``__call__`` (same arguments), but yield the text of each new token as it is generated.

        Each item is shaped like ``value``: a ``str`` for one row, else lists over rows
        (``""`` for a row that produced no text this step, e.g. a finished row). The
        returned :class:`Stream`'s ``state`` is the state so far, at any time: after the
        last piece, after a ``break`` or after ``close()`` (its cache goes on from there).

        Raises
        ------
        ValueError
            With beam search: beams reorder at every step, so a piece would not say which
            text it extends; call the generator instead.
        """
        stream = self._stream(prompt, *args, **kwargs)
        if stream.sampler.joint and stream.sampler.samples > 1:
            raise ValueError("beam search cannot stream: beams reorder at every step, so a piece would not "
                             "extend a fixed row; call the generator to get the final beams")
        return stream

    async def acall(self, prompt, *args, **kwargs) -> SequenceState:
        """``__call__`` for asyncio: each step runs in a worker thread, off the event loop.

        Cancelling the task stops the generation after the step under way; the input
        state is unchanged and usable.
        """
        stream = self._stream(prompt, *args, **kwargs)
        while True:
            done, item = await stream.astep()
            if done:
                return item

    def astream(self, prompt, *args, **kwargs) -> "AsyncStream":
        """``stream`` for asyncio: ``async for piece in gen.astream(...)``, each step in a worker
        thread; its ``state`` is the state so far, as for :meth:`stream`."""
        return AsyncStream(self.stream(prompt, *args, **kwargs))

    def _stream(self, prompt, max_tokens=None, stop_at=None, seed=None, rng=None, heal=False, sampler=None,
                temperature=None, top_p=None, top_k=None, min_p=None, repetition_penalty=None,
                logits_processors=None, logprobs=None, speculate=None) -> "Stream":
        """Check a call's arguments (now, not when the steps run) and return its steps."""
        model = self.generator.model
        sampler = self._sampler(sampler, temperature, top_p, top_k, min_p)
        rows, weights, batch_size, samples_in = self._rows_of(prompt)
        samples = sampler.samples
        if samples_in not in (1, samples):
            raise SampleMismatch(f"the state has {samples_in} samples per prompt and the sampler makes {samples}")
        options = Options(max_tokens=_check_count(max_tokens, "max_tokens"), stop_at=_check_stop_at(stop_at),
                          rng=_check_rng(seed, rng), fast_forward=self.fast_forward, bans=self.generator.ban,
                          heal=bool(heal), fork=samples if samples_in == 1 else 1,
                          processors=_processors(repetition_penalty, logits_processors),
                          logprobs=_check_count(logprobs, "logprobs"), speculate=as_drafter(speculate, model))
        check_speculation(options.speculate, sampler, options.processors)

        def start() -> Decoding:
            return Decoding(model, rows, weights.reshape(-1), self.generator.constraint, sampler, options)

        def state(result: Generation) -> SequenceState:
            texts = result.texts
            if result.complete is not None:
                texts = [t if t is None or whole else CutShort(t) for t, whole in zip(texts, result.complete)]
            return SequenceState(model, result.rows, result.weights, batch_size, samples, texts,
                                 self.generator.parse, result.reasons, result.logprobs)

        return Stream(start, state, lambda pieces: shape_rows([p or "" for p in pieces], batch_size, samples),
                      sampler)

    def _sampler(self, sampler, temperature, top_p, top_k, min_p) -> Sampler:
        """The call's sampler: ``sampler``, the shorthand's multinomial, or the generator's."""
        shorthand = {k: v for k, v in dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p).items()
                     if v is not None}
        if sampler is not None:
            if shorthand:
                raise ValueError(f"give sampler= or {', '.join(shorthand)}, not both")
            if not isinstance(sampler, Sampler):
                raise TypeError(f"sampler must come from continuous.samplers, got {type(sampler).__name__}")
            return sampler
        if not shorthand:
            return self.generator.sampler
        samples = self.generator.sampler.samples
        if shorthand == {"temperature": 0}:
            return Greedy(samples)
        return Multinomial(samples, **shorthand)

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


def _check_count(value, name: str):
    """A non-negative int, or ``None``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be a non-negative int or None, got {value!r}")
    return value


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


def _processors(repetition_penalty, logits_processors) -> tuple:
    processors = list(logits_processors or ())
    if not all(callable(p) for p in processors):
        raise TypeError("logits_processors must be callables (input_ids, scores) -> scores, such as "
                        "transformers LogitsProcessor objects")
    if repetition_penalty is not None:
        from transformers import RepetitionPenaltyLogitsProcessor

        processors.insert(0, RepetitionPenaltyLogitsProcessor(float(repetition_penalty)))
    return tuple(processors)


class Stream:
    """A generation's text pieces as they come (iterate it), and ``state``: the state so far.

    Iterating it ends with ``StopIteration`` whose ``value`` is the final state, as a
    generator's return value.
    """

    def __init__(self, start: Callable[[], Decoding], state: Callable[[Generation], SequenceState],
                 shape: Callable[[list], Any], sampler: Sampler):
        self._start, self._state, self._shape, self.sampler = start, state, shape, sampler
        self._decoding: Decoding | None = None
        self._steps = None
        self._snapshot: SequenceState | None = None
        self._final: SequenceState | None = None

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Any:
        done, item = self.step()
        if done:
            raise StopIteration(item)
        return item

    def step(self) -> tuple[bool, Any]:
        """``(False, piece)`` for the next piece, or ``(True, final_state)`` once done."""
        if self._final is not None:
            return True, self._final
        if self._steps is None:
            self._steps = iter(self._started())
        try:
            pieces = next(self._steps)
        except StopIteration:
            self._final = self._state(self._started().result())
            return True, self._final
        self._snapshot = None
        return False, self._shape(pieces)

    def run(self) -> SequenceState:
        """Every step; the final state."""
        while True:
            done, item = self.step()
            if done:
                return item

    async def astep(self) -> tuple[bool, Any]:
        """:meth:`step` in a worker thread. Cancelled, the generation stops after the step under way."""
        running = asyncio.get_running_loop().run_in_executor(None, self.step)
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            # The step cannot be interrupted: let it end, then close, so that nothing runs on after.
            await asyncio.wait([running])
            self.close()
            raise

    def close(self) -> None:
        """Stop generating; ``state`` keeps what was generated (the prompt, if nothing was)."""
        if self._steps is None:  # closed before it started: no step will run
            self._steps = iter(self._started())
        self._steps.close()
        if self._final is None:
            self._final = self.state

    @property
    def state(self) -> SequenceState:
        """The state so far: the input (prefilled) before the first piece, then up to the last piece."""
        if self._final is not None:
            return self._final
        if self._snapshot is None:
            self._snapshot = self._state(self._started().result())
        return self._snapshot

    def _started(self) -> Decoding:
        if self._decoding is None:
            self._decoding = self._start()
        return self._decoding


class AsyncStream:
    """:class:`Stream` for ``async for``; each step runs in a worker thread."""

    def __init__(self, stream: Stream):
        self._stream = stream

    def __aiter__(self) -> "AsyncStream":
        return self

    async def __anext__(self) -> Any:
        done, item = await self._stream.astep()
        if done:
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        self._stream.close()

    @property
    def state(self) -> SequenceState:
        return self._stream.state
