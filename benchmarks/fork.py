"""Forking samples from one prompt: the prompt is forwarded once, against outlines' num_return_sequences.

    python benchmarks/fork.py [--quick] [--save] [--reps N]
"""

from __future__ import annotations

from common import count_positions, emit, median, random_text, setup, timed

from continuous import continuous, generate, samplers


def main():
    import outlines

    args, size, hf, tok, model = setup(__doc__)
    samples, prompt_tokens, new = (4, 128, 8) if args.quick else (8, 512, 32)
    prompt = random_text(tok, prompt_tokens - 1, seed=7)  # with BOS: prompt_tokens
    gen = continuous(generate.text(model, samplers.multinomial(samples)))
    o_model = outlines.from_transformers(hf, tok)
    o_gen = outlines.Generator(o_model)
    seconds = {"continuous": [], "outlines": []}
    tokens = {}
    for rep in range(args.reps):
        with count_positions(hf) as counter:
            _, t = timed(lambda: gen(prompt, max_tokens=new, seed=rep))
        seconds["continuous"].append(t)
        tokens["continuous"] = counter["tokens"]
        with count_positions(hf) as counter:
            _, t = timed(lambda: o_gen(prompt, max_new_tokens=new, do_sample=True,
                                       num_return_sequences=samples))
        seconds["outlines"].append(t)
        tokens["outlines"] = counter["tokens"]
    n_prompt = len(tok(prompt).input_ids)
    tokens["expected"] = n_prompt + samples * new
    med = {k: round(median(v), 3) for k, v in seconds.items()}
    table = [("", "tokens forwarded", "seconds (median)"),
             ("continuous", tokens["continuous"], med["continuous"]),
             ("outlines", tokens["outlines"], med["outlines"]),
             ("expected (prompt once)", tokens["expected"], "")]
    result = {"bench": "fork", "model": size, "samples": samples, "tokens": tokens, "seconds": med,
              "bars": {"prompt_once": tokens["continuous"] <= tokens["expected"],
                       "speedup_vs_outlines": round(med["outlines"] / med["continuous"], 3)}}
    emit("fork", table, result, args.save)


if __name__ == "__main__":
    main()
