"""Choice scores: the log-probability of every option after the prompt, from one batched forward.

The prompt is forwarded once (its cache is the one the generation then continues). Each
row is forked into one row per option (the forks share the prompt's cache), every
option's tokens but its last go through the model in one batched forward, right-aligned
behind the prompt, and each option's score is the sum of its tokens' log-softmax.

Which tokens an option has: generation goes on after the prompt's last token and never
merges with it, so an option is spelled as the tokenizer spells its text when the text
starts a new token in the middle of a document (no SentencePiece dummy space; see
:func:`continuous.layout.encode_after`). That is the option's canonical tokenization, the
one a model trained on that tokenizer puts its mass on. Other spellings of the same text
(``"Par" + "is"`` for ``"Paris"``) are allowed by the constraint too; their probability
is not counted.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .decode.prefill import check_context, top_up
from .layout import Rows, encode_after, interior_holes

__all__ = ["ChoiceScorer", "option_tokens", "score_options"]


def option_tokens(tokenizer, text: str, option: str) -> list[int]:
    """The token ids of ``option`` as generated after the text ``text`` (the canonical spelling)."""
    ids, _ = encode_after(tokenizer, text + option, len(text), len(text) + len(option))
    return ids


def score_options(model, rows: Rows, spelled: Sequence[Sequence[list[int]]]) -> torch.Tensor:
    """Each option's summed log-probability after each row.

    Parameters
    ----------
    model
        The backend.
    rows
        Rows whose cache covers every token and whose logits after the last token are
        valid (:func:`continuous.decode.top_up` gives such rows).
    spelled
        Per row, the token ids of each option (:func:`option_tokens`), none empty; every
        row has the same number of options.

    Returns
    -------
    torch.Tensor
        ``[rows, options]`` float32 log-probabilities, on the host.
    """
    n_rows, n_opt = rows.n_rows, len(spelled[0])
    flat = [ids for per_row in spelled for ids in per_row]
    logits = rows.logits.float()
    device = logits.device
    # The first token of every option comes from the prompt's own logits.
    owner = torch.arange(n_rows, device=device).repeat_interleave(n_opt)
    first = torch.tensor([ids[0] for ids in flat], device=device)
    totals = logits[owner, first] - torch.logsumexp(logits, -1)[owner]
    width = max(len(ids) for ids in flat) - 1
    if width > 0:
        totals = totals + _rest(model, rows.select(owner.tolist()), flat, width)
    return totals.reshape(n_rows, n_opt).cpu()


def _rest(model, forked: Rows, flat: list[list[int]], width: int) -> torch.Tensor:
    """Per forked row, the summed log-probability of its option's tokens after the first.

    Each row's option (all tokens but the last) is right-aligned in ``width`` new slots;
    the logits at a slot score the option's next token there.
    """
    inputs = torch.full((len(flat), width), forked.pad, dtype=torch.long)
    targets = torch.zeros((len(flat), width), dtype=torch.long)
    new = torch.zeros((len(flat), width), dtype=torch.long)
    for i, ids in enumerate(flat):
        k = len(ids) - 1
        if k:
            inputs[i, width - k:] = torch.tensor(ids[:-1])
            targets[i, width - k:] = torch.tensor(ids[1:])
            new[i, width - k:] = 1
    mask = torch.cat([forked.attention_mask, new], 1)
    logits, _ = model.forward(inputs, mask, forked.cache, logits_to_keep=width, n_real=int(new.sum()),
                              holes=interior_holes(mask))
    logits = logits.float()
    targets, new = targets.to(logits.device), new.to(logits.device).bool()
    picked = logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)
    # A padding slot's logits mean nothing (they may even be NaN): select, do not multiply.
    return torch.where(new, picked, 0.0).sum(1)


class ChoiceScorer:
    """What ``generate.choice(..., scores=...)`` computes before generating: per row, each
    option's log-probability after the prompt.

    Parameters
    ----------
    options
        Text -> value of each option (the value is the key of the scores).
    mean
        Divide each option's log-probability by its number of tokens.
    """

    def __init__(self, options: dict[str, Any], mean: bool = False):
        if any(text == "" for text in options):
            raise ValueError("choice scores need non-empty options: the empty option has no token to score")
        self.options, self.mean = dict(options), mean

    def __repr__(self) -> str:
        return f"ChoiceScorer({len(self.options)} options, {'mean' if self.mean else 'sum'})"

    def __call__(self, model, rows: Rows, fork: int = 1) -> tuple[Rows, list[dict[Any, float]]]:
        """Forward what the rows' cache lacks, score the options, and return the rows (ready to
        generate from, nothing left to forward) and each row's scores (repeated ``fork``
        times, for the samples a row becomes)."""
        spelled = [[option_tokens(model.tokenizer, text, o) for o in self.options] for text in rows.texts]
        check_context(model, rows, max(len(ids) for per_row in spelled for ids in per_row))  # before any compute
        rows = top_up(model, rows)
        scores = score_options(model, rows, spelled)
        if self.mean:
            scores = scores / torch.tensor([[len(ids) for ids in per_row] for per_row in spelled], dtype=scores.dtype)
        values = list(self.options.values())
        per_row = [dict(zip(values, row)) for row in scores.tolist()]
        return rows, [dict(s) for s in per_row for _ in range(fork)]
