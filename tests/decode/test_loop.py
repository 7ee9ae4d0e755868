"""The decoding loop's edge cases: beams left without tokens, streaming beams, empty rows, overlapped steps."""

import pytest
import torch
from support.models import build_llama, real_tokenizer

from continuous import continuous, generate, models, samplers
from continuous.models.transformers import Transformers


def test_a_beam_left_without_allowed_tokens_has_no_value_and_can_be_continued(model):
    state = continuous(generate.choice(model, ["yes", "no"], samplers.beam_search(3)))("Answer: ")
    values = state.value
    assert sorted(v for v in values if v is not None) == ["no", "yes"]
    dead = values.index(None)
    assert state.weights[0, dead] == -torch.inf
    assert torch.isfinite(state.weights[0, [r for r in range(3) if r != dead]]).all()
    assert list(state)[dead] == "Answer: "  # not a copy of a finished beam
    # After text is added, any generator continues it, the dead row included.
    more = state + " then"
    out = continuous(generate.text(model, samplers.multinomial(3)))(more, max_tokens=3, seed=1)
    assert len(list(out)[dead]) > len(list(more)[dead])
    assert out.value[dead] is not None
    out = continuous(generate.regex(model, "[a-c]{2}", samplers.beam_search(3)))(more)
    assert all(v is not None and len(v) == 2 for v in out.value)


def test_streaming_beams_is_refused_clearly(model):
    gen = continuous(generate.text(model, samplers.beam_search(2)))
    with pytest.raises(ValueError, match="beam search cannot stream"):
        gen.stream("Hi", max_tokens=2)
    assert len(gen("Hi", max_tokens=2).value) == 2  # calling it works


def test_an_empty_row_without_bos_is_a_clear_error():
    tok = real_tokenizer("llama-bpe")  # adds no BOS
    hf = build_llama(tok, "tiny", max_position_embeddings=64, vocab_size=len(tok))
    gen = continuous(generate.text(models.transformers(hf, tok)))
    with pytest.raises(ValueError, match=r"empty sequence \(row 1\)"):
        gen(["Hello", ""], max_tokens=2)
    assert len(gen(["Hello", "x"], max_tokens=2).value) == 2


class _EndsRowAt(Transformers):
    """A backend whose row ``row`` is made to choose EOS once its cache holds ``at`` slots."""

    def __init__(self, hf, tok, row, at):
        super().__init__(hf, tok)
        self.row, self.at = row, at

    def _run_one(self, request, compiled=True):  # every forward, of the engine's steps or direct
        logits, out = super()._run_one(request, compiled)
        if out.length == self.at and request.input_ids.shape[0] > self.row:
            logits = logits.clone()
            logits[self.row, -1, self.tokenizer.eos_token_id] = 1e4
        return logits, out


@pytest.mark.parametrize("case", ["free", "fork-eos", "stop", "ban", "stream", "regex", "regex-heal"])
def test_overlapped_steps_give_the_same_states(hf_model, tokenizer, case):
    """Queuing each step before the host reads the ids (CUDA's default) changes nothing but speed."""
    prompt = "Once upon a time"
    n_prompt = len(tokenizer(prompt).input_ids)
    plain, overlapped = (_EndsRowAt(hf_model, tokenizer, 1, n_prompt + 4) for _ in range(2))
    overlapped.overlap = True
    ref = continuous(generate.text(plain))(prompt, max_tokens=12)
    generated = ref.value
    kwargs = {"max_tokens": 12}
    if case == "stop":
        kwargs["stop_at"] = generated[3:6]
    states = {}
    for name, m in (("plain", plain), ("overlapped", overlapped)):
        sampler = samplers.multinomial(3) if case == "fork-eos" else samplers.greedy()
        ban = [generated[4:9]] if case == "ban" else None
        gen = continuous(generate.text(m, sampler, ban=ban))
        if case.startswith("regex"):  # forced runs (fast-forward) give queued steps back
            gen = continuous(generate.regex(m, r"(ab|[0-9]{2})-forced-run-[a-z]{3}\.", sampler))
            kwargs.update(heal=case == "regex-heal", max_tokens=60)
        if case == "stream":
            pieces = list(gen.stream(prompt, **kwargs))
            states[name] = "".join(pieces)
            continue
        state = gen(prompt, seed=3, **kwargs)
        states[name] = state
    a, b = states["plain"], states["overlapped"]
    if case == "stream":
        assert a == b and a
        return
    assert list(a) == list(b) and a.value == b.value
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.attention_mask, b.attention_mask)
    assert torch.allclose(a.weights, b.weights, atol=1e-4)
    if case == "fork-eos":
        assert len(b.value[1]) < len(b.value[0])  # row 1 ended early, on EOS
    # Discarded steps are counted as rewound and gave their slots back: the result's
    # buffer is the prompt's, and continuing it gives the same as without overlap.
    assert overlapped.stats.tokens_rewound >= plain.stats.tokens_rewound
    if case in ("fork-eos", "stop", "regex"):  # a step was queued, then given back
        assert overlapped.stats.tokens_rewound > plain.stats.tokens_rewound
    assert b.kv_cache._buffer.filled == b.kv_cache.length  # still the tip: it appends in place
    more_a = continuous(generate.text(plain, sampler))(a + " and", max_tokens=5, seed=4)
    more_b = continuous(generate.text(overlapped, sampler))(b + " and", max_tokens=5, seed=4)
    assert list(more_a) == list(more_b)
    assert overlapped.stats.forward_calls - plain.stats.forward_calls <= 2


def test_a_consumer_of_the_whole_answer_hears_of_the_first_piece_and_the_last_only(model):
    """A call whose consumer takes the whole answer skips handing out the pieces in between
    (the first says when the first token came); its result is the streamed call's."""
    from continuous.decode import Decoding, Options
    from continuous.layout import Rows

    def decoding(whole):
        d = Decoding(model, Rows.from_texts(model.tokenizer, ["Once upon", "A list: 1,"]), torch.zeros(2), None,
                     Options(max_tokens=9, stop_at=["\n"]))
        d.whole = whole
        return d

    streamed, whole = decoding(False), decoding(True)
    pieces, events = list(streamed), list(whole)
    assert len(pieces) > 2 and 1 <= len(events) <= 2
    assert events[0] == pieces[0]
    got, want = whole.result(), streamed.result()
    assert got.texts == want.texts == ["".join(p[r] or "" for p in pieces) for r in range(2)]
    assert got.rows.token_ids.tolist() == want.rows.token_ids.tolist()
    assert whole.result().texts == got.texts  # read again once over: the same


def test_a_stream_read_in_part_then_whole_ends_as_the_call_alone(model):
    gen, prompt = continuous(generate.text(model)), "Once upon"
    stream = gen.stream(prompt, max_tokens=8)
    first = next(stream)
    final = stream.run()
    assert str(final) == str(gen(prompt, max_tokens=8))
    assert str(final).startswith(prompt + first)
