"""continuous equals HF ``generate`` on real architectures with real tokenizers, sliding windows included.

Each model is a tiny random-weight one (``support.models.build_arch``) with its
family's real tokenizer. The reference is always HF ``generate`` (greedy) started from
the same token ids, on one row alone, with no cache of ours: so every operation that
keeps a cache (generate, add text, slice, add a state, batches with holes, JSON) is
checked against a from-scratch computation. Sliding windows (12 tokens) are much
shorter than the contexts, so they matter.
"""

import pytest
import torch
from support.models import ARCHITECTURES, build_arch, hf_greedy, real_tokenizer
from support.states import real_ids

from continuous import PromptLookup, continuous, generate, models

pytestmark = pytest.mark.slow  # make test-fast leaves it out

PROMPT = "Le café coûte 3 € — très cher! Naïve façade, 東京 and emoji 🙂 in a longer sentence here."


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch(request):
    hf, tok = build_arch(request.param)
    return request.param, hf, tok, models.transformers(hf, tok)


def assert_continues_like_hf(hf, gen, state, n=6):
    """Continuing ``state`` greedily gives, for every row, what HF generate gives from its ids."""
    out = gen(state, max_tokens=n)
    for r in range(out.token_ids.shape[0]):
        before = real_ids(state, r)
        after = real_ids(out, r)
        assert after[: len(before)] == before
        assert after[len(before):] == hf_greedy(hf, before, n), f"row {r}"
    return out


def test_generate_add_slice_sum(arch):
    name, hf, tok, model = arch
    gen = continuous(generate.text(model))
    s = gen(PROMPT, max_tokens=8)
    assert real_ids(s)[len(tok(PROMPT).input_ids):] == hf_greedy(hf, tok(PROMPT).input_ids, 8)
    s = assert_continues_like_hf(hf, gen, s + " Ça coûte 5 € à Zürich — 東京 🙂.")
    s = assert_continues_like_hf(hf, gen, s[: len(str(s)) - 7])
    other = gen("Other text: ", max_tokens=3)
    assert_continues_like_hf(hf, gen, s + other)


def test_batch_of_unequal_prompts_with_holes(arch):
    name, hf, tok, model = arch
    gen = continuous(generate.text(model))
    s = gen([PROMPT, "Short one.", PROMPT[:40]], max_tokens=4)
    for r, p in enumerate([PROMPT, "Short one.", PROMPT[:40]]):
        ids = tok(p).input_ids
        assert real_ids(s, r)[len(ids):] == hf_greedy(hf, ids, 4)
    # Texts of different lengths per row leave holes between a row's old and new tokens.
    s = s + ["A much longer addition to the first row, past the window.", "x", " é"]
    s = assert_continues_like_hf(hf, gen, s)
    # A slice that cuts rows at different places, then a row selection.
    assert_continues_like_hf(hf, gen, s[:, :30])
    assert_continues_like_hf(hf, gen, s[1:, :])


def test_a_row_that_ends_in_a_hole_continues_exactly(arch):
    """Text added to one row only leaves the other ending in a hole, longer than the window:
    its next token makes the hole interior, and windows must then count positions."""
    name, hf, tok, model = arch
    gen = continuous(generate.text(model))
    s = gen([PROMPT, PROMPT[:30]], max_tokens=2)
    s = s + [" and then a much longer addition to the first row only, well past the window.", ""]
    assert_continues_like_hf(hf, gen, s)
    # The same through forced runs (several tokens per row and step).
    json_gen = continuous(generate.json(model, {"type": "string", "enum": ["a long forced literal value"]}))
    out = json_gen(s)
    assert_continues_like_hf(hf, gen, out)


