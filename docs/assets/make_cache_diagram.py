"""Draw ``cache-after-operations.svg``: the slots of real states of the demo model.

Every panel is a state reached by one operation; every square a slot of its padded
grid: blue when the cache holds the token's K/V, white when the next call forwards it,
grey hatched for padding and holes. Nothing is drawn by hand, so the picture shows what
the library does. Run ``python docs/assets/make_cache_diagram.py`` after changing the
layout rules or the demo model.
"""

from __future__ import annotations

import warnings
from html import escape
from pathlib import Path

import torch

from continuous import CacheResetWarning, continuous, generate, models
from continuous.assets import DEMO_MODEL

OUT = Path(__file__).resolve().parent / "cache-after-operations.svg"
CELL, HEIGHT, GAP, LEFT = 36, 22, 3, 52
COLORS = {"cached": "#9ecae1", "new": "#ffffff", "hole": "#e5e5e5"}


def label(tokenizer, token_id: int) -> str:
    text = tokenizer.decode([token_id])
    return text.replace("\n", "\u23ce").strip() or "\u2423"


def panel(tokenizer, code: str, state, note: str, y: int) -> tuple[list[str], int]:
    """SVG elements of one state, drawn from ``y``; returns them and the next free ``y``."""
    ids, mask = state.token_ids, state.attention_mask
    cached = state.kv_cache.length if state.kv_cache is not None else 0
    uncached = int(mask[:, cached:].sum())
    out = [f'<text x="0" y="{y + 14}" class="code">{escape(code)}</text>']
    y += 24
    for r in range(ids.shape[0]):
        out.append(f'<text x="0" y="{y + 15}" class="row">row {r}</text>')
        for c in range(ids.shape[1]):
            x = LEFT + c * (CELL + GAP)
            kind = "hole" if not mask[r, c] else "cached" if c < cached else "new"
            fill = "url(#hatch)" if kind == "hole" else COLORS[kind]
            out.append(f'<rect x="{x}" y="{y}" width="{CELL}" height="{HEIGHT}" rx="3" fill="{fill}" '
                       f'stroke="#4a6f8a" stroke-width="{0.5 if kind == "hole" else 1}"/>')
            if kind != "hole":
                text = escape(label(tokenizer, int(ids[r, c])))
                fit = f' textLength="{CELL - 4}" lengthAdjust="spacingAndGlyphs"' if len(text) > 6 else ""
                out.append(f'<text x="{x + CELL / 2}" y="{y + 15}" class="tok"{fit}>{text}</text>')
        y += HEIGHT + GAP
    if cached:
        x = LEFT + cached * (CELL + GAP) - GAP / 2
        out.append(f'<line x1="{x}" y1="{y - ids.shape[0] * (HEIGHT + GAP) - 4}" x2="{x}" y2="{y + 2}" '
                   'class="edge"/>')
    tokens = f"{uncached} token{'s' if uncached != 1 else ''}"
    out.append(f'<text x="{LEFT}" y="{y + 15}" class="note">{escape(note)} '
               f'(cache: {cached} slots; the next call forwards {tokens})</text>')
    return out, y + 34


def main() -> None:
    model = models.transformers(DEMO_MODEL, dtype=torch.float32)
    tok = model.tokenizer
    chat = continuous(generate.text(model))

    prompts = ["User: Hi!\nAssistant:", "User: Where is Oslo?\nAssistant:"]
    s = chat(prompts, stop_at="\n", max_tokens=12)
    cut = min(len(t) for t in s) - 6
    head = s[:, :cut]
    added = head + " Yes"
    more = chat(added, max_tokens=3)
    picked = more[1, :]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheResetWarning)
        before = "Hi. " + picked
    steps = [
        (f"s = chat({prompts!r}, stop_at='\\n')", s,
         "left padding; holes after the row that finished first; the last token is not cached yet"),
        (f"head = s[:, :{cut}]", head,
         "cut tokens become holes; the cache is cropped; a token cut in the middle is re-encoded, uncached"),
        ('added = head + " Yes"', added, "the new tokens go in new columns; the cache is kept"),
        ("more = chat(added, max_tokens=3)", more,
         "one pass forwarded every uncached slot, then 3 tokens were generated"),
        ("picked = more[1, :]", picked, "row selection: the row keeps its cache (copied into a new buffer)"),
        ('"Hi. " + picked', before, "text before a state moves every position: the cache is dropped"),
    ]
    body, y = [], 0
    for code, state, note in steps:
        elements, y = panel(tok, code, state, note, y)
        body += elements
    width = LEFT + max(st.token_ids.shape[1] for _, st, _ in steps) * (CELL + GAP) + 10
    svg = f"""<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {y}" width="{width}" height="{y}" \
font-family="ui-monospace, SFMono-Regular, Menlo, Consolas, monospace">
<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">
<rect width="6" height="6" fill="{COLORS['hole']}"/><line x1="0" y1="0" x2="0" y2="6" stroke="#c4c4c4" stroke-width="2"/>
</pattern></defs>
<style>.code{{font-size:13px;font-weight:bold;fill:#222}} .row{{font-size:11px;fill:#666}} \
.tok{{font-size:10px;text-anchor:middle;fill:#111}} .note{{font-size:11px;fill:#444;font-family:sans-serif}} \
.edge{{stroke:#d6336c;stroke-width:2;stroke-dasharray:4 3}}</style>
<rect width="100%" height="100%" fill="#fcfcfc"/>
{chr(10).join(body)}
</svg>
"""
    OUT.write_text(svg)
    print(f"wrote {OUT} ({width}x{y})")


if __name__ == "__main__":
    main()
