"""Top up the cache: forward, in one pass, every slot a call's rows have that it does not cover."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..layout import Rows, interior_holes
from ..models.scheduler import Request

__all__ = ["check_context", "top_up", "top_up_steps"]


def check_context(model, rows: Rows, extra: int = 0) -> None:
    """Refuse, before any compute, an empty row or rows that leave no room for ``extra`` tokens."""
    lengths = rows.attention_mask.sum(1).tolist()
    longest = max(lengths, default=0)
    if 0 in lengths:
        raise ValueError(f"cannot generate from an empty sequence (row {lengths.index(0)}): the tokenizer "
                         "adds no BOS token and the text is empty")
    if longest + extra > model.max_length:
        raise ValueError(f"the sequence has {longest} tokens and the model's context is "
                         f"{model.max_length} tokens: nothing was computed")


def top_up(model, rows: Rows) -> Rows:
    """Forward, in one pass, every slot the cache does not cover (see :func:`top_up_steps`)."""
    steps = top_up_steps(model, rows)
    try:
        request = next(steps)
        while True:
            request = steps.send(model.forward(request.input_ids, request.attention_mask, request.cache,
                                               request.logits_to_keep, n_real=request.n_real, holes=request.holes))
    except StopIteration as done:
        return done.value


def top_up_steps(model, rows: Rows):
    """:func:`top_up` as a coroutine: it yields its forward (a
    :class:`~continuous.models.scheduler.Request`) and is sent ``(logits, cache)``; its
    return value is the rows.

    Afterwards every row has valid logits after its last real token. A row whose last
    token is cached but whose logits were lost (a slice cut it there) has that one
    token moved past the cache and recomputed. Holes in the cached slots are squeezed
    out first when they waste much room (see :meth:`Rows.compact`).
    """
    check_context(model, rows)
    n_rows, width = rows.token_ids.shape
    if rows.cache is None and width and bool(rows.attention_mask.all()):
        # A fresh prompt with no padding (most calls' first forward): each row's last slot is its last token.
        logits, cache = yield Request(rows.token_ids, None, None, logits_to_keep=1, n_real=n_rows * width, holes=False)
        return replace(rows, cache=cache, logits=logits[:, -1], logits_ok=(True,) * n_rows)
    rows = rows.compact()
    mask = rows.attention_mask
    start = rows.cache_length
    uncached = mask[:, start:].sum(1)
    redo = [r for r in range(rows.n_rows) if uncached[r] == 0 and not rows.logits_ok[r]]
    if redo:
        edits = []
        for r in range(rows.n_rows):
            n = len(rows.ends[r])
            if r in redo:  # the token becomes a hole and comes back past the cache
                edits.append((n - 1, [rows.real_ids(r)[-1]], [rows.ends[r][-1]], rows.texts[r]))
            else:
                edits.append((n, [], [], rows.texts[r]))
        rows = rows.edit(edits)
        mask, start = rows.attention_mask, rows.cache_length
    length = mask.shape[1]
    if length == start:
        return rows
    chunk = mask[:, start:]
    has_new = chunk.sum(1) > 0
    # Last real slot of each row in the chunk; logits_to_keep covers the earliest of them.
    last = length - 1 - chunk.flip(1).argmax(1)
    keep = int(length - last[has_new].min())
    dense = bool(mask.all())
    logits, cache = yield Request(rows.token_ids[:, start:], None if dense else mask, rows.cache,
                                  logits_to_keep=keep, n_real=int(chunk.sum()), holes=not dense and interior_holes(mask))
    at = (last - (length - keep)).clamp(min=0).to(logits.device)
    picked = logits[torch.arange(rows.n_rows, device=logits.device), at]
    if rows.logits is not None:
        picked = torch.where(has_new.to(logits.device)[:, None], picked, rows.logits)
    return replace(rows, cache=cache, logits=picked, logits_ok=(True,) * rows.n_rows)
