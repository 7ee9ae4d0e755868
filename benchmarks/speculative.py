"""Speculative decoding under a JSON schema: extraction that copies from the message, on SmolLM2.

    python benchmarks/speculative.py [--quick] [--save] [--reps N] [--device cpu|cuda] [--k K] [--ngram N]
    python benchmarks/speculative.py --swarm [--quick] [--save] [--reps N] [--k K] [--ngram N]

SmolLM2-135M-Instruct (fp32 on the CPU, bf16 on a GPU; tests/support/real.py) extracts
10 support messages of 100-300 words into a ``Ticket`` whose fields copy from the
message (name, email, order number, product, city, the sentence that says what is wrong),
greedily, from prefilled prompts. Per case: forward passes per output token and time per
output token.

- token: one forward per token (``fast_forward=False``);
- ff: fast-forward (the tokens the schema forces go with the sampled one);
- lookup_ff: ``speculate=PromptLookup(k, ngram)`` with fast-forward;
- draft: a draft model, where one smaller than the model shares its tokenizer (none does
  for SmolLM2-135M: the row says so).

Outputs of every case must be identical to ff's. For comparison, transformers'
``generate`` on the same prompts, unconstrained (free text, stopping at the end of the
turn), with and without ``prompt_lookup_num_tokens=k``.

``--swarm``: the same work through a swarm of two servers on 127.0.0.1, each serving half
of SmolLM2's blocks (``models.remote``; fp32 on the CPU), for the cases token, ff and
lookup_ff: round trips per output token (one forward is one step through both servers)
and time per output token. Saved as ``speculative_swarm``. The last line printed is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile

import torch
from common import count_positions, emit, median, timed
from pydantic import BaseModel
from support.real import smollm2

from continuous import PromptLookup, chat, continuous, generate, models
from continuous.demo.swarm import Swarm

NAMES = ["Maria Lopez", "John Smith", "Aiko Tanaka", "Pierre Martin", "Fatima Ali", "Lars Berg", "Chen Wei",
         "Olga Ivanova", "Diego Ruiz", "Amara Okafor"]
PRODUCTS = ["blue enamel kettle", "folding red umbrella", "instant film camera", "adjustable desk lamp",
            "city bicycle", "merino wool blanket", "cast iron teapot", "dotted paper notebook",
            "nylon guitar strings", "waterproof hiking backpack"]
CITIES = ["Valencia", "Leeds", "Osaka", "Lyon", "Casablanca", "Bergen", "Chengdu", "Kazan", "Rosario", "Lagos"]
PROBLEMS = ["the lid does not close and water leaks onto the stove", "two of the ribs snapped the first time it rained",
            "the shutter button sticks and every picture comes out black", "the hinge wobbles and the light flickers",
            "the rear brake rubs against the wheel", "it arrived with a long tear along one edge",
            "the handle came loose after the second use", "a whole section of pages is missing",
            "the high E string broke while tuning", "the zipper of the main pocket is broken"]
FILLER = ["I have been a customer of your shop for several years and I have always been happy with it.",
          "The parcel arrived on time and the courier was very friendly.",
          "I opened the box the same evening and followed the instructions carefully.",
          "My sister recommended your store, so this is a little disappointing.",
          "I tried to find an answer in the help pages but nothing matched my case.",
          "I would prefer a replacement to a refund if that is possible.",
          "Please let me know if you need photos or the original packaging.",
          "I can drop the item at a post office near my home during the week.",
          "Thank you in advance for looking into this quickly.",
          "The rest of the order was fine and I will keep those items."]


class Ticket(BaseModel):
    customer: str
    email: str
    order_number: str
    product: str
    city: str
    problem: str


def messages(n: int) -> list[tuple[str, Ticket]]:
    """``n`` messages of 100-300 words and the ticket each one states (reproducible)."""
    out = []
    for i in range(n):
        rng = random.Random(i)
        name, product, city, problem = NAMES[i], PRODUCTS[i], CITIES[i], PROBLEMS[i]
        email = name.lower().replace(" ", ".") + "@example.com"
        number = f"A-{rng.randrange(10000, 99999)}"
        filler = rng.sample(FILLER, len(FILLER))
        core = [f"Hello, my name is {name} and I live in {city}.",
                f"Last week I ordered the {product} from your shop, order number {number}.",
                f"Unfortunately {problem}.", f"You can reach me at {email}."]
        words = rng.randrange(100, 300)
        body = core[:2]
        for sentence in filler * 3:
            if len(" ".join(body + core[2:]).split()) >= words:
                break
            body.append(sentence)
        out.append((" ".join(body[:3] + core[2:3] + body[3:] + core[3:]),
                    Ticket(customer=name, email=email, order_number=number, product=product, city=city,
                           problem=problem)))
    return out


def value_of(state):
    """The ticket, or ``None`` where max_tokens cut the JSON short."""
    try:
        return state.value
    except ValueError:
        return None


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2 messages")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/speculative.json")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--k", type=int, default=8, help="tokens drafted per step")
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160, help="tokens per ticket at most")
    parser.add_argument("--swarm", action="store_true", help="through a local swarm of two servers")
    return parser.parse_args()


def prompt_of(model, message: str) -> str:
    ask = ("Extract the support ticket from this message as JSON with the fields customer, email, order_number, "
           "product, city and problem, each copied from the message. Message: " + message)
    return chat.prompt(model, [{"role": "user", "content": ask}])


def cases_of(model, args) -> dict:
    """Per case, the generator and the call's options."""
    json_gen = generate.json(model, Ticket)
    return {"token": (continuous(json_gen, fast_forward=False), {}), "ff": (continuous(json_gen), {}),
            "lookup_ff": (continuous(json_gen), {"speculate": PromptLookup(k=args.k, ngram=args.ngram)})}


