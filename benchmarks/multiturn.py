"""Multi-turn JSON chat: continuous against outlines (whole history each turn) and the ideal loop.

    python benchmarks/multiturn.py [--quick] [--save] [--reps N]

A long system prompt, then turns that each append a user message and generate a JSON
answer under the same schema and max tokens. "ideal" is a hand-written loop of HF
forward calls on one DynamicCache, masking with the same constraint: the
least work the task needs. Competitors run interleaved in one process.
"""

from __future__ import annotations

import time

import torch
from common import count_positions, emit, median, random_text, setup, timed
from pydantic import BaseModel
from transformers import DynamicCache

from continuous import continuous, generate
from continuous.kv import CACHE_ARG


class Answer(BaseModel):
    intent: str
    city: str
    count: int


def bool_mask(matcher, bitmask, vocab):
    matcher.fill(bitmask)
    bits = (bitmask.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1
    return bits.view(-1)[:vocab].bool()


def run_turns(step, system, messages):
    """Seconds of each turn; ``step(history, message)`` returns the new history."""
    history, seconds = system, []
    for msg in messages:
        t = time.perf_counter()
        history = step(history, msg)
        seconds.append(time.perf_counter() - t)
    return seconds


def ideal_turns(hf, tok, constraint, system, messages, max_tokens):
    """One DynamicCache; each turn forwards its message (and the previous answer's last token).

    Masks come from the same constraint (engine) as continuous's, so both choose the same tokens.
    """
    vocab, device = hf.config.vocab_size, hf.device
    bitmask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    cache = DynamicCache(config=hf.config)

    def step(pending, msg):
        pending = pending + tok(msg, add_special_tokens=False).input_ids
        matcher = constraint.matcher()
        with torch.no_grad():
            for _ in range(max_tokens):
                out = hf(torch.tensor([pending], device=device), **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1)
                allowed = bool_mask(matcher, bitmask, vocab).to(device, non_blocking=True)
                logits = out.logits[0, -1].masked_fill(~allowed, -torch.inf)
                token = int(logits.argmax())
                if token == tok.eos_token_id:
                    return []
                matcher.advance(token)
                pending = [token]
                if matcher.done():
                    break
        return pending

    return run_turns(step, tok(system).input_ids, messages)


def competitors(hf, tok, model, quick: bool):
    """The workload and its three competitors: name -> a function running every turn.

    Returns (competitors, turns).
    """
    import outlines

    system_tokens, turns, msg_tokens, max_tokens = (256, 3, 32, 8) if quick else (1024, 8, 64, 16)
    system = random_text(tok, system_tokens, seed=1)
    messages = [f"\nUser: {random_text(tok, msg_tokens - 6, seed=10 + i)}\nAssistant:" for i in range(turns)]
    # Token by token, as the ideal loop: the comparison is about reusing the cache
    # (benchmarks/fastforward.py measures forced tokens forwarded together).
    gen = continuous(generate.json(model, Answer), fast_forward=False)
    constraint = gen.generator.constraint
    o_gen = outlines.Generator(outlines.from_transformers(hf, tok), Answer)
    o_gen("warm up", max_new_tokens=2)  # outlines' mask kernel compiles on its first call
    return {
        "continuous": lambda: run_turns(lambda h, m: gen(h + m, max_tokens=max_tokens), system, messages),
        "ideal": lambda: ideal_turns(hf, tok, constraint, system, messages, max_tokens),
        "outlines": lambda: run_turns(lambda h, m: h + m + o_gen(h + m, max_new_tokens=max_tokens), system, messages),
    }, turns


def main():
    args, size, hf, tok, model = setup(__doc__)
    runs, turns = competitors(hf, tok, model, args.quick)

    seconds = {"continuous": [], "ideal": [], "outlines": []}
    per_turn = {"continuous": [], "ideal": [], "outlines": []}
    tokens = {}
    for rep in range(args.reps):
        for name in ("continuous", "ideal", "outlines"):
            with count_positions(hf) as counter:
                turn_s, total = timed(runs[name])
            seconds[name].append(total)
            per_turn[name].append(turn_s)
            tokens[name] = counter["tokens"]
    med = {k: median(v) for k, v in seconds.items()}
    turn_medians = {k: [median([rep[i] for rep in v]) for i in range(turns)] for k, v in per_turn.items()}
    table = [("", "tokens forwarded", "seconds (median)", "vs ideal")]
    for name in ("continuous", "ideal", "outlines"):
        table.append((name, tokens[name], f"{med[name]:.2f}", f"{med[name] / med['ideal']:.2f}x"))
    result = {
        "bench": "multiturn", "model": size, "turns": turns,
        "tokens": tokens, "seconds": {k: round(v, 3) for k, v in med.items()},
        "per_turn_seconds": {k: [round(x, 3) for x in v] for k, v in turn_medians.items()},
        "bars": {"tokens_equal_ideal": tokens["continuous"] == tokens["ideal"],
                 "time_vs_ideal": round(med["continuous"] / med["ideal"], 3),
                 "speedup_vs_outlines": round(med["outlines"] / med["continuous"], 3)},
    }
    emit("multiturn", table, result, args.save)


if __name__ == "__main__":
    main()
