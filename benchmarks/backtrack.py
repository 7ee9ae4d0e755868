"""Banned phrases: continuous's rewinds against regenerating (antislop) and a hand-written crop loop.

    python benchmarks/backtrack.py [--quick] [--save] [--reps N]

Workload: 256 sampled tokens (48 with --quick) after a prompt, over 8 seeds, with ban
lists of 1, 100 and 8,000 phrases that include word pairs a free run of the same seeds
produces (so rewinds happen), the rest invented words. Competitors, with the same
detection (:class:`continuous.ban.BanList`) and the same sampling (inverse CDF on the
same seeded draws, a banned token forbidden at its position):

- ``continuous``: ``generate.text(model, multinomial(), ban=...)``: a rewind crops the row;
- ``regenerate``: antislop's way, every rewind regenerates from the rewound ids with a
  fresh cache (the prompt and the kept tokens are forwarded again);
- ``crop``: a hand-written loop on one ``DynamicCache`` cropped at each rewind.

Reported: tokens forwarded, seconds, ms per forward call (at none, 1, 100 and 8,000
bans: the detection's cost), backtracks, and banned text found in any output (must be 0).
"""

from __future__ import annotations

import random
import re

import torch
from common import emit, median, random_text, setup, timed
from transformers import DynamicCache

from continuous import continuous, generate, samplers
from continuous.ban import BanList
from continuous.kv import CACHE_ARG


