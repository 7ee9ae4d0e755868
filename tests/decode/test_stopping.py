"""Why rows stop: every EOS id HF generate stops on, stop strings, lengths, the context, bans."""

import copy
import warnings

import pytest
import regex
import torch
from support.models import build_llama

from continuous import BanExhausted, ContextWarning, continuous, generate, models


def _new_ids(state, prompt_ids):
    ids = state.token_ids[0][state.attention_mask[0].bool()].tolist()
    return ids[len(prompt_ids):]


def test_every_eos_of_the_generation_config_stops_like_hf_generate(tokenizer):
    hf = build_llama(tokenizer, "tiny", seed=0, max_position_embeddings=512)
    prompt = "User: Tell me about Omar.\nAssistant:"
    ids = tokenizer(prompt).input_ids
    free = continuous(generate.text(models.transformers(hf, tokenizer)))(prompt, max_tokens=12)
    end_of_turn = _new_ids(free, ids)[4]  # a token the model chooses early: made an end-of-turn id
    chat = copy.deepcopy(hf)
    chat.generation_config.eos_token_id = [tokenizer.eos_token_id, end_of_turn]
    with torch.no_grad():
        ref = chat.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                            pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
    assert ref[-1] == end_of_turn and len(ref) < 12  # HF stopped there
    model = models.transformers(chat, tokenizer)
    assert set(model.eos_token_ids) == {tokenizer.eos_token_id, end_of_turn}
    state = continuous(generate.text(model))(prompt, max_tokens=12)
    assert _new_ids(state, ids) == ref[:-1]  # the end-of-turn id is not part of the text, as EOS
    assert state.finish_reasons == ["eos"]
    # Under a constraint it is allowed wherever EOS is.
    state = continuous(generate.regex(model, r"[ a-zA-Z.]{1,40}"))(prompt, max_tokens=12)
    assert state.finish_reasons[0] in ("eos", "length")


def test_finish_reasons_per_row(model):
    gen = continuous(generate.text(model))
    assert gen("Hello", max_tokens=2).finish_reasons == ["length"]
    free = gen("User: Tell me about Omar.\nAssistant:", max_tokens=8).value
    stop = free.split()[1][:3]
    both = gen(["User: Tell me about Omar.\nAssistant:", "Hello"], max_tokens=8, stop_at=stop)
    assert both.finish_reasons[0] == "stop"
    assert both[0, :].finish_reasons == ["stop"]  # selecting rows keeps theirs
    assert continuous(generate.choice(model, ["yes", "no"]))("Answer:").finish_reasons == ["eos"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BanExhausted)
        banned = continuous(generate.choice(model, ["alpha", "alps"], ban=[regex.compile("al")]))("Answer:")
    assert banned.finish_reasons == ["ban_exhausted"]
    assert gen("Hello", max_tokens=0).finish_reasons == ["length"]


def test_a_prompt_near_the_end_of_the_context_warns(model):
    words = ["Omar"]
    while len(model.tokenizer(" ".join(words)).input_ids) < model.max_length - 8:
        words.append("Omar")
    prompt = " ".join(words)
    gen = continuous(generate.text(model))
    with pytest.warns(ContextWarning, match="context"):
        state = gen(prompt)
    assert state.finish_reasons == ["context"]
    assert state._rows.attention_mask.sum() <= model.max_length
    with warnings.catch_warnings():
        warnings.simplefilter("error", ContextWarning)
        assert gen(prompt, max_tokens=2).finish_reasons == ["length"]  # max_tokens came first
