"""models.llamacpp: greedy outputs equal models.transformers' on the same F32 weights, for every
generator kind, call option and state operation; sequences are shared, bounded and freed."""

import asyncio
import gc
import importlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.extras import need

need("llama_cpp", "llamacpp")  # a skip with the reason; a failure where CI expects the extra

import torch  # noqa: E402
from hypothesis import assume, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from pydantic import BaseModel  # noqa: E402
from support.llamacpp import f32_gguf  # noqa: E402
from support.models import build_llama, cache_dir, real_tokenizer  # noqa: E402
from support.states import real_ids  # noqa: E402
from support.streams import drained  # noqa: E402

from continuous import PromptLookup, Think, chat, continuous, generate, models, samplers  # noqa: E402

SQL = r"""
start: "SELECT " columns " FROM " NAME ";"
columns: "*" | NAME (", " NAME)*
NAME: /[a-z]{1,8}/
"""


class City(BaseModel):
    name: str
    population: int


class Capital(BaseModel):
    city: str
    country: str


@pytest.fixture(scope="module")
def folder():
    """A tiny random Llama with GPT-2's vocabulary (llama.cpp's converter knows its pre-tokenizer)."""
    path = cache_dir() / "llamacpp-tiny-gpt2"
    if not (path / "config.json").exists():
        tokenizer = real_tokenizer("gpt-2")
        build_llama(tokenizer, "tiny", seed=0, max_position_embeddings=512).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gguf(folder):
    return f32_gguf(folder)


@pytest.fixture(scope="module")
def lm(gguf):
    """The GGUF file on llama.cpp, its tokenizer read from the file, an F32 KV cache."""
    return models.llamacpp(gguf, n_ctx=2048, n_threads=1, type_k="f32", type_v="f32")


@pytest.fixture(scope="module")
def tm(folder):
    return models.transformers(folder)


def _banned(model, prompt: str) -> list[str]:
    """Words that a free greedy run writes after ``prompt``: banning them makes the run rewind."""
    free = continuous(generate.text(model))(prompt, max_tokens=24).value
    return [w for w in free.split() if len(w) >= 3][:3]


def _call(model, name: str):
    """A call of one generator kind or call option, ``(generator, prompt, kwargs)``, greedy."""
    text = continuous(generate.text(model))
    calls = {
        "text": lambda: (text, "User: tell me about Lima.\nAssistant:", dict(max_tokens=24)),
        "stop": lambda: (text, "User: count to ten.\nAssistant:", dict(max_tokens=30, stop_at=["e", "."])),
        "batch": lambda: (text, ["Rome is", "Kyoto is a city of"], dict(max_tokens=12)),
        "logprobs": lambda: (text, "Once upon a time", dict(max_tokens=10, logprobs=3)),
        "heal": lambda: (text, "The capital of Fra", dict(max_tokens=8, heal=True)),
        "penalty": lambda: (text, "Hello", dict(max_tokens=12, repetition_penalty=1.3)),
        "json": lambda: (continuous(generate.json(model, City)), "A city as JSON:", dict(max_tokens=30)),
        "choice": lambda: (continuous(generate.choice(model, ["yes", "no", "maybe later"], scores=True)),
                           "Answer:", {}),
        "regex": lambda: (continuous(generate.regex(model, r"[0-9]{3}-[a-z]{2,4}")), "Code:", {}),
        "cfg": lambda: (continuous(generate.cfg(model, SQL)), "Query:", dict(max_tokens=30)),
        "format": lambda: (continuous(generate.format(model, bool)), "True or false:", {}),
        "ban": lambda: (continuous(generate.text(model, ban=_banned(model, "Write:"))), "Write:",
                        dict(max_tokens=24)),
        "beams": lambda: (continuous(generate.text(model, samplers.beam_search(3))), "Pick:", dict(max_tokens=8)),
        "samples": lambda: (continuous(generate.text(model, samplers.multinomial(3))), "Pick:",
                            dict(max_tokens=8, seed=5)),
        "think": lambda: (continuous(generate.text(model, think=Think(open="<t>", close="</t>", budget=5))), "Q:",
                          dict(max_tokens=12)),
        "tools": lambda: (continuous(generate.tools(model, [City], tool_choice="required")), "Call:",
                          dict(max_tokens=30)),
        "lookup": lambda: (text, "Order #12: 3 x lamp to Lima. Order #13: 3 x lamp to Lima. Order #14: 3 x",
                           dict(max_tokens=16, speculate=PromptLookup(k=4, ngram=2))),
        "speculate": lambda: (text, "one two three", dict(max_tokens=16, speculate=model)),  # itself drafts
    }
    return calls[name]()


