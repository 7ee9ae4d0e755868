"""``continuous()``: turn a generator into a function of prompts and states."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import threading
import time
import weakref
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from .decode import Decoding, Generation, Options
from .decode.loop import drive
from .models.engine import DONE
from .models.table import ALL, PIECE, READY
from .generate.base import SequenceGenerator, make
from .generate.types import json_or_text, parser_of
from .heal import healed_lengths
from .layout import Rows
from .partial import PartialValues
from .samplers import Sampler
from .state import CutShort, SequenceState, shape_rows
from .transfer import owned

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

        return make(model, None, from_index(processor.index, model.tokenizer), parse or json_or_text,
                    kind="outlines-regex")
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


def _signature(self, prompt, max_tokens: int | None = None, stop_at: str | Sequence[str] | None = None,
               seed: int | None = None, rng: torch.Generator | None = None, heal: bool = False, *,
               sampler: Sampler | None = None, temperature: float | None = None, top_p: float | None = None,
               top_k: int | None = None, min_p: float | None = None, repetition_penalty: float | None = None,
               logits_processors: Sequence[Any] | None = None, logprobs: int | None = None, speculate: Any = None,
               logit_bias: dict[int, float] | None = None, presence_penalty: float | None = None,
               frequency_penalty: float | None = None):
    """The arguments of a call (``__call__``, ``stream``, ``acall`` and ``astream``)."""


_ARGUMENTS = """

        Parameters
        ----------
        prompt
            A ``str``, a ``list[str]`` (a batch) or a :class:`SequenceState`, whose rows
            are continued: only the tokens its cache does not cover are forwarded.
        max_tokens
            Most tokens generated per row.
        stop_at
            A string or list of strings ending a row when generated (they stay in the
            state's text; not in ``value``, unless the string ends a whole match of the
            generator's constraint, which then is the value).
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
        logit_bias
            Token id -> a number added to that token's score at every step, in every row
            (as OpenAI's ``logit_bias``; -100 all but forbids a token, 100 all but forces it).
        presence_penalty, frequency_penalty
            As OpenAI defines them: a token the row generated ``c`` times in this call
            loses ``frequency_penalty * c + presence_penalty * (c > 0)`` from its score
            (positive values discourage repeats, negative ones encourage them).
        speculate
            Speculative decoding: ``continuous.PromptLookup(k=8, ngram=3)`` drafts by copying
            from the row's own text (prompt and output), and a ``models.transformers`` model
            sharing the tokenizer (or ``continuous.decode.speculate.DraftModel(model, k)``)
            drafts as an assistant. Each step forwards the drafted tokens with its own and
            keeps those the model would have chosen: greedy outputs are the same as without
            it, sampled ones have the same distribution. Not with beam search,
            ``logits_processors``, ``repetition_penalty``, ``logit_bias`` or the penalties.
            ``model.stats.tokens_drafted`` and ``tokens_accepted`` count the drafts.

        Raises
        ------
        TypeError, ValueError
            For an argument of the wrong type or value, or a combination that cannot be
            served (checked when the call is made, before any step).
        """



def _call_arguments(method=None, **extra):
    """Give ``method(self, prompt, arguments)`` the visible signature and documentation of a
    call's arguments, and of the keyword-only ``extra`` ones (name -> default); it receives
    those given, by name."""
    if method is None:
        return functools.partial(_call_arguments, **extra)
    signature = inspect.signature(_signature)
    signature = signature.replace(parameters=list(signature.parameters.values()) + [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default) for name, default in extra.items()])

    names = frozenset(signature.parameters) - {"self", "prompt"}

    def arguments(self, prompt, args, kwargs) -> dict:
        if not args and names.issuperset(kwargs):  # all by known names (most calls): nothing to bind
            return dict(kwargs)
        given = signature.bind(self, prompt, *args, **kwargs).arguments
        del given["self"], given["prompt"]
        return given

    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def bound(self, prompt, *args, **kwargs):
            return await method(self, prompt, arguments(self, prompt, args, kwargs))
    else:
        @functools.wraps(method)
        def bound(self, prompt, *args, **kwargs):
            return method(self, prompt, arguments(self, prompt, args, kwargs))

    bound.__signature__ = signature.replace(return_annotation=inspect.signature(method).return_annotation)
    bound.__doc__ = method.__doc__ + _ARGUMENTS
    return bound


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

    @_call_arguments
    def __call__(self, prompt, arguments: dict) -> SequenceState:
        """Generate from prompts or continue a state: the input continued, whose ``value``
        holds this call's typed results."""
        return self._stream(prompt, arguments).run()

    @_call_arguments(partial=False)
    def stream(self, prompt, arguments: dict) -> Stream:
        """Like ``__call__`` (same arguments), but yield the text of each new token as it is generated.

        Each item is shaped like ``value``: a ``str`` for one row, else lists over rows
        (``""`` for a row that produced no text this step, e.g. a finished row). The
        returned :class:`Stream`'s ``state`` is the state so far, at any time: after the
        last piece, after a ``break`` or after ``close()`` (its cache goes on from there).
        With ``partial=True``, each item is instead the value parsed so far (for JSON,
        dicts and lists that grow, strings by their prefix, pydantic types as unvalidated
        ``model_construct`` objects; for other generators, the text so far: see
        :mod:`continuous.partial`), and one last item is the complete ``value`` (which
        raises, as ``value`` does, when the text is cut short).
        With beam search it raises ``ValueError``: beams reorder at every step, so a piece
        would not say which text it extends; call the generator instead."""
        partial = arguments.pop("partial", False)
        stream = self._stream(prompt, arguments, partial)
        if stream.sampler.joint and stream.sampler.samples > 1:
            raise ValueError("beam search cannot stream: beams reorder at every step, so a piece would not "
                             "extend a fixed row; call the generator to get the final beams")
        return stream

    @_call_arguments
    async def acall(self, prompt, arguments: dict) -> SequenceState:
        """``__call__`` for asyncio: the model's engine runs the steps, off the event loop.

        Cancelling the task stops the generation at the engine's next step (or between two
        chunks of its prompt); the input state is unchanged and usable."""
        return await self._stream(prompt, arguments).arun()

    @_call_arguments(partial=False)
    def astream(self, prompt, arguments: dict) -> AsyncStream:
        """``stream`` for asyncio: ``async for piece in gen.astream(...)``, the steps run by the
        model's engine; its ``state`` is the state so far, as for :meth:`stream`."""
        return AsyncStream(self.stream(prompt, **arguments))

    def _stream(self, prompt, arguments: dict, partial: bool = False) -> Stream:
        """Check a call's arguments (now, not when the steps run) and return its steps."""
        model, generator = self.generator.model, self.generator
        prompt = generator.opened(prompt)
        rows, weights, batch_size, samples_in = self._rows_of(prompt)
        options = Options.from_call(generator, samples_in, self.fast_forward, **arguments)
        samples = options.sampler.samples

        cached, scorer, scores = 0, generator.scorer, None

        def start() -> Decoding:
            nonlocal rows, cached, scores
            rows, cached = self._reused(rows, options)
            start_rows = rows
            if scorer is not None:  # the prompt is forwarded once, for the scores and the generation
                start_rows, scores = scorer(model, rows, options.fork)
            return Decoding(model, start_rows, weights.reshape(-1), generator.constraint, options)

        def initial() -> SequenceState:
            """The input, for a call that ended before its rows were prepared."""
            if isinstance(prompt, SequenceState):
                return prompt
            return SequenceState(model, rows, weights, batch_size, samples_in, parse=generator.parse)

        def state(result: Generation, final: bool = False) -> SequenceState:
            texts = result.texts
            if result.complete is not None:
                texts = [t if t is None or whole else CutShort(t) for t, whole in zip(texts, result.complete)]
            rows, weights = _own_memory(result.rows, result.weights)  # a state may be kept: it holds its own memory
            if final and model.prefix_cache is not None:
                model.prefix_cache.insert(rows)
            return SequenceState(model, rows, weights, batch_size, samples, values=texts, parse=generator.parse,
                                 reasons=result.reasons, logprobs=result.logprobs, costs=result.costs,
                                 choice_scores=scores, tokens_cached=cached)

        tag = generator.tagger()  # pieces of a thinking section say which part they are

        def shape(items: list) -> Any:
            return shape_rows(items, batch_size, samples)

        pieces = PartialValues(generator, shape) if partial else lambda p: shape(tag([t or "" for t in p]))
        n_rows = rows.n_rows * options.fork
        longest = int(rows.attention_mask.sum(1).max())
        tokens = min(model.max_length, longest + (model.max_length if options.max_tokens is None else options.max_tokens))
        engine = getattr(model, "engine", None)
        if engine is not None:
            engine.check(n_rows, tokens)  # a call that could never be admitted is refused now
        return Stream(start, state, pieces, options.sampler, model, initial, (n_rows, tokens), last_value=partial)

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

    def _reused(self, rows: Rows, options: Options) -> tuple[Rows, int]:
        """Fresh prompts on the model's prefix cache, if it keeps one; and the tokens it saved.

        Tokens that healing crops are not taken: they would be forwarded again, not saved."""
        model = self.generator.model
        kept = model.prefix_cache
        if kept is None or rows.cache is not None:
            return rows, 0
        heals = options.heal and options.max_tokens != 0  # as the decoding loop decides
        rows, saved = kept.reuse(rows, healed_lengths(model.tokenizer, rows) if heals else None)
        self.generator.model.stats.record_cached(saved)
        return rows, saved


class Stream:
    """A generation's text pieces as they come (iterate it), and ``state``: the state so far.

    Iterating it ends with ``StopIteration`` whose ``value`` is the final state, as a
    generator's return value. With ``last_value``, the final state's ``value`` is the last item.
    ``first_piece_at`` is the ``time.monotonic()`` of the first piece (the first token), once
    it came: the time to first token of a call that runs whole too.

    The call runs on its model's engine (:mod:`continuous.models.engine`), which steps it
    with the other calls on the model; a model without one (a swarm's) runs it alone, on
    the consumer's thread (a worker thread for the async forms).
    """

    def __init__(self, start: Callable[[], Decoding], state: Callable[[Generation], SequenceState],
                 shape: Callable[[list], Any], sampler: Sampler, model, initial: Callable[[], SequenceState],
                 size: tuple[int, int] = (0, 0), last_value: bool = False):
        self._start, self._state, self._shape, self.sampler = start, state, shape, sampler
        self._model, self._initial, self._size, self._last_value = model, initial, size, last_value
        self._engine = getattr(model, "engine", None)
        self._decoding: Decoding | None = None
        self._call = None  # the engine's call
        self._alone = None  # the events of a call run alone (no engine)
        self._snapshot: SequenceState | None = None
        self._seen: Callable[[], Generation] | None = None  # the result its consumer has seen, made when read
        self._final: SequenceState | None = None
        self._ended: SequenceState | None = None  # made where the call ended
        self._first_piece_at: float | None = None  # of a call run alone (else its engine call's)
        self._keep_yielded = False
        self._whole = False  # the consumer takes the whole answer: no pieces past the first

    def _body(self):
        """The call's coroutine: build the decoding, run it, make its final state; all on the
        thread that steps it (the engine's, for async consumers: the event loop does no torch work).

        It holds the stream weakly: a stream dropped unfinished is collected, and its call cancelled.
        """
        return _call_body(self._start, self._state, weakref.ref(self))

    def _resumed(self) -> None:
        """The call goes on past the last piece its consumer took: keep the state it has seen, for a
        cancel that would come before the next piece is yielded (async streams)."""
        if self._keep_yielded:
            self._snapshot, self._seen = None, self._decoding.seen()

    def _submitted(self):
        """The stream's call on the engine, queued on first use; cancelled if the stream is dropped."""
        if self._call is None:
            self._call = self._engine.submit(self._body(), *self._size)
            weakref.finalize(self, self._engine.cancel, self._call)
        return self._call

    def _prepared(self) -> bool:
        return self._decoding is not None and self._decoding.prepared

    def _next(self, what: str):
        """The next piece, ``READY``, or ``DONE`` (``what`` is ``PIECE``, ``READY`` or ``ALL``)."""
        if self._engine is not None:
            return self._engine.next(self._submitted(), what)
        if self._alone is None:
            self._alone = drive(self._body(), self._model)
        for event in self._alone:
            if event is not READY and self._first_piece_at is None:
                self._first_piece_at = time.monotonic()
            if event is READY:
                if what == READY:
                    return READY
            elif what == PIECE:
                return event
        return DONE

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
        return self._took(self._next(PIECE))

    def _took(self, event) -> tuple[bool, Any]:
        if event == DONE:
            self._final = self._finished()
            if self._last_value:  # the next step finds _final and ends
                return False, self._final.value
            return True, self._final
        self._snapshot, self._seen = None, None
        return False, self._shape(event)

    def _finished(self) -> SequenceState:
        if self._ended is not None:
            return self._ended
        return self._state(self._decoding.result(), True) if self._prepared() else self._initial()

    def run(self) -> SequenceState:
        """Every step; the final state."""
        if self._final is None:
            self._take_whole()
            self._next(ALL)
            self._final = self._finished()
        return self._final

    def _take_whole(self) -> None:
        """The consumer takes the whole answer: the call stops handing out pieces (but its
        first, whose time is the time to first token)."""
        self._whole = True
        if self._decoding is not None:
            self._decoding.whole = True

    async def arun(self) -> SequenceState:
        """:meth:`run` for asyncio. Cancelled, the generation stops at the engine's next step
        (or the next chunk of its prefill), and ``state`` keeps it."""
        if self._final is not None:
            return self._final
        if self._engine is None:
            return (await self._in_worker(whole=True))[1]
        self._take_whole()
        self._submitted()
        try:
            await self._engine.anext(self._call, ALL)
        except asyncio.CancelledError:
            await self._aclosed()
            raise
        self._final = self._finished()
        return self._final

    async def astep(self, keep_yielded: bool = False) -> tuple[bool, Any]:
        """:meth:`step` for asyncio. Cancelled, the generation stops at the engine's next step;
        ``keep_yielded``: the state then leaves out a step whose piece was never yielded."""
        if self._final is not None:
            return True, self._final
        if self._engine is None:
            return await self._in_worker(keep_yielded)
        self._keep_yielded = keep_yielded  # the state it has seen is kept when the call resumes
        self._submitted()
        try:
            event = await self._engine.anext(self._call, PIECE)
        except asyncio.CancelledError:
            await self._aclosed()
            raise
        return self._took(event)

    async def _in_worker(self, keep_yielded: bool = False, whole: bool = False) -> tuple[bool, Any]:
        """A call run alone (no engine): its next step (``whole``: every step) in a worker thread.
        Cancelled, it stops after the step under way."""
        stop = threading.Event()

        def run():
            before = self.state if keep_yielded else None  # what the consumer has seen
            while True:
                done, item = self.step()
                if done or not whole or stop.is_set():
                    return before, (done, item)

        running = asyncio.get_running_loop().run_in_executor(self._model.executor, run)
        try:
            return (await asyncio.shield(running))[1]
        except asyncio.CancelledError:
            stop.set()
            await asyncio.wait([running])
            self.close()
            if keep_yielded and running.exception() is None:
                before, (done, _) = running.result()
                self._final = self._final if done else before
            raise

    async def _aclosed(self) -> None:
        """After a cancel: the call ends at the engine's next step; the state keeps what it did
        (or the snapshot the consumer saw)."""
        self._engine.cancel(self._call)
        await self._engine.aclose(self._call)
        if self._final is None:
            self._final = self._kept()

    def close(self) -> None:
        """Stop generating; ``state`` keeps what was generated (the prompt, if nothing was)."""
        if self._final is not None:
            return
        if self._call is None and self._alone is None:  # closed before it started: no step will run
            self._next(READY)
        if self._engine is not None:
            self._engine.close(self._call)
        else:
            self._alone.close()
        if self._final is None:
            self._final = self._kept()

    def _kept(self) -> SequenceState:
        """The state so far, kept as the final one of a call closed early."""
        state = self.state
        self._snapshot, self._seen = None, None  # the kept state stands for them from now on
        return state

    @property
    def first_piece_at(self) -> float | None:
        """The ``time.monotonic()`` of the first piece (the first token), once it came: the time to
        first token of a call that runs whole too."""
        return self._call.first_piece_at if self._call is not None else self._first_piece_at

    @property
    def state(self) -> SequenceState:
        """The state so far: the input (prefilled) before the first piece, then up to the last piece."""
        if self._final is not None:
            return self._final
        if self._snapshot is None:
            if not self._prepared() and (self._call is None or not self._call.done):
                self._next(READY)
            seen = self._seen if self._seen is not None else self._decoding.seen() if self._prepared() else None
            self._snapshot = self._state(seen()) if seen is not None else self._initial()
        return self._snapshot


def _own_memory(rows: Rows, weights: torch.Tensor) -> tuple[Rows, torch.Tensor]:
    """``rows`` and ``weights`` holding only their own memory, for a state kept past its call: a call
    that shared forwards copies its rows out of the calls' stacked cache, and its logits and weights
    out of the tensors of the steps they shared."""
    if rows.cache is not None:
        rows.cache.settle()
    logits = owned(rows.logits)
    return (rows if logits is rows.logits else replace(rows, logits=logits)), owned(weights)


def _call_body(start: Callable[[], Decoding], state: Callable, stream: "weakref.ref[Stream]"):
    """A stream's call as a coroutine (see :meth:`Stream._body`)."""
    decoding = start()
    held = stream()
    if held is not None:
        held._decoding = decoding
        decoding.whole = held._whole
    del held

    def resumed():
        if (held := stream()) is not None:
            held._resumed()

    decoding.resumed = resumed
    yield from decoding.run()
    if (held := stream()) is not None:
        held._ended = state(decoding.result(), True)


class AsyncStream:
    """:class:`Stream` for ``async for``; the model's engine runs the steps."""

    def __init__(self, stream: Stream):
        self._stream = stream
        self._keep_yielded = True

    def __aiter__(self) -> "AsyncStream":
        return self

    def _no_snapshots(self) -> "AsyncStream":
        """This stream for a consumer that drops the state of a stream it cancels (the server): what
        it has seen is not taken at each step (a copy of every row), so a cancel while the next
        piece is on its way leaves that piece's step in ``state``."""
        self._keep_yielded = False
        return self

    async def __anext__(self) -> Any:
        done, item = await self._stream.astep(keep_yielded=self._keep_yielded)
        if done:
            raise StopAsyncIteration
        return item

    async def run(self) -> SequenceState:
        """The remaining steps, their pieces unread; the final state (as ``acall`` gives it).

        Cancelled, the generation stops after the step under way, and ``state`` keeps it."""
        return await self._stream.arun()

    async def aclose(self) -> None:
        stream = self._stream
        if stream._engine is not None and stream._call is not None and stream._final is None:
            await stream._aclosed()
        else:
            stream.close()

    @property
    def state(self) -> SequenceState:
        return self._stream.state

    @property
    def first_piece_at(self) -> float | None:
        """The ``time.monotonic()`` of the first piece, once it came (see :class:`Stream`)."""
        return self._stream.first_piece_at