def prefilled(model, prompts, cases) -> list:
    """The prompts' states, prefilled (decoding is timed), after a warm-up of every case."""
    free = continuous(generate.text(model))
    bases = [free(p, max_tokens=0) for p in prompts]
    for gen, kwargs in cases.values():
        gen(bases[0], max_tokens=4, **kwargs)  # warm up (the constraint's tokenizer conversion, first kernels)
    return bases


def ours(model, bases, cases, reps, max_tokens):
    """Per case: (ms per output token, forward calls per output token, outputs, drafted, accepted)."""
    out = {}
    for _ in range(reps):
        for name, (gen, kwargs) in cases.items():
            before = model.stats.snapshot()
            states, tokens, elapsed = [], 0, 0.0
            for base in bases:
                state, t = timed(lambda: gen(base, max_tokens=max_tokens, **kwargs))
                states.append(state)
                tokens += int(state.attention_mask.sum()) - int(base.attention_mask.sum())
                elapsed += t
            after = model.stats.snapshot()
            calls = after["forward_calls"] - before["forward_calls"]
            drafted = after["tokens_drafted"] - before["tokens_drafted"]
            accepted = after["tokens_accepted"] - before["tokens_accepted"]
            times = out.setdefault(name, {"ms": []})["ms"]
            times.append(elapsed / max(1, tokens) * 1e3)
            out[name].update(calls_per_token=round(calls / max(1, tokens), 3), tokens=tokens, drafted=drafted,
                             accepted=accepted, values=[value_of(s) for s in states],
                             ids=[s.token_ids[0][s.attention_mask[0].bool()].tolist() for s in states])
    return out


def hf_generate(model, prompts, reps, max_tokens, k):
    """transformers' generate, unconstrained, with and without prompt lookup."""
    hf, tok = model.model, model.tokenizer
    out = {}
    for _ in range(reps):
        for name, extra in (("hf", {}), ("hf_lookup", {"prompt_lookup_num_tokens": k})):
            tokens, elapsed, calls = 0, 0.0, 0
            for p in prompts:
                ids = tok(p, return_tensors="pt", add_special_tokens=False).input_ids.to(hf.device)
                with count_positions(hf) as counted, torch.no_grad():
                    gen_ids, t = timed(lambda: hf.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                                           eos_token_id=list(model.eos_token_ids),
                                                           pad_token_id=tok.eos_token_id, **extra))
                n = gen_ids.shape[1] - ids.shape[1]
                # The prefill is a forward of its own: it is not counted against the output tokens.
                tokens, elapsed, calls = tokens + n, elapsed + t, calls + counted["calls"] - 1
            entry = out.setdefault(name, {"ms": []})
            entry["ms"].append(elapsed / max(1, tokens) * 1e3)
            entry.update(calls_per_token=round(calls / max(1, tokens), 3), tokens=tokens)
    return out


