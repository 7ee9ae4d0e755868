"""continuous.hf.logits_processor: a generator's constraint inside transformers' generate."""

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from continuous import continuous, generate, hf


def hf_generate(hf_model, tokenizer, prompt, processor, **kwargs):
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), logits_processor=processor,
                                max_new_tokens=40, pad_token_id=tokenizer.eos_token_id, **kwargs)
    return [tokenizer.decode(row[ids.shape[1]:], skip_special_tokens=True) for row in out]


@pytest.mark.parametrize("make", [
    lambda m: generate.choice(m, ["cat", "category", "dog"]),
    lambda m: generate.regex(m, r"[0-9]{2}-[a-c]{3}"),
    lambda m: generate.json(m, {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9,
                                "minimum": 0}}, "required": ["n"], "additionalProperties": False}, whitespace="compact"),
])
def test_greedy_generate_gives_what_the_library_gives(model, hf_model, tokenizer, make):
    gen = make(model)
    (text,) = hf_generate(hf_model, tokenizer, "Answer:", hf.logits_processor(gen), do_sample=False)
    assert text == str(continuous(gen)("Answer:"))[len("Answer:"):]


def test_sampling_and_beams_stay_in_the_language(model, hf_model, tokenizer):
    gen = generate.regex(model, r"(yes|no|maybe)!")
    sampled = hf_generate(hf_model, tokenizer, "Q?", hf.logits_processor(gen), do_sample=True,
                          num_return_sequences=4, top_k=0)
    beams = hf_generate(hf_model, tokenizer, "Q?", hf.logits_processor(gen), num_beams=3,
                        num_return_sequences=3, do_sample=False)
    for text in sampled + beams:
        assert text in ("yes!", "no!", "maybe!")


def test_it_is_a_processor_alone_or_in_a_list(model, hf_model, tokenizer):
    gen = generate.choice(model, ["red", "green"])
    processor = hf.logits_processor(continuous(gen))
    assert isinstance(processor, LogitsProcessor)
    listed = hf_generate(hf_model, tokenizer, "Color:", LogitsProcessorList([hf.logits_processor(gen)]))
    assert hf_generate(hf_model, tokenizer, "Color:", processor) == listed
    assert listed[0] in ("red", "green")


def test_it_takes_only_generators():
    with pytest.raises(TypeError, match="continuous.generate"):
        hf.logits_processor("json")


@pytest.mark.parametrize("make, reason", [
    (lambda m: generate.json(m, {"type": "array", "items": {"enum": [2, 45, 74]}, "uniqueItems": True}),
     "uniqueItems"),
    (lambda m: generate.regex(m, r"[a-z]{3}", ban=["abc"]), "ban="),
])
def test_generators_that_rewind_are_refused_with_the_reason(model, make, reason):
    gen = make(model)
    for given in (gen, continuous(gen)):
        with pytest.raises(ValueError, match=f"(?s){reason}.*rewinding.*continuous"):
            hf.logits_processor(given)
