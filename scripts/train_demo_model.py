"""Train the small model that ships with continuous (``continuous/assets/demo-model``).

No model hub can be reached where this project is built, and a model with random
weights only babbles, so the demo, the examples and the docs use a toy trained here:
a Llama-architecture model of a few million parameters and a byte-level BPE tokenizer,
both trained on a synthetic corpus of short dialogues about people, pets, orders and
cities, and of the same facts as JSON records. It knows these formats and nothing
else: a toy for demos and tests, not a model to use.

Everything is seeded: the same command gives the same corpus, tokenizer and (on the
same machine and torch build) the same weights. It runs on 2 CPU cores in about 10
minutes::

    python scripts/train_demo_model.py              # writes continuous/assets/demo-model/
    python scripts/train_demo_model.py --steps 20   # a smoke run (into --out)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent.parent / "continuous" / "assets" / "demo-model"

#: The dialogues' form as a chat template: one ``Role: content`` line per message (a space
#: after the colon unless the content starts with one, as the model writes its answers),
#: then ``Assistant:`` for the answer. Only ``User`` and ``Assistant`` were trained.
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] | capitalize }}:"
                 "{% if not (message['content'] or '').startswith((' ', '\\n')) %} {% endif %}"
                 "{{ message['content'] or '' }}{{ '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}Assistant:{% endif %}")

# ---------------------------------------------------------------------------- facts
# (name, pronoun) so that sentences about a person read naturally.
PEOPLE = [
    ("Alice", "she"), ("Bob", "he"), ("Chloé", "she"), ("Dmitri", "he"), ("Eve", "she"),
    ("Farah", "she"), ("Gustavo", "he"), ("Hana", "she"), ("Ivan", "he"), ("Júlia", "she"),
    ("Kenji", "he"), ("Lena", "she"), ("Marco", "he"), ("Nadia", "she"), ("Omar", "he"),
    ("Priya", "she"), ("Quentin", "he"), ("Rosa", "she"), ("Sven", "he"), ("Zoë", "she"),
    ("Tariq", "he"), ("Maya", "she"), ("Liam", "he"), ("Ines", "she"), ("Yusuf", "he"),
    ("Sofia", "she"), ("Pablo", "he"), ("Amara", "she"), ("Felix", "he"), ("Mei", "she"),
]
CITIES = {  # city: (country, what it is known for)
    "Paris": ("France", "the Eiffel Tower"), "Lagos": ("Nigeria", "its busy markets"),
    "Kyoto": ("Japan", "its old temples"), "Lima": ("Peru", "its food"),
    "Oslo": ("Norway", "its fjord"), "Cairo": ("Egypt", "the pyramids"),
    "Quito": ("Ecuador", "its volcanoes"), "Perth": ("Australia", "its beaches"),
    "Dakar": ("Senegal", "its music"), "Porto": ("Portugal", "its bridges"),
    "Berlin": ("Germany", "its museums"), "Seoul": ("South Korea", "its palaces"),
    "Toronto": ("Canada", "its tall tower"), "Nairobi": ("Kenya", "its national park"),
    "Mumbai": ("India", "its film industry"), "Madrid": ("Spain", "its art galleries"),
    "Hanoi": ("Vietnam", "its lakes"), "Dublin": ("Ireland", "its old pubs"),
}
PETS = {  # species: (food, what it does)
    "cat": ("fish", "purrs"), "dog": ("meat", "barks"), "parrot": ("seeds", "talks"),
    "rabbit": ("carrots", "hops"), "turtle": ("lettuce", "swims"), "hamster": ("grain", "runs in its wheel"),
    "goldfish": ("flakes", "swims"), "horse": ("hay", "gallops"),
}
PET_NAMES = ["Milo", "Luna", "Rex", "Bella", "Coco", "Kiwi", "Max", "Nala", "Pepper", "Simba",
             "Tom", "Daisy", "Oscar", "Ziggy", "Biscuit", "Olive"]
ITEMS = {"book": 12, "lamp": 35, "chair": 80, "kettle": 25, "bicycle": 240, "guitar": 150,
         "umbrella": 15, "camera": 300, "backpack": 45, "clock": 30}
STATUSES = ["pending", "shipped", "delivered"]


def _json(record: dict) -> str:
    # The separators are json.dumps' defaults, which outlines_core's JSON regex allows.
    return json.dumps(record, ensure_ascii=False)


# ---------------------------------------------------------------------------- records
def _person(rng: random.Random) -> dict:
    name, pronoun = rng.choice(PEOPLE)
    return {"name": name, "pronoun": pronoun, "age": rng.randint(18, 90), "city": rng.choice(list(CITIES)),
            "pet": rng.choice(list(PETS)), "pet_name": rng.choice(PET_NAMES)}


def _order(rng: random.Random) -> dict:
    return {"id": rng.randint(1000, 9999), "item": rng.choice(list(ITEMS)), "quantity": rng.randint(1, 9),
            "city": rng.choice(list(CITIES)), "status": rng.choice(STATUSES)}


def person_json(p: dict) -> str:
    return _json({"name": p["name"], "age": p["age"], "city": p["city"], "pet": p["pet"]})


def pet_json(p: dict) -> str:
    return _json({"name": p["pet_name"], "species": p["pet"], "age": p["age"] % 15 + 1, "owner": p["name"]})


def order_json(o: dict) -> str:
    return _json(o)


def city_json(city: str) -> str:
    return _json({"name": city, "country": CITIES[city][0]})


def person_text(p: dict, rng: random.Random) -> str:
    n, a, c, pet, they = p["name"], p["age"], p["city"], p["pet"], p["pronoun"].capitalize()
    return rng.choice([
        f"{n} is {a} years old, lives in {c} and has a {pet}.",
        f"{n} lives in {c} with a {pet}. {they} is {a}.",
        f"Meet {n}: {a} years old, from {c}, owner of a {pet}.",
        f"{n} ({a}) has a {pet} and lives in {c}.",
        f"In {c} lives {n}, who is {a} and has a {pet}.",
    ])


def pet_text(p: dict, rng: random.Random) -> str:
    n, s, o, a = p["pet_name"], p["pet"], p["name"], p["age"] % 15 + 1
    return rng.choice([
        f"{n} is a {a}-year-old {s} owned by {o}.",
        f"{o} has a {s} called {n}, aged {a}.",
        f"{n}, {o}'s {s}, is {a} years old.",
    ])


def order_text(o: dict, rng: random.Random) -> str:
    i, q, it, c, s = o["id"], o["quantity"], o["item"], o["city"], o["status"]
    return rng.choice([
        f"Order #{i}: {q} x {it} to {c}, {s}.",
        f"Order #{i} for {q} x {it} is {s} (delivery to {c}).",
        f"We have {s} order #{i}: {q} x {it}, going to {c}.",
    ])


def city_text(city: str, rng: random.Random) -> str:
    country, fact = CITIES[city]
    return rng.choice([f"{city} is a city in {country}.", f"{city}, in {country}, is known for {fact}."])


def json_document(rng: random.Random) -> str:
    """A record described from nothing, or extracted from a sentence that states it."""
    kind = rng.choice(["person", "person", "pet", "order", "city"])
    p, o, city = _person(rng), _order(rng), rng.choice(list(CITIES))
    record = {"person": person_json(p), "pet": pet_json(p), "order": order_json(o), "city": city_json(city)}[kind]
    if rng.random() < 0.4:
        article = "an" if kind == "order" else "a"
        return f"Describe {article} {kind} as JSON:\n{record}"
    text = {"person": person_text, "pet": pet_text, "order": order_text}.get(kind)
    sentence = text(p if kind != "order" else o, rng) if text else city_text(city, rng)
    return f"Text: {sentence}\nJSON:\n{record}"


# ---------------------------------------------------------------------------- dialogues
def dialogue(rng: random.Random) -> str:
    """A conversation of 2 to 7 turns in which the user may state facts and ask about them later.

    Questions about the user come only after the user said the answer, so the model
    learns to look back in the conversation (which is what the KV cache keeps).
    """
    me = _person(rng)
    name, age, city, pet, pet_name = me["name"], me["age"], me["city"], me["pet"], me["pet_name"]
    known: set[str] = set()
    asked: set[str] = set()
    turns: list[tuple[str, str]] = []

    intro = rng.random()
    if intro < 0.45:
        turns.append((f"Hi, I am {name}, I am {age} and I live in {city}.",
                      f"Nice to meet you, {name}! {city} is a lovely city in {CITIES[city][0]}."))
        known |= {"name", "age", "city"}
    elif intro < 0.7:
        turns.append((f"Hi, I am {name}.", f"Hello {name}! How can I help you today?"))
        known.add("name")
    elif intro < 0.8:
        turns.append(("Hello!", "Hello! How can I help you today?"))

    def other_person() -> str:
        p = _person(rng)
        return rng.choice([f"Tell me about {p['name']}.", f"Who is {p['name']}?"]), \
            f"{p['name']} is {p['age']} years old, lives in {p['city']} and has a {p['pet']}."

    def where_city():
        c = rng.choice(list(CITIES))
        return f"Where is {c}?", f"{c} is a city in {CITIES[c][0]}."

    def known_for():
        c = rng.choice(list(CITIES))
        return f"What is {c} known for?", f"{c} is known for {CITIES[c][1]}."

    def is_in():
        c = rng.choice(list(CITIES))
        country = CITIES[c][0] if rng.random() < 0.5 else rng.choice([v[0] for v in CITIES.values()])
        if country == CITIES[c][0]:
            return f"Is {c} in {country}?", f"Yes, {c} is in {country}."
        return f"Is {c} in {country}?", f"No, {c} is in {CITIES[c][0]}."

    def pet_food():
        s = rng.choice(list(PETS))
        return f"What does a {s} eat?", f"A {s} eats {PETS[s][0]}."

    def order_status():
        o = _order(rng)
        return f"Where is my order #{o['id']}?", \
            f"Order #{o['id']} ({o['quantity']} x {o['item']}) is {o['status']}, going to {o['city']}."

    def price():
        item = rng.choice(list(ITEMS))
        return f"How much is a {item}?", f"A {item} costs {ITEMS[item]} dollars."

    def tell_city():
        known.add("city")
        return f"I live in {city}.", f"{city} is a lovely city in {CITIES[city][0]}, known for {CITIES[city][1]}."

    def tell_pet():
        known.add("pet")
        return f"I have a {pet} called {pet_name}.", f"{pet_name} is a nice name for a {pet}!"

    def tell_age():
        known.add("age")
        return f"I am {age} years old.", f"Thank you, I will remember that you are {age}."

    def ask(fact: str):
        asked.add(fact)
        return {
            "name": ("What is my name?", f"Your name is {name}."),
            "age": ("How old am I?", f"You are {age} years old."),
            "city": ("Where do I live?", f"You live in {city}."),
            "pet": (f"What is my {pet}'s name?", f"Your {pet} is called {pet_name}."),
        }[fact]

    def as_json():
        return "Describe me as JSON.", "\n" + person_json(me)

    general = [other_person, where_city, known_for, is_in, pet_food, order_status, price]
    for _ in range(rng.randint(1, 6)):
        options = list(general)
        if "city" not in known:
            options.append(tell_city)
        if "pet" not in known:
            options += [tell_pet, tell_pet]
        if "age" not in known:
            options.append(tell_age)
        options += [lambda f=f: ask(f) for f in sorted(known - asked)] * 2
        if known >= {"name", "age", "city", "pet"}:
            options += [as_json] * 3
        turns.append(rng.choice(options)())
    if "name" in known and rng.random() < 0.3:
        turns.append(("Thanks!", f"You are welcome, {name}!"))
    return "\n".join(f"User: {u}\nAssistant:{'' if a.startswith(chr(10)) else ' '}{a}" for u, a in turns)


def corpus(n_documents: int, seed: int) -> list[str]:
    """The training documents: 55% dialogues, 45% JSON records (with or without their sentence)."""
    rng = random.Random(seed)
    return [dialogue(rng) if rng.random() < 0.55 else json_document(rng) for _ in range(n_documents)]


# ---------------------------------------------------------------------------- training
def train_tokenizer(documents: list[str], vocab_size: int):
    """A byte-level BPE whose encodings start with ``<s>``; ``</s>`` ends every document.

    Words carry their leading space (`` Omar``), as in GPT-2 and Llama tokenizers: a
    copy from earlier in the context then finds the token before the word informative,
    which is how a small model learns to repeat a name or a city in a conversation.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(documents, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   model_max_length=1024)


