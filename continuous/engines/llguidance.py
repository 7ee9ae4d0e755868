"""The llguidance engine: JSON Schema, regular expressions and Lark grammars.

llguidance compiles a grammar lazily (an Earley parser over a lexer whose token masks
are computed on demand), so a schema compiles in milliseconds and its keywords are
enforced exactly where the engine implements them (integer and number bounds, string
lengths, ``not`` is refused rather than ignored). The tokenizer conversion, which takes
about a second on a 128k vocabulary, is done once per HF tokenizer; compiled grammars
(validated grammar text) are kept in a bounded LRU.

Examples
--------
>>> from continuous.engines import llguidance as llg
>>> c = llg.json_schema({"type": "integer", "minimum": 3}, tokenizer)   # doctest: +SKIP
>>> m = c.matcher(); m.fill(row); m.advance(token_id)                    # doctest: +SKIP
"""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import torch

from . import bits, caches, schema
from .formats import DATE, DATE_TIME
from .jsonwatch import Checks, JsonWatch
from .lark import lexemes
from .relax import normalize, relaxation

__all__ = ["json_schema", "regex", "lark", "lltokenizer", "LLGuidanceConstraint", "LLGuidanceMatcher"]

#: Relaxations tried before a JSON schema is refused (each drops what one refusal names).
_RELAXATIONS = 32
#: Runs of forced tokens (16 each) followed at build time to tell a grammar that never
#: ends, such as a rule with no way out (an empty language).
_ENDLESS = 64


def lltokenizer(tokenizer) -> "llguidance.LLTokenizer":
    """The ``LLTokenizer`` of a fast HF tokenizer, built once per tokenizer object."""
    return caches.derived(tokenizer, "llguidance tokenizer", lambda: _convert(tokenizer))


def _convert(tokenizer) -> "llguidance.LLTokenizer":
    if tokenizer.eos_token_id is None:
        raise ValueError("constrained generation needs a tokenizer with an EOS token")
    try:
        # n_vocab = len(tokenizer) counts added tokens, which the model's logits cover too.
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    except ValueError as exc:
        raise ValueError(f"llguidance needs a fast (Rust) HF tokenizer: {exc}") from exc