def ban_lists(free_texts: list[str], seed: int = 0) -> dict[str, list[str]]:
    """1, 100 and 8,000 phrases: words and word pairs of the free runs first (taken from every
    run in turn, so that every seed meets some), then invented words."""
    per_text = []
    for text in free_texts:
        words = [w for w in text.split() if w.isalpha() and len(w) >= 3]
        per_text.append(words + [f"{a} {b}" for a, b in zip(words, words[1:])])
    seen = []
    for i in range(max(map(len, per_text), default=0)):
        seen += [p[i] for p in per_text if i < len(p)]
    seen = list(dict.fromkeys(seen))
    rng = random.Random(seed)
    filler = ["".join(rng.choice("bcdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(3, 5)))
              for _ in range(8000)]
    return {f"b{n}": (seen + filler)[:n] for n in (1, 100, 8000)}


def hand_loop(hf, tok, prompt_ids, n, seed, ban: BanList, reuse_cache: bool):
    """Sample n tokens with rewinds; returns (text, tokens forwarded, forward calls, backtracks)."""
    rng = torch.Generator().manual_seed(seed)
    matcher = ban.matcher(tok.decode(prompt_ids, skip_special_tokens=True))  # a word may not begin mid-word
    ids: list[int] = []
    ends: list[int] = []
    text = ""
    bans: dict[int, set[int]] = {}
    forwarded = calls = backtracks = 0
    cache = DynamicCache(config=hf.config)

    def forward(new_ids, past_len):
        nonlocal forwarded, calls
        forwarded += len(new_ids)
        calls += 1
        out = hf(torch.tensor([new_ids]), **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1,
                 position_ids=torch.arange(past_len, past_len + len(new_ids))[None])
        return out.logits[0, -1].float()

    with torch.no_grad():
        logits = forward(prompt_ids, 0)
        while len(ids) < n:
            masked = logits.clone()
            for t in bans.get(len(ids), ()):
                masked[t] = -torch.inf
            if not torch.isfinite(masked).any():
                break
            logprobs = torch.log_softmax(masked, -1)
            u = torch.rand(1, 1, generator=rng, dtype=torch.float64)
            cdf = logprobs.double().exp().cumsum(-1)
            token = int(torch.searchsorted(cdf[None], u * cdf[-1:], right=True)[0, 0])
            if token == tok.eos_token_id:
                matches = matcher.finish()  # a phrase at the very end waited for what follows
                if not matches:
                    break
            else:
                ids.append(token)
                piece = tok.decode(prompt_ids[-4:] + ids)[len(tok.decode(prompt_ids[-4:] + ids[:-1])):]
                text += piece
                ends.append(len(text))
                matches = matcher.feed(piece) if piece else []
                if not matches and len(ids) == n:
                    matches = matcher.finish()
            if not matches:
                logits = forward([token], len(prompt_ids) + len(ids) - 1)
                continue
            backtracks += 1
            start = matches[0].start  # the earliest banned phrase the token completes
            keep = sum(1 for e in ends if e <= start)
            bans.setdefault(keep, set()).add(ids[keep])
            for p in [p for p in bans if p > keep]:
                del bans[p]
            del ids[keep:], ends[keep:]
            text = text[: ends[-1]] if ends else ""
            matcher.rewind(len(text))
            if reuse_cache:  # transformers 5: crop(-k) removes k tokens
                keep_len = len(prompt_ids) + len(ids) - 1  # the last kept token comes back for its logits
                cache.crop(keep_len - cache.get_seq_length())
                logits = forward((prompt_ids + ids)[-1:], keep_len)
            else:  # antislop: regenerate from the rewound ids, nothing kept
                cache = DynamicCache(config=hf.config)
                logits = forward(prompt_ids + ids, 0)
    return text, forwarded, calls, backtracks


def banned_in(prompt: str, text: str, phrases) -> int:
    """How many phrases the text generated after ``prompt`` holds, as bans match them: case
    folded, and on word boundaries where a phrase begins or ends with a word character (a ban on
    "cat" leaves "category", and a word the prompt began goes on)."""
    folded, start = (prompt + text).casefold(), len(prompt.casefold())
    found = 0
    for p in phrases:
        left = r"(?<!\w)" if p[:1].isalnum() or p[:1] == "_" else ""
        right = r"(?!\w)" if p[-1:].isalnum() or p[-1:] == "_" else ""
        found += re.compile(left + re.escape(p.casefold()) + right).search(folded, start) is not None
    return found


def main():
    args, size, hf, tok, model = setup(__doc__)
    n = 48 if args.quick else 256
    seeds = range(4 if args.quick else 8)
    prompt = random_text(tok, 48, seed=21)
    prompt_ids = tok(prompt).input_ids
    free = continuous(generate.text(model, samplers.multinomial()))
    lists = ban_lists([free(prompt, max_tokens=n, seed=s).value for s in seeds])

    per_forward, tokens, seconds, backtracks, found = {}, {}, {}, {}, 0
    for name, phrases in [("none", None)] + list(lists.items()):
        gen = continuous(generate.text(model, samplers.multinomial(), ban=phrases))
        ban = BanList(phrases) if phrases else None
        times, fwd, calls, rewound = [], 0, 0, 0
        for _ in range(args.reps):
            for s in seeds:
                before = model.stats.snapshot()
                state, t = timed(lambda: gen(prompt, max_tokens=n, seed=s))
                after = model.stats.snapshot()
                times.append(t)
                fwd += after["tokens_forwarded"] - before["tokens_forwarded"]
                calls += after["forward_calls"] - before["forward_calls"]
                rewound += after["tokens_rewound"] - before["tokens_rewound"]
                if ban is not None:
                    found += banned_in(prompt, state.value, phrases)
        per_forward[name] = sum(times) / calls * 1e3
        if name == "b100":
            tokens["continuous"], seconds["continuous"] = fwd // args.reps, median(times) * len(seeds)
            backtracks["continuous_rewound_tokens"] = rewound // args.reps
            for other, reuse in (("regenerate", False), ("crop", True)):
                fwd_o, times_o, back_o = 0, [], 0
                for s in seeds:
                    (text, f, _, b), t = timed(lambda: hand_loop(hf, tok, prompt_ids, n, s, ban, reuse))
                    fwd_o, back_o = fwd_o + f, back_o + b
                    times_o.append(t)
                    found += banned_in(prompt, text, phrases)
                tokens[other], seconds[other], backtracks[other] = fwd_o, sum(times_o), back_o
    ratio = tokens["regenerate"] / max(1, tokens["continuous"])
    table = [("at 100 bans", "tokens forwarded", "seconds"),
             *[(k, tokens[k], f"{seconds[k]:.2f}") for k in ("continuous", "regenerate", "crop")],
             ("", "", ""), ("ms per forward call", "", ""),
             *[(k, f"{v:.2f}", "") for k, v in per_forward.items()],
             ("banned text found", found, "")]
    result = {"bench": "backtrack", "model": size, "tokens_per_seed": n, "seeds": len(seeds),
              "banned_found": found, "tokens": tokens, "seconds": {k: round(v, 3) for k, v in seconds.items()},
              "backtracks": backtracks, "ms_per_forward": {k: round(v, 3) for k, v in per_forward.items()},
              "bars": {"banned_found_zero": found == 0, "regenerate_vs_continuous_tokens": round(ratio, 2),
                       "b8000_vs_none": round(per_forward["b8000"] / per_forward["none"], 3)}}
    emit("backtrack", table, result, args.save)


if __name__ == "__main__":
    main()
