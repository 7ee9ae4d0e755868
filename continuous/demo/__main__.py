"""``make demo``: the whole idea, on a trained instruct model or the small model that ships with the package.

Run it with ``python -m continuous.demo`` (the shipped toy) or ``--model PATH`` (a trained
instruct model with a chat template: ``make demo`` fetches SmolLM2-135M-Instruct once). Every claim in the transcript comes with the
figure that proves it, read from ``model.stats`` (the tokens sent through the model);
where it helps, the same step is run again without the cache to show that the output
is the same and what recomputing would have cost. The model is a 3.5M-parameter toy
trained on synthetic dialogues and JSON records (``scripts/train_demo_model.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import threading
import time

from pydantic import BaseModel, Field


class Person(BaseModel):
    # Bounds are part of the constraint: whatever the model does, the JSON ends.
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    city: str = Field(max_length=20)
    pet: str = Field(max_length=20)


def _forwarded(model, fn):
    """Run ``fn()``; return its result and the tokens it sent through the model."""
    before = model.stats.tokens_forwarded
    result = fn()
    return result, model.stats.tokens_forwarded - before


@contextlib.contextmanager
def progress(message: str):
    """Show ``message`` with a spinner (or, off a terminal, once) while the block runs."""
    start = time.perf_counter()
    done = threading.Event()

    def spin():
        for frame in itertools.cycle("|/-\\"):
            if done.wait(0.1):
                break
            print(f"\r{message} {frame}", end="", flush=True)

    spinner = threading.Thread(target=spin, daemon=True) if sys.stdout.isatty() else None
    if spinner is None:
        print(f"{message} ...", end="", flush=True)
    else:
        spinner.start()
    try:
        yield
    finally:
        done.set()
        elapsed = f"done in {time.perf_counter() - start:.1f}s"
        if spinner is not None:
            spinner.join()
            print(f"\r{message}: {elapsed}", flush=True)
        else:
            print(f" {elapsed}", flush=True)


def load_model():
    """The shipped demo model in fp32 (stored in fp16: fp32 is faster and exact on a CPU)."""
    import torch
    import transformers

    from continuous import models
    from continuous.assets import DEMO_MODEL

    transformers.utils.logging.disable_progress_bar()  # our own indicator instead
    return models.transformers(DEMO_MODEL, dtype=torch.float32)


def section(title: str) -> None:
    print(f"\n{title}\n{'-' * len(title)}")


def json_generation(model) -> None:
    from continuous import continuous, generate

    section("1. JSON under a pydantic schema")
    gen = continuous(generate.json(model, Person))
    prompt = "Describe a person as JSON:\n"
    state, spent = _forwarded(model, lambda: gen(prompt))
    person = state.value
    print(f"prompt : {prompt!r}")
    print(f"output : {str(state)[len(prompt):]}")
    print(f"value  : {person!r}")
    print(f"         a {type(person).__name__} instance: person.age + 1 = {person.age + 1}")
    print(f"forwarded {spent} tokens: the prompt, then one per generated token")


CHAT = [
    "Hi, I am Omar, I am 34 and I live in Lima.",
    "I have a dog called Rex.",
    "What is Lima known for?",
    "Where do I live?",
    "What is my dog's name?",
]


def conversation(model):
    """Five turns on one state; each turn is also recomputed from scratch to compare."""
    from continuous import continuous, generate

    section("2. A conversation: each turn forwards only its new tokens")
    chat = continuous(generate.text(model))
    state, rows = None, []
    for user in CHAT:
        message = f"User: {user}\nAssistant:"
        prompt = message if state is None else state + message
        state, spent = _forwarded(model, lambda: chat(prompt, stop_at="\n", max_tokens=40))
        # What a stateless API pays: the whole history again, for the same answer.
        uncached = prompt if isinstance(prompt, str) else prompt.drop_cache()
        fresh, full = _forwarded(model, lambda: chat(uncached, stop_at="\n", max_tokens=40))
        print(f"User: {user}\nAssistant:{state.value}")
        rows.append((spent, full, str(fresh) == str(state)))
    print(f"\n{'turn':>4} {'forwarded':>10} {'recomputing the history':>24} {'same answer':>12}")
    for i, (spent, full, same) in enumerate(rows, 1):
        print(f"{i:>4} {spent:>10} {full:>24} {'yes' if same else 'NO':>12}")
    kept, redone = sum(r[0] for r in rows), sum(r[1] for r in rows)
    print(f"total {kept:>9} {redone:>24}    ({redone / kept:.1f}x more without the cache)")
    return state


def slicing(model, state) -> None:
    from continuous import continuous, generate

    section("3. Slice an answer and continue from the slice: the cache is cropped, not recomputed")
    chat = continuous(generate.text(model))
    text = str(state).rstrip("\n")
    cut = text.rindex(" ")  # before the last word of the last answer
    head = state[:cut]
    print(f"state[:{cut}] ends with {text[cut - 40:cut]!r}")
    print(f"tokens of the slice: {int(head.attention_mask.sum())}, of which the cache still holds "
          f"{int(head.cached_lengths[0])}")
    again, spent = _forwarded(model, lambda: chat(head, stop_at="\n", max_tokens=20))
    fresh, full = _forwarded(model, lambda: chat(head.drop_cache(), stop_at="\n", max_tokens=20))
    print(f"continued: ...{text[cut - 20:cut]!r} + {again.value!r} "
          f"(the answer it had before: {'yes' if str(again) == str(state) else 'no'})")
    print(f"forwarded {spent} tokens (the cut boundary and the new ones); from scratch: {full}; "
          f"same text: {'yes' if str(again) == str(fresh) else 'NO'}")


def forking(model) -> None:
    from continuous import continuous, generate, samplers

    section("4. Fork 4 samples from one prefix: the prefix is forwarded once")
    prompt = "Describe a person as JSON:\n"
    n_prompt = len(model.tokenizer(prompt).input_ids)
    gen = continuous(generate.json(model, Person, sampler=samplers.multinomial(4)))
    state, spent = _forwarded(model, lambda: gen(prompt, seed=0))
    for person, weight in zip(state.value, state.weights[0].tolist()):
        print(f"  {person!r:68} log-prob {weight:6.2f}")
    best = int(state.weights[0].argmax())
    print(f"forwarded {spent} tokens: the {n_prompt}-token prompt once, then the samples' tokens "
          f"(4 separate calls: {spent + 3 * n_prompt})")
    print(f"most likely sample: #{best}; state[{best}, :] selects it, cache kept "
          f"({int(state[best, :].cached_lengths[0])} tokens)")


def beam_search(model) -> None:
    from continuous import continuous, generate, samplers

    section("5. Beam search keeps the 3 most likely answers")
    prompt = "User: Tell me about Alice.\nAssistant:"
    beams = continuous(generate.text(model, samplers.beam_search(3)))(prompt, stop_at="\n", max_tokens=30)
    greedy = continuous(generate.text(model))(prompt, stop_at="\n", max_tokens=30)
    for text, weight in zip(beams.value, beams.weights[0].tolist()):
        print(f"  log-prob {weight:6.2f} {text!r}")
    print(f"greedy decoding finds {greedy.value!r}, log-prob {float(greedy.weights[0, 0]):.2f}; "
          f"the best beam {float(beams.weights[0, 0]):.2f}")


def banned_phrases(model) -> None:
    from continuous import continuous, generate

    section("6. Banned phrases: rewinds inside a call")
    prompt = "User: Tell me about Omar.\nAssistant:"
    free = continuous(generate.text(model))(prompt, stop_at="\n", max_tokens=30)
    banned = [w.strip(".,") for w in free.value.split() if len(w) > 3][:2]
    before = model.stats.snapshot()
    state = continuous(generate.text(model, ban=banned))(prompt, stop_at="\n", max_tokens=30)
    after = model.stats.snapshot()
    print(f"free   : {free.value!r}\nban    : {banned}\nbanned : {state.value!r}")
    print(f"forwarded {after['tokens_forwarded'] - before['tokens_forwarded']} tokens; rewinds took back "
          f"{after['tokens_rewound'] - before['tokens_rewound']}: the kept text was never forwarded again")


def swarm(args) -> int:
    """The same conversation over a two-server swarm that the demo starts and stops."""
    import tempfile

    from continuous import continuous, generate, models
    from continuous.assets import DEMO_MODEL
    from continuous.demo.swarm import Swarm

    start = time.perf_counter()
    print("continuous demo on a swarm: two servers on 127.0.0.1 each serve half of the blocks of\n"
          "the shipped toy model, a third is a spare; the states' KV cache lives on the servers\n")
    with progress("Loading the model"):
        local = load_model()
    layers = local.model.config.num_hidden_layers
    first, second = f"0:{layers // 2}", f"{layers // 2}:{layers}"
    with tempfile.TemporaryDirectory() as logs, Swarm(DEMO_MODEL, logs, max_length=1024) as servers:
        with progress(f"Starting servers for blocks {first}, {second} and a spare for {first}"):
            servers.start(first)
            servers.start(second, first)
        remote = models.remote(DEMO_MODEL, initial_peers=servers.maddrs, max_length=1024, max_batch=1)
        section("A conversation whose cache lives on the swarm")
        chats = {"swarm": continuous(generate.text(remote)), "local": continuous(generate.text(local))}
        states, rows = {"swarm": None, "local": None}, []
        for turn, user in enumerate(CHAT, 1):
            if turn == len(CHAT):
                victim = states["swarm"].kv_cache.session.servers[0][0]
                servers.by_peer(victim).kill()
                print(f"(server {victim[:8]}... of blocks {first} killed: the spare takes over)")
            spent = {}
            for name, model in (("swarm", remote), ("local", local)):
                message = f"User: {user}\nAssistant:"
                prompt = message if states[name] is None else states[name] + message
                states[name], spent[name] = _forwarded(
                    model, lambda: chats[name](prompt, stop_at="\n", max_tokens=40))
            print(f"User: {user}\nAssistant:{states['swarm'].value}")
            rows.append((spent["swarm"], spent["local"], str(states["swarm"]) == str(states["local"])))
        remote.model.shutdown()
    print(f"\n{'turn':>4} {'forwarded on the swarm':>23} {'locally':>8} {'same text':>10}")
    for i, (on_swarm, on_local, same) in enumerate(rows, 1):
        print(f"{i:>4} {on_swarm:>23} {on_local:>8} {'yes' if same else 'NO':>10}")
    print(f"\nDone in {time.perf_counter() - start:.1f}s; every server was stopped.")
    return 0 if all(r[2] for r in rows) else 1


class Order(BaseModel):
    customer: str
    item: str
    quantity: int


def real_model(path: str) -> int:
    """The same ideas on a trained instruct model with its chat template (``--model PATH``)."""
    import torch

    from continuous import chat, continuous, generate, models, samplers

    start = time.perf_counter()
    print(f"continuous demo on {path}: a trained instruct model, its own chat template\n")
    with progress("Loading the model"):
        torch.set_num_threads(min(2, torch.get_num_threads()))
        model = models.transformers(path)
    section("1. Extract an order from a customer's message, as a pydantic object")
    message = "Hello, Aiko Tanaka here. Could you send me 2 cameras please?"
    prompt = chat.prompt(model, [{"role": "user", "content": f"Extract the order as JSON with fields customer, "
                                                             f"item, quantity. Message: '{message}'"}])
    state, spent = _forwarded(model, lambda: continuous(generate.json(model, Order))(prompt, max_tokens=80))
    print(f"message: {message!r}\noutput : {str(state)[len(prompt):]}\nvalue  : {state.value!r}")
    print(f"forwarded {spent} tokens; the layout is the model's own, the fields the schema's")
    section("2. A conversation in the chat template: each turn forwards only its new tokens")
    conv, gen, rows = chat.Conversation(model), continuous(generate.text(model)), []
    for question in ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]:
        conv.add("user", question)
        answer, spent = _forwarded(model, lambda: conv.reply(gen, max_tokens=48))
        history = len(model.tokenizer(str(conv.state), add_special_tokens=False).input_ids)
        print(f"user: {question}\nassistant: {answer}")
        rows.append((spent, history))
    for i, (spent, history) in enumerate(rows, 1):
        print(f"turn {i}: forwarded {spent} tokens of a {history}-token conversation")
    section("3. Token healing: a prompt cut in the middle of a word")
    cut = "The capital of France is Pa"
    for heal in (False, True):
        print(f"heal={heal!s:5}: {str(gen(cut, max_tokens=6, heal=heal))!r}")
    section("4. A banned word: the row rewinds and takes another way")
    question = chat.prompt(model, [{"role": "user", "content": "What is the capital of France? One sentence."}])
    print(f"free       : {gen(question, max_tokens=24).value!r}")
    banned, spent = _forwarded(model, lambda: continuous(generate.text(model, ban=["Paris"]))(question,
                                                                                              max_tokens=24))
    print(f"ban Paris  : {banned.value!r} ({model.stats.tokens_rewound} tokens rewound so far)")
    section("5. Three samples of one answer: the conversation is forwarded once")
    forks, spent = _forwarded(model, lambda: continuous(generate.text(model, samplers.multinomial(3)))(
        conv.state + chat.turn(model, "user", "Name a dish from there."), max_tokens=24, seed=0))
    for text in forks.value:
        print(f"  {text!r}")
    print(f"forwarded {spent} tokens for the three")
    print(f"\nDone in {time.perf_counter() - start:.1f}s.")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m continuous.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--swarm", action="store_true", help="run the conversation on a two-server swarm")
    parser.add_argument("--model", help="a trained instruct model's folder (its chat template is used) instead "
                                        "of the shipped toy")
    args = parser.parse_args(argv)
    if args.swarm:
        return swarm(args)
    if args.model:
        return real_model(args.model)

    start = time.perf_counter()
    print("continuous demo, on the toy model shipped in continuous/assets (3.5M parameters,\n"
          "trained on synthetic dialogues and JSON records: it knows little else)\n")
    with progress("Loading the model"):
        import torch

        torch.set_num_threads(min(2, torch.get_num_threads()))
        model = load_model()
    json_generation(model)
    state = conversation(model)
    slicing(model, state)
    forking(model)
    beam_search(model)
    banned_phrases(model)
    stats = model.stats
    print(f"\nDone in {time.perf_counter() - start:.1f}s: {stats.tokens_forwarded} tokens forwarded "
          f"in {stats.forward_calls} forward calls.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