def test_json_equals_hf_generate_under_the_same_constraint(arch):
    name, hf, tok, model = arch
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 6}},
              "required": ["n", "s"]}
    schema["additionalProperties"] = False
    gen = continuous(generate.json(model, schema, whitespace_pattern=""))
    prompt = PROMPT + "\nJSON: "
    ids = tok(prompt).input_ids
    s = gen(prompt, max_tokens=24)
    constraint = gen.generator.constraint
    eos = tok.eos_token_id
    words = torch.zeros((model.vocab_size + 31) // 32, dtype=torch.int32)

    def allowed(batch_id, input_ids):
        matcher = constraint.matcher()
        for t in input_ids[len(ids):].tolist():
            matcher.advance(t)
        matcher.fill(words)
        bits = (words.long().unsqueeze(-1) >> torch.arange(32)) & 1
        return bits.view(-1).nonzero().flatten().tolist()

    ref = hf_greedy(hf, ids, 24, prefix_allowed_tokens_fn=allowed)
    assert real_ids(s)[len(ids):] == [t for t in ref if t != eos]


def test_unsupported_state_is_refused():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mamba", hidden_size=16, num_hidden_layers=1, vocab_size=64, state_size=4)
    hf = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="cannot be cropped"):
        models.transformers(hf, real_tokenizer("gpt-2"))


@pytest.mark.parametrize("name", ["mistral", "phi3"])  # byte-fallback vocabularies: "\n" is <0x0A>
def test_a_prompt_ending_in_a_byte_token_keeps_its_text_out_of_the_value(name):
    hf, tok = build_arch(name)
    model = models.transformers(hf, tok)
    prompt = "Capital:\n"
    assert tok.convert_ids_to_tokens(tok(prompt).input_ids)[-1] == "<0x0A>"
    choice = continuous(generate.choice(model, ["Lima", "Paris"]))(prompt)
    assert choice.value in ("Lima", "Paris") and str(choice) == prompt + choice.value
    stopped = continuous(generate.text(model))(prompt, max_tokens=6, stop_at="\n")
    assert str(stopped).startswith(prompt)
    assert stopped.value  # the prompt's "\n" is no stop string of this call
    nothing = continuous(generate.text(model))(prompt, max_tokens=0)
    assert str(nothing) == prompt and nothing._rows.ends == (tuple(e for _, e in tok(prompt, return_offsets_mapping=True)["offset_mapping"]),)


def test_json_completes_on_a_random_model_with_the_default_whitespace(arch):
    """Free whitespace lets a weak model write blank space until max_tokens; bounded, it finishes."""
    name, hf, tok, model = arch
    schema = {"type": "object", "properties": {"city": {"enum": ["Lima", "Oslo", "Kyoto"]},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "ok": {"type": "boolean"}},
              "required": ["city", "age", "ok"], "additionalProperties": False}
    state = continuous(generate.json(model, schema))(PROMPT + "\nJSON: ", max_tokens=60)
    assert state.finish_reasons == ["eos"] and set(state.value) == {"city", "age", "ok"}




def test_prompt_lookup_leaves_greedy_outputs_as_they_are(arch):
    """Drafts copied from a context that repeats itself (each row's prompt, the model's own
    continuation, the prompt again), checked past the sliding window, in a batch whose rows
    keep different numbers of drafted tokens (holes between their tokens)."""
    name, hf, tok, model = arch
    text = continuous(generate.text(model))
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 40}, "n": {"type": "integer"}},
              "required": ["s", "n"], "additionalProperties": False}
    prompts = [PROMPT[:48], '{"s":"Naïve façade, 東京 🙂","n":12} ']  # JSON to copy into JSON
    drafted = {}
    for kind, made, rows in (("text", generate.text(model), prompts),
                             ("json", generate.json(model, schema, whitespace_pattern=""), prompts[::-1])):
        gen = continuous(made)
        for p in (rows[:1], rows):
            context = text(p, max_tokens=16) + p
            plain = gen(context, max_tokens=30)
            model.stats.reset()
            state = gen(context, max_tokens=30, speculate=PromptLookup(k=4, ngram=2))
            assert list(state) == list(plain)
            for r in range(len(p)):
                assert real_ids(state, r) == real_ids(plain, r)
            drafted[kind, len(p)] = model.stats.tokens_drafted
            # The state goes on as the one made without drafts.
            assert real_ids(text(state, max_tokens=6)) == real_ids(text(plain, max_tokens=6))
    # Free text drafts only where the random model repeats its own continuation (the
    # architectures with a sliding window do); JSON always copies from its prompt.
    assert drafted["json", 1] > 0 and drafted["json", 2] > 0