def on_swarm(args, data) -> None:
    """The extraction through two local servers, each holding half of the blocks."""
    path = smollm2()
    with open(path / "config.json") as f:
        layers = json.load(f)["num_hidden_layers"]
    with tempfile.TemporaryDirectory() as logs, Swarm(path, logs, max_length=1024) as swarm:
        swarm.start(f"0:{layers // 2}")
        swarm.start(f"{layers // 2}:{layers}")
        remote = models.remote(path, initial_peers=swarm.maddrs, max_length=1024, max_batch=1)
        try:
            cases = cases_of(remote, args)
            bases = prefilled(remote, [prompt_of(remote, m) for m, _ in data], cases)
            results = ours(remote, bases, cases, args.reps, args.max_tokens)
        finally:
            remote.model.shutdown()
    ms = {k: round(median(v["ms"]), 3) for k, v in results.items()}
    trips = {k: v["calls_per_token"] for k, v in results.items()}
    same = all(r["ids"] == results["ff"]["ids"] for r in results.values())
    table = [("", "ms/output token", "vs token", "round trips/output token", "tokens", "drafted", "accepted")]
    for name, r in results.items():
        table.append((name, f"{ms[name]:.2f}", f"{ms[name] / ms['token']:.2f}x", trips[name], r["tokens"],
                      r["drafted"], r["accepted"]))
    lookup = results["lookup_ff"]
    result = {"bench": "speculative_swarm", "model": "SmolLM2-135M-Instruct", "servers": 2, "k": args.k,
              "ngram": args.ngram, "messages": len(data), "max_tokens": args.max_tokens,
              "ms_per_output_token": ms, "round_trips_per_output_token": trips,
              "tokens": {k: v["tokens"] for k, v in results.items()}, "drafted": lookup["drafted"],
              "accepted": lookup["accepted"], "same_outputs": same}
    emit("speculative_swarm", table, result, args.save)


def main():
    args = parse_args()
    data = messages(2 if args.quick else 10)
    if args.swarm:
        return on_swarm(args, data)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = models.transformers(smollm2(), device=args.device, dtype=dtype)
    max_tokens = args.max_tokens
    prompts = [prompt_of(model, m) for m, _ in data]
    cases = cases_of(model, args)
    bases = prefilled(model, prompts, cases)
    results = ours(model, bases, cases, args.reps, max_tokens)
    results.update(hf_generate(model, prompts, args.reps, max_tokens, args.k))
    ms = {k: round(median(v["ms"]), 3) for k, v in results.items()}
    calls = {k: v["calls_per_token"] for k, v in results.items()}
    same = all(results[k]["ids"] == results["ff"]["ids"] for k in cases)
    correct = sum(getattr(v, f) == getattr(t, f) for v, (_, t) in zip(results["ff"]["values"], data)
                  for f in Ticket.model_fields if v is not None)
    table = [("", "ms/output token", "vs token", "forwards/output token", "tokens", "drafted", "accepted")]
    for name, r in results.items():
        table.append((name, f"{ms[name]:.2f}", f"{ms[name] / ms['token']:.2f}x", calls[name], r["tokens"],
                      r.get("drafted", "-"), r.get("accepted", "-")))
    table.append(("draft", "n/a: no model smaller than SmolLM2-135M shares its tokenizer", "", "", "", "", ""))
    lookup = results["lookup_ff"]
    result = {"bench": "speculative", "model": "SmolLM2-135M-Instruct", "device": args.device, "k": args.k,
              "ngram": args.ngram, "messages": len(data), "ms_per_output_token": ms,
              "forwards_per_output_token": calls, "tokens": {k: v["tokens"] for k, v in results.items()},
              "drafted": lookup["drafted"], "accepted": lookup["accepted"], "same_outputs": same,
              "correct_fields": f"{correct}/{len(Ticket.model_fields) * len(data)}",
              "bars": {"lookup_forwards_per_token_le_0.5": calls["lookup_ff"] <= 0.5,
                       "lookup_time_le_0.7x_token": ms["lookup_ff"] <= 0.7 * ms["token"],
                       "identical_greedy_outputs": same}}
    emit("speculative", table, result, args.save)


if __name__ == "__main__":
    main()