def _same(a, b, tol=1e-3):
    """Two states hold the same tokens, text, reasons, weights, log-probabilities and choice scores
    (the padded layouts may differ: a transformers cache squeezes holes out, llama.cpp's never has any)."""
    assert [real_ids(a, r) for r in range(len(a))] == [real_ids(b, r) for r in range(len(b))]
    assert a.cached_lengths.tolist() == b.cached_lengths.tolist()
    assert list(a) == list(b)
    assert a.finish_reasons == b.finish_reasons
    torch.testing.assert_close(a.weights, b.weights, atol=tol, rtol=tol)
    if a.logprobs is not None:
        for ra, rb in zip(a.logprobs, b.logprobs):
            assert [t for t, _, _ in ra] == [t for t, _, _ in rb]
            assert [lp for _, lp, _ in ra] == pytest.approx([lp for _, lp, _ in rb], abs=tol)
    if a.choice_scores is not None:
        for sa, sb in zip(a.choice_scores, b.choice_scores):
            assert sa == pytest.approx(sb, abs=tol)


COUNTED = ("tokens_forwarded", "forward_calls", "tokens_rewound", "tokens_drafted", "tokens_accepted")


GREEDY = ["text", "stop", "batch", "logprobs", "heal", "penalty", "json", "choice", "regex", "cfg", "format",
          "ban", "beams", "think", "tools", "lookup", "speculate"]


@pytest.mark.parametrize("name", GREEDY)
def test_every_generator_kind_and_option_matches_transformers(lm, tm, name):
    results = []
    for model in (lm, tm):
        gen, prompt, kwargs = _call(model, name)
        model.stats.reset()
        results.append((gen(prompt, **kwargs), model.stats.snapshot()))
    (a, stats_a), (b, stats_b) = results
    _same(a, b)
    assert {k: stats_a[k] for k in COUNTED} == {k: stats_b[k] for k in COUNTED}
    if name == "ban":
        assert stats_a["tokens_rewound"] > 0  # the bans did rewind
    if name == "speculate":  # the model drafting for itself is always right
        assert stats_a["tokens_accepted"] == stats_a["tokens_drafted"] > 0


def _continue_both(lm, tm, build, n=6):
    """``build(model)`` makes a state on each model; continuing it greedily gives the same tokens on
    both, and on llama.cpp the same as continuing it with its cache dropped."""
    outs = []
    for model in (lm, tm):
        gen = continuous(generate.text(model))
        state = build(model, gen)
        outs.append(gen(state, max_tokens=n))
        if model is lm:
            _same(outs[-1], gen(state.drop_cache(), max_tokens=n))
    _same(*outs)


def _near_tie(model, build, n=6, margin=1e-3) -> bool:
    """Whether greedy decoding on ``model`` after ``build`` meets two tokens within ``margin`` of
    each other: two backends' rounding (a random model's logits) may then break the tie either way."""
    gen = continuous(generate.text(model))
    out = gen(build(model, gen), max_tokens=n, logprobs=2)
    return any(len(alts) > 1 and alts[0][1] - alts[1][1] < margin for row in out.logprobs for _, _, alts in row)


@given(cut=st.integers(1, 60), suffix=st.sampled_from(["", " and Bob", "!", "12"]))
@example(cut=18, suffix="12")  # the two best tokens 2e-4 apart: llama.cpp and transformers pick differently
@settings(max_examples=8, deadline=None)
def test_a_slice_plus_text_continues_as_on_transformers(lm, tm, cut, suffix):
    def build(m, gen):
        return gen("User: Tell me about Omar.\nAssistant:", max_tokens=12)[:cut] + suffix

    assume(not _near_tie(tm, build))
    _continue_both(lm, tm, build)


@pytest.mark.parametrize("build", [
    lambda m, gen: gen(["Rome is", "Kyoto is a city of"], max_tokens=8)[1, :20],
    lambda m, gen: gen(["Rome is", "Kyoto is a city of"], max_tokens=8)[:, :11] + [" one", " two and"],
    lambda m, gen: gen("Alice:", max_tokens=5) + gen("Bob said", max_tokens=4),
    lambda m, gen: gen(gen("Alice:", max_tokens=5) + " then", max_tokens=5)[:14],
    pytest.param(lambda m, gen: "Before " + gen("Alice:", max_tokens=5),
                 marks=pytest.mark.filterwarnings("ignore:text put before")),
], ids=["row-slice", "batch-cut-add", "state-plus-state", "continued-then-cut", "text-before"])
def test_state_operations_continue_as_on_transformers(lm, tm, build):
    _continue_both(lm, tm, build)