def batches(documents: list[str], tokenizer, seq_len: int, batch_size: int, seed: int):
    """Endless shuffled batches of ``<s> document </s>`` packed into rows of ``seq_len`` tokens."""
    ids = tokenizer(documents, add_special_tokens=True)["input_ids"]
    stream = torch.tensor([t for doc in ids for t in doc + [tokenizer.eos_token_id]], dtype=torch.long)
    rows = stream[: len(stream) // seq_len * seq_len].view(-1, seq_len)
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(rows), generator=g)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield rows[order[i:i + batch_size]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--documents", type=int, default=36000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    documents = corpus(args.documents, args.seed)
    tokenizer = train_tokenizer(documents, vocab_size=2048)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, intermediate_size=704, max_position_embeddings=1024,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    data = batches(documents, tokenizer, seq_len=256, batch_size=16, seed=args.seed)
    print(f"corpus {len(documents)} documents, vocab {len(tokenizer)}, {params / 1e6:.2f}M parameters "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:  # linear warmup, then cosine down to a tenth
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    model.train()
    t_train, recent = time.perf_counter(), []
    for step in range(args.steps):
        batch = next(data)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        recent = (recent + [loss.item()])[-20:]
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {sum(recent) / len(recent):.3f}  "
                  f"{time.perf_counter() - t_train:.0f}s", flush=True)
    train_time = time.perf_counter() - t_train

    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    # fp16 halves the file; callers load it with dtype=torch.float32 for CPU speed and accuracy.
    model.half().save_pretrained(args.out, safe_serialization=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(args.out)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"saved to {args.out}: {size / 1e6:.1f} MB, {params / 1e6:.2f}M parameters, "
          f"trained {train_time:.0f}s ({time.process_time() / 60:.1f} CPU-minutes in all), "
          f"final loss {sum(recent) / len(recent):.3f}")


if __name__ == "__main__":
    main()