class LLGuidanceMatcher:
    """One row's position in an llguidance grammar (wraps an ``LLMatcher``)."""

    __slots__ = ("_m", "_words", "_eos", "_ended")

    def __init__(self, matcher: "llguidance.LLMatcher", words: int, eos_token_id: int, ended: bool = False):
        self._m = matcher
        self._words = words
        self._eos = eos_token_id
        # EOS is kept here, not given to llguidance: an LLMatcher that has stopped (its
        # grammar can take nothing more) takes EOS without counting it, so rollback(1)
        # would then undo the token before it.
        self._ended = ended

    def _write(self, row: torch.Tensor) -> None:
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), 4 * self._words)

    def fill(self, bitmask: torch.Tensor) -> None:
        """Write the allowed next tokens (EOS exactly when accepting) into an int32 row."""
        if self._ended:
            bits.fill_row(bitmask, self._words, lambda row: row.zero_())
            return
        bits.fill_row(bitmask, self._words, self._write)
        if self._m.is_error():
            raise RuntimeError(f"llguidance matcher failed: {_reason(self._m.get_error())}")

    @staticmethod
    def fill_many(matchers: list["LLGuidanceMatcher"], out: torch.Tensor) -> None:
        """:meth:`fill` of each matcher into its row of ``out`` (``[n, words]`` int32, CPU,
        contiguous), all at once on llguidance's thread pool with the GIL released."""
        words = matchers[0]._words
        if any(m._words != words for m in matchers):  # several tokenizers: one pass each
            for w in {m._words for m in matchers}:
                rows = [i for i, m in enumerate(matchers) if m._words == w]
                block = out.new_empty((len(rows), out.shape[1]))
                LLGuidanceMatcher.fill_many([matchers[i] for i in rows], block)
                out[rows] = block
            return
        live = [(m._m, i) for i, m in enumerate(matchers) if not m._ended]
        scratch = out if out.shape[1] == words else torch.empty((len(matchers), words), dtype=torch.int32)
        if len(live) < len(matchers):
            scratch.zero_()  # an ended row allows nothing
        if live:
            _executor().unsafe_compute_mask_ptr(live, scratch.data_ptr(), 4 * words, len(matchers))
        for m, _ in live:
            if m.is_error():
                raise RuntimeError(f"llguidance matcher failed: {_reason(m.get_error())}")
        if scratch is not out:  # ids past the tokenizer's vocabulary are never allowed
            out[:, :words] = scratch
            out[:, words:] = 0

    def advance(self, token_id: int) -> None:
        """Consume a token; ``ValueError`` (state unchanged) when the grammar forbids it."""
        if self._ended:
            raise ValueError(f"token {token_id} after EOS")
        if token_id == self._eos:
            if not self._m.is_accepting():
                raise ValueError("EOS before the text matches")
            self._ended = True
            return
        # An LLMatcher that consumes a forbidden token enters an error state it never
        # leaves, so check first: validate_tokens does not change the state.
        if self._m.validate_tokens([token_id]) != 1:
            raise ValueError(f"token {token_id} is not allowed here")
        if not self._m.consume_token(token_id):
            raise RuntimeError(f"llguidance matcher failed: {_reason(self._m.get_error())}")

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` tokens (EOS included)."""
        if n < 0:
            raise ValueError("cannot roll back a negative number of tokens")
        if n and self._ended:
            self._ended = False
            n -= 1
        if n and not self._m.rollback(n):
            raise ValueError(f"cannot roll back {n} tokens: {self._m.get_error()}")

    def forced(self) -> list[int]:
        """Tokens the grammar forces next, as llguidance tokenizes the forced text (may be empty).

        llguidance re-tokenizes the forced bytes canonically and holds back a tail that a
        later byte could merge with, so the tokens are those a whole-text tokenization gives.
        """
        return [] if self._ended else list(self._m.compute_ff_tokens())

    def accepting(self) -> bool:
        return self._m.is_accepting()

    def done(self) -> bool:
        if self._ended or self._m.is_stopped():
            return True
        if not self._m.is_accepting():
            return False
        # Accepting and nothing but EOS allowed: the decoder must stop here too.
        row = torch.empty(self._words, dtype=torch.int32)
        self._write(row)
        bits.clear(row, self._eos)
        return not bool(row.any())

    def copy(self) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(self._m.deep_copy(), self._words, self._eos, self._ended)


_EXECUTOR: list = []


def _executor() -> "llguidance.LLExecutor":
    """The process's llguidance thread pool (made on first use)."""
    if not _EXECUTOR:
        _EXECUTOR.append(llguidance.LLExecutor())
    return _EXECUTOR[0]


class LLGuidanceConstraint:
    """A grammar validated and compiled for one tokenizer; makes :class:`LLGuidanceMatcher` s.

    Building it computes the first mask, so that a grammar the engine cannot serve (a
    lexer too large) fails here, and refuses a grammar whose language is empty.

    Raises
    ------
    ValueError
        When llguidance refuses the grammar (an unsupported keyword, an invalid regex,
        a Lark syntax error), with the engine's reason naming the keyword or place, or
        when no text can ever complete it.
    """

    engine = "llguidance"

    def __init__(self, grammar: str, tokenizer, description: str):
        self.grammar = grammar
        self.tokenizer = lltokenizer(tokenizer)
        self.eos_token_id = tokenizer.eos_token_id
        self.words = bits.words(self.tokenizer.vocab_size)
        # Building the matcher validates the grammar; validate_grammar_with_warnings first
        # would compile it twice (half of the compile time on MaskBench).
        self._start = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if self._start.is_error():
            raise ValueError(f"llguidance refuses {description}: {_reason(self._start.get_error())}")
        #: Non-fatal notes from the compiler (for instance a string format it does not check).
        self.warnings = list(self._start.get_grammar_warnings())
        #: Keywords of a JSON schema the grammar does not enforce (enforced while decoding).
        self.dropped: frozenset[str] = frozenset()
        self._schema = None
        self._checks = None  # built at the first watch: a validator is costly to build
        self._check_language(description)

    def _check_language(self, description: str) -> None:
        first = self.matcher()
        row = torch.zeros(self.words, dtype=torch.int32)
        try:
            first.fill(row)
        except RuntimeError as exc:
            raise ValueError(f"llguidance cannot serve {description}: {exc}") from None
        # A language is empty when nothing is allowed at the start, or when the text the
        # grammar forces goes on and on without ever being complete (a rule with no end).
        # (Following such a run, llguidance gives up in an error: "too many items".)
        walk, endless = first._m.deep_copy(), True
        for _ in range(_ENDLESS):
            forced = walk.compute_ff_tokens()[:16]
            if walk.is_error():
                break
            if walk.is_accepting() or not forced:
                endless = False
                break
            walk.consume_tokens(forced)
            if walk.is_error():
                break
        if endless:
            row.zero_()
        if not row.any() and not first.accepting():
            raise ValueError(f"{description} matches no text: no sequence of tokens can complete it")

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._start.deep_copy(), self.words, self.eos_token_id)

    def watch(self) -> JsonWatch | None:
        """A row's watch over what the grammar dropped of a JSON schema (``None`` when nothing was)."""
        if not self.dropped:
            return None
        if self._checks is None:
            self._checks = Checks(self._schema, set(self.dropped))
        return JsonWatch(self._checks)


def _reason(error: str) -> str:
    """The engine's error without its debugging dump (parser state, grammar text)."""
    return error.split("\n<state>")[0].split("\n<grammar>")[0].strip()


def _compiled(kind: str, source: str, options: str, tokenizer, make_grammar) -> LLGuidanceConstraint:
    def build():
        try:
            grammar = make_grammar()
        except ValueError as exc:
            raise ValueError(f"llguidance refuses this {kind}: {exc}") from exc
        return LLGuidanceConstraint(grammar, tokenizer, f"this {kind}")

    return caches.compiled(tokenizer, ("llguidance", kind, source, options), build)


def json_schema(document, tokenizer, whitespace_pattern: str | None = None) -> LLGuidanceConstraint:
    """A JSON document valid against a schema.

    A schema the engine refuses only over keywords that narrow its language (``not``,
    ``if``/``then``/``else``, ``uniqueItems``, ``contains``, ``dependencies``,
    ``propertyNames``, overlapping ``oneOf``, min/max properties) or over formats it does
    not know is compiled without them; they are then enforced while decoding (the
    constraint's :meth:`~LLGuidanceConstraint.watch`), and ``generate.json`` checks them
    on ``value``. ``constraint.dropped`` names them.

    Parameters
    ----------
    document
        A JSON schema as ``dict`` (or ``bool``) or JSON ``str``; one that says it is draft
        7 (or 4 or 6), or says no ``$schema`` and uses a form only draft 7 has, is read as
        draft 7. The ``date`` and ``date-time`` formats are held to real calendar dates and
        RFC 3339 times by a pattern.
    tokenizer
        A fast HF tokenizer with an EOS token.
    whitespace_pattern
        Regex of the whitespace allowed between JSON tokens. ``None`` keeps llguidance's
        default, any JSON whitespace (compact documents included).

    Raises
    ------
    ValueError
        When the schema is not JSON, or llguidance refuses it over something that cannot
        be enforced another way, with its reason.
    """
    doc = normalize(schema.document(document))
    options = {} if whitespace_pattern is None else {"whitespace_pattern": whitespace_pattern}
    key = ("llguidance", "JSON schema", json.dumps(doc), json.dumps(options))
    return caches.compiled(tokenizer, key, lambda: _relaxed(doc, options, tokenizer))


def _relaxed(doc, options: dict, tokenizer) -> LLGuidanceConstraint:
    """The constraint of ``doc``, relaxed until the engine takes it (see :mod:`.relax`)."""
    relaxed, dropped = doc, set()
    for _ in range(_RELAXATIONS):
        text = json.dumps(_dated(relaxed))
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=options or None)
            built = LLGuidanceConstraint(grammar, tokenizer, "this JSON schema")
            break
        except ValueError as exc:
            step = relaxation(relaxed, str(exc))
            if step is None:
                raise
            relaxed, more, extra = step
            dropped, options = dropped | more, {**options, **extra}
    else:
        raise ValueError("llguidance refuses this JSON schema: too many keywords to relax")
    built.dropped, built._schema = frozenset(dropped), doc
    return built


def _dated(document):
    """The schema with ``date`` and ``date-time`` strings held to real calendar dates by a pattern."""
    def rewrite(node):
        kind = node.get("format")
        if node.get("type") == "string" and kind in ("date", "date-time") and "pattern" not in node:
            node = {k: v for k, v in node.items() if k != "format"}
            node["pattern"] = "^" + (DATE if kind == "date" else DATE_TIME) + "$"
        return node

    return schema.rewritten(document, rewrite)


def regex(pattern: str, tokenizer) -> LLGuidanceConstraint:
    """Text that matches a regular expression in full (Rust ``regex`` syntax, no lookaround).

    Raises
    ------
    ValueError
        When the pattern is invalid (one that ends with a lone backslash too, which the
        engine would drop silently) or matches no text.
    """
    if (len(pattern) - len(pattern.rstrip("\\"))) % 2:
        raise ValueError(f"invalid regex {pattern!r}: it ends with an escape (a backslash) that escapes nothing")
    return _compiled("regex", pattern, "", tokenizer, lambda: llguidance.LLMatcher.grammar_from_regex(pattern))


def lark(grammar: str, tokenizer) -> LLGuidanceConstraint:
    """Text in the language of a Lark grammar (llguidance's dialect; the start rule is ``start``).

    A rule that is an alternation of string literals is compiled as one terminal
    (:func:`~continuous.engines.lark.lexemes`), so that its size does not matter.

    Raises
    ------
    ValueError
        When llguidance refuses the grammar, or a rule has more alternatives than its
        parser takes at once, with the reason.
    """
    return _compiled("Lark grammar", grammar, "", tokenizer,
                     lambda: llguidance.LLMatcher.grammar_from_lark(lexemes(grammar)))