def test_a_state_continued_twice_gives_what_it_would_alone_in_any_order(lm):
    gen = continuous(generate.text(lm))
    base = gen("Order #12:", max_tokens=6)
    first = gen(base, max_tokens=6)  # appended in place to base's sequence
    second = gen(base + " more", max_tokens=6)  # base's sequence went on: a forked one
    again = gen(first[: len(str(base)) + 3], max_tokens=6)  # a crop of the newest one, continued
    assert real_ids(first) == real_ids(gen(base.drop_cache(), max_tokens=6))
    assert real_ids(second) == real_ids(gen((base + " more").drop_cache(), max_tokens=6))
    assert real_ids(again) == real_ids(gen(first[: len(str(base)) + 3].drop_cache(), max_tokens=6))
    assert real_ids(gen(base, max_tokens=6)) == real_ids(first)


def test_forked_samples_continue_as_their_recomputation(lm):
    prompt = continuous(generate.text(lm))("Pick one:", max_tokens=4)
    gen = continuous(generate.text(lm, samplers.multinomial(3)))
    forked = gen(prompt, max_tokens=8, seed=5)
    assert forked.num_samples == 3
    _same(forked, gen(prompt.drop_cache(), max_tokens=8, seed=5))
    text = continuous(generate.text(lm, samplers.multinomial(3)))
    _same(text(forked, max_tokens=4, seed=1), text(forked.drop_cache(), max_tokens=4, seed=1))


def test_streams_yield_the_text_of_the_call(lm):
    gen = continuous(generate.text(lm))
    whole = gen("Once upon a time", max_tokens=12)
    stream = gen.stream("Once upon a time", max_tokens=12)
    assert "Once upon a time" + "".join(stream) == str(whole)
    _same(stream.state, whole)


def test_concurrent_calls_share_decodes_and_each_equals_the_call_alone(lm):
    names = ["text", "stop", "batch", "logprobs", "json", "choice", "regex", "samples"]
    calls = [_call(lm, name) for name in names]
    lm.stats.reset()
    alone = [gen(prompt, **kwargs) for gen, prompt, kwargs in calls]
    sequential = lm.stats.snapshot()
    lm.stats.reset()
    with ThreadPoolExecutor(len(calls)) as pool:
        together = list(pool.map(lambda c: c[0](c[1], **c[2]), calls))
    shared = lm.stats.snapshot()
    for a, b in zip(alone, together):
        _same(a, b)
    assert shared["tokens_forwarded"] == sequential["tokens_forwarded"]
    assert shared["forward_calls"] < sequential["forward_calls"] / 2


def test_async_calls_and_streams_equal_the_calls_alone(lm):
    calls = [_call(lm, name) for name in ("text", "batch", "json", "samples")]
    alone = [gen(prompt, **kwargs) for gen, prompt, kwargs in calls]

    async def main():
        return await asyncio.gather(*[drained(g, p, k) if i % 2 else g.acall(p, **k)
                                      for i, (g, p, k) in enumerate(calls)])

    for a, b in zip(alone, asyncio.run(main())):
        _same(a, b)


# ------------------------------------------------------------------ sequences and limits
def test_sequences_are_shared_by_continuations_and_freed_with_their_states(gguf, lm):
    model = models.llamacpp(gguf, n_ctx=512, n_threads=1, n_seq_max=8, tokenizer=lm.tokenizer)
    gen = continuous(generate.text(model))
    assert model.sequences_in_use() == 0
    three = gen(["Alice", "Bob is", "Eve"], max_tokens=4)
    assert model.sequences_in_use() == 3
    longer = gen(three, max_tokens=4)  # three's rows end where their sequences do: appended in place
    assert model.sequences_in_use() == 3
    other = gen(three, max_tokens=2)  # three's sequences went on with longer: forked
    assert model.sequences_in_use() == 6
    row = longer[1, :]  # a row's selection keeps its sequence
    del three, longer, other
    gc.collect()
    assert model.sequences_in_use() == 1
    assert real_ids(gen(row, max_tokens=3)) == real_ids(gen(row.drop_cache(), max_tokens=3))
    del row
    gc.collect()
    assert model.sequences_in_use() == 0


