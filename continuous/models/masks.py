"""Attention masks of one forward, built by transformers' own masking functions.

A layout's rows may hold padding and *holes* (masked slots: cut tokens, rows that
finished while others went on). Full-attention layers need only the 2D mask: causal
order over slots plus the mask is exact whatever the holes. A sliding window, though,
counts tokens, and transformers counts it in slots; that agrees only while no row has
a hole between two of its tokens. Then (and only then) the sliding layers get a mask
whose window is measured in positions (real tokens), built by the same transformers
function with an extra condition. A layout without padding or holes passes no mask at
all, so attention takes the plain causal path.
"""

from __future__ import annotations

import torch

__all__ = ["layer_windows", "positions", "near", "check_supported", "attention_masks"]

_TYPES = ("full_attention", "sliding_attention")


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window (``None``: full attention), as transformers assigns them."""
    window = getattr(config, "sliding_window", None)  # configs without sliding windows lack the field
    types = getattr(config, "layer_types", None)
    if types is None:
        return [window] * config.num_hidden_layers
    return [window if t == "sliding_attention" else None for t in types]


def positions(mask: torch.Tensor, start: int = 0) -> torch.Tensor:
    """The position of each slot from ``start`` on: a row counts only its real tokens.

    A masked slot (padding, a hole) gets its last real token's position; it is never used.
    """
    return (mask.long().cumsum(-1)[..., start:] - 1).clamp(min=0)


def near(query: torch.Tensor, key: torch.Tensor, window: int) -> torch.Tensor:
    """Whether a key is within a query's sliding window: fewer than ``window`` positions behind it.

    Measured in positions (real tokens), not slots: a row may have holes.
    """
    return query - key < window


def check_supported(model) -> None:
    """Refuse, with the reason, a model whose state cannot be cropped and rewound.

    Raises
    ------
    ValueError
        For recurrent or linear-attention layers (Mamba, RWKV, hybrids), chunked attention,
        or an attention implementation that takes no explicit masks.
    """
    config = model.config
    recurrent = {"mamba", "mamba2", "falcon_mamba", "rwkv", "jamba", "zamba", "zamba2", "bamba",
                 "recurrent_gemma", "xlstm", "lfm2", "granitemoehybrid", "qwen3_next", "falcon_h1"}
    if config.model_type in recurrent:
        raise ValueError(f"{config.model_type} models keep a recurrent state that cannot be cropped or "
                         "rewound: continuous needs attention layers whose cache it can cut at any token")
    types = getattr(config, "layer_types", None) or []
    unknown = sorted(set(types) - set(_TYPES))
    if unknown:
        raise ValueError(f"layer types {unknown} are not supported (only full and sliding-window attention): "
                         "their state cannot be cropped at any token")
    if config._attn_implementation not in ("sdpa", "eager"):
        raise ValueError(f"attention implementation {config._attn_implementation!r} takes no explicit masks; "
                         "load the model with attn_implementation='sdpa' or 'eager'")


def attention_masks(config, windows: list[int | None], embeds_like: torch.Tensor, mask: torch.Tensor | None,
                    cache, position_ids: torch.Tensor, holes: bool):
    """The ``attention_mask`` argument of a forward over slots ``[start, start + n)``.

    Parameters
    ----------
    config, windows
        The model's config and :func:`layer_windows`.
    embeds_like
        Any tensor ``[rows, n, ...]`` of the compute dtype and device.
    mask
        The 2D mask ``[rows, start + n]`` (0 on padding and holes), or ``None`` when every
        slot is a real token.
    cache
        The transformers ``Cache`` of the forward.
    position_ids
        ``[rows, n]``, counting real tokens only.
    holes
        Whether some row has a hole between two of its tokens (left padding is no hole).

    Returns
    -------
    The 2D mask (or ``None``) when transformers' masks are exact; otherwise the 4D mask,
    or a dict of them per layer kind (hybrid models).
    """
    sliding = [w is not None for w in windows]
    if mask is None or not holes or not any(sliding):
        return mask
    from transformers.masking_utils import create_causal_mask

    window = next(w for w in windows if w is not None)
    at = positions(mask)

    def within_window(batch_idx, head_idx, q_idx, kv_idx):
        return near(at[batch_idx, q_idx], at[batch_idx, kv_idx], window)

    windowed = create_causal_mask(config, embeds_like, mask, cache, position_ids,
                                  and_mask_function=within_window, layer_idx=sliding.index(True))
    if all(sliding):
        return windowed
    full = create_causal_mask(config, embeds_like, mask, cache, position_ids, layer_idx=sliding.index(False))
    return {"full_attention": full, "sliding_attention": windowed}