def test_more_states_than_sequences_is_refused_clearly_and_leaves_the_states_usable(gguf, lm):
    model = models.llamacpp(gguf, n_ctx=512, n_threads=1, n_seq_max=4, tokenizer=lm.tokenizer)
    gen = continuous(generate.text(model))
    prompts = ["a", "b", "c", "d"]
    held = gen(prompts, max_tokens=2)
    with pytest.raises(RuntimeError, match="n_seq_max"):
        gen("another one", max_tokens=2)
    went_on = gen(held, max_tokens=2)  # appends to held's own sequences: needs no other
    continued = [real_ids(went_on, r) for r in range(4)]
    del held, went_on
    gc.collect()
    assert len(real_ids(gen("another one", max_tokens=2))) > 2
    again = gen(prompts, max_tokens=4)
    assert [real_ids(again, r) for r in range(4)] == continued


def test_running_out_of_sequences_inside_a_call_fails_it_and_leaves_its_input_usable(gguf, lm):
    model = models.llamacpp(gguf, n_ctx=512, n_threads=1, n_seq_max=3, tokenizer=lm.tokenizer)
    gen = continuous(generate.text(model))
    base = gen("Pick one:", max_tokens=2)
    with pytest.raises(RuntimeError, match="n_seq_max"):  # four beams need four sequences
        continuous(generate.text(model, samplers.beam_search(4)))(base, max_tokens=4)
    assert real_ids(gen(base, max_tokens=3)) == real_ids(gen(base.drop_cache(), max_tokens=3))


def test_a_full_context_is_refused_clearly_and_freed_cells_are_used_again(gguf, lm):
    model = models.llamacpp(gguf, n_ctx=256, n_threads=1, tokenizer=lm.tokenizer)
    gen = continuous(generate.text(model))
    kept = [gen("Story " * 50, max_tokens=1) for _ in range(4)]  # distinct prompts of 100 tokens: no sharing
    # The premise: llama.cpp kept the context asked for (it rounds up to 256), so these fill it.
    assert model.n_ctx < sum(len(real_ids(s)) for s in kept) + 100, f"n_ctx is {model.n_ctx}"
    with pytest.raises(RuntimeError, match="n_ctx"):
        gen(["Word " * 60, "Other " * 60], max_tokens=1)
    del kept
    gc.collect()
    assert len(real_ids(gen(["Word " * 60, "Other " * 60], max_tokens=1))) > 60


def test_a_step_wider_than_n_batch_is_decoded_in_parts_with_the_same_result(gguf, lm):
    narrow = models.llamacpp(gguf, n_ctx=2048, n_threads=1, type_k="f32", type_v="f32", n_batch=16, n_ubatch=16,
                             tokenizer=lm.tokenizer)
    prompts = ["User: Tell me about Omar and his cat.\nAssistant:", "Order #1234: 3 x lamp shipped to Lima on"]
    outs = []
    for model in (narrow, lm):
        model.stats.reset()
        outs.append((continuous(generate.json(model, City))(prompts, max_tokens=12), model.stats.snapshot()))
    _same(outs[0][0], outs[1][0])
    assert outs[0][1] == outs[1][1]  # a decode in parts is one forward


# ------------------------------------------------------------------ loading
def test_the_tokenizer_read_from_the_gguf_file_is_the_models_own(lm, tm):
    texts = ["Hello world!", "It's 2024-05-17:\n\n1. Don't  panic", "Ünïcödé — 你好 🦙"]
    for text in texts:
        assert lm.tokenizer(text)["input_ids"] == tm.tokenizer(text)["input_ids"]
    assert lm.eos_token_ids == tm.eos_token_ids


def test_bad_arguments_are_refused_clearly(gguf, tmp_path, tm):
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        models.llamacpp(tmp_path / "missing.gguf")
    with pytest.raises(TypeError, match="unknown option 'n_context'"):
        models.llamacpp(gguf, n_context=512)
    with pytest.raises(TypeError, match="loaded tokenizer"):
        models.llamacpp(gguf, tokenizer=str(tmp_path))
    with pytest.raises(ValueError, match="KV cache type"):
        models.llamacpp(gguf, type_k="f33")
    with pytest.raises(ValueError, match="between 1 and 256"):
        models.llamacpp(gguf, n_seq_max=300)
    with pytest.raises(ValueError, match="at least n_seq_max"):  # llama.cpp would abort the process
        models.llamacpp(gguf, n_outputs_max=8, n_seq_max=16)


def test_loading_leaves_the_cpu_to_llama_cpp(gguf):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        models.llamacpp(gguf, n_ctx=256, n_threads=1)
        assert torch.get_num_threads() == 1  # torch's host work does not fight llama.cpp's threads
    finally:
        torch.set_num_threads(threads)


def test_importing_continuous_does_not_load_llama_cpp():
    code = "import sys, continuous; from continuous import models; print('llama_cpp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_without_llama_cpp_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(ImportError, match=r"continuous\[llamacpp\]"):
        importlib.import_module("continuous.models.llamacpp")._llama_cpp()


# ------------------------------------------------------------------ SmolLM2-135M-Instruct
#: Weights (sums of log-probabilities) agree to this on a trained model: llama.cpp's kernels sum
#: in another order than torch's, about 1e-3 a token.
REAL_TOL = 5e-2

@pytest.fixture(scope="module")
def smol():
    """SmolLM2 on transformers (its F32 folder) and on llama.cpp (the same weights, converted by llama.cpp)."""
    from support.real import smollm2

    folder = smollm2()
    return models.llamacpp(f32_gguf(folder), n_threads=1, type_k="f32", type_v="f32"), models.transformers(folder)


def _ask(model, question):
    return chat.prompt(model, [{"role": "user", "content": question}])


@pytest.mark.slow
@pytest.mark.real
@pytest.mark.parametrize("kind", ["text", "json", "choice", "regex"])
def test_smollm2_at_f32_gives_the_greedy_outputs_of_transformers(smol, kind):
    make = {
        "text": lambda m: (continuous(generate.text(m)), dict(max_tokens=24)),
        "json": lambda m: (continuous(generate.json(m, City)), dict(max_tokens=40)),
        "choice": lambda m: (continuous(generate.choice(m, ["Paris", "Lyon", "Berlin"])), {}),
        "regex": lambda m: (continuous(generate.regex(m, r"[A-Z][a-z]+, [0-9]{4}")), {}),
    }[kind]
    outs = []
    for model in smol:
        gen, kwargs = make(model)
        outs.append(gen(_ask(model, "Which city is the capital of France, and how many people live there?"),
                        **kwargs))
    _same(*outs, tol=REAL_TOL)


@pytest.mark.slow
@pytest.mark.real
def test_smollm2_at_f32_continues_slices_and_turns_as_transformers(smol):
    outs = []
    for model in smol:
        gen = continuous(generate.text(model))
        first = gen(_ask(model, "Name three fruits."), max_tokens=20)
        cut = first[: len(str(first)) - 7]
        turn = gen(cut, max_tokens=6) + chat.turn(model, "user", "And three vegetables?")
        outs.append(gen(turn, max_tokens=16))
        if model is smol[0]:
            _same(outs[-1], gen(turn.drop_cache(), max_tokens=16), tol=REAL_TOL)
    _same(*outs, tol=REAL_TOL)


@pytest.mark.slow
@pytest.mark.real
def test_smollm2_q4_1_reads_its_tokenizer_from_the_file_and_writes_valid_json():
    from support.real import smollm2, smollm2_gguf
    from transformers import AutoTokenizer

    q4 = models.llamacpp(smollm2_gguf(), n_threads=1)
    reference = AutoTokenizer.from_pretrained(smollm2())
    for text in ["Order #1234: 3 x lamp\n\n1. ok", "It's 2024-05-17 — déjà vu?"]:
        assert q4.tokenizer(text)["input_ids"] == reference(text)["input_ids"]
    # the tokenizer's EOS (<|im_end|>) first, then the other tokens llama.cpp ends on (<|endoftext|>)
    assert q4.eos_token_ids[0] == reference.eos_token_id and reference.convert_tokens_to_ids("<|endoftext|>") in \
        q4.eos_token_ids
    state = continuous(generate.json(q4, Capital))(_ask(q4, "What is the capital of France? Answer as JSON."),
                                                   max_tokens=60)
    assert isinstance(state.value, Capital) and state.finish_reasons == ["eos"]


@pytest.mark.slow
@pytest.mark.real
def test_a_tokenizer_the_loader_reads_wrongly_is_refused(monkeypatch):
    from support.real import smollm2_gguf

    module = importlib.import_module("continuous.models.llamacpp")
    monkeypatch.setattr(module, "_restore_pre_tokenizer", lambda tokenizer, pre: None)  # SmolLM2's digits lost
    with pytest.raises(ValueError, match="splits text unlike llama.cpp"):
        models.llamacpp(smollm2_gguf(), n_threads=1)
