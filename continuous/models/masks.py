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

__all__ = ["layer_kinds", "check_supported", "attention_masks"]

_KINDS = {"full_attention": False, "sliding_attention": True}


def layer_kinds(config) -> list[bool]:
    """Per layer, whether it is a sliding-window layer."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is not None:
        return [_KINDS[t] for t in types]
    return [getattr(config, "sliding_window", None) is not None] * n


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
    unknown = sorted(set(types) - set(_KINDS))
    if unknown:
        raise ValueError(f"layer types {unknown} are not supported (only full and sliding-window attention): "
                         "their state cannot be cropped at any token")
    if config._attn_implementation not in ("sdpa", "eager"):
        raise ValueError(f"attention implementation {config._attn_implementation!r} takes no explicit masks; "
                         "load the model with attn_implementation='sdpa' or 'eager'")


def attention_masks(config, kinds: list[bool], embeds_like: torch.Tensor, mask: torch.Tensor | None,
                    cache, position_ids: torch.Tensor, holes: bool):
    """The ``attention_mask`` argument of a forward over slots ``[start, start + n)``.

    Parameters
    ----------
    config, kinds
        The model's config and :func:`layer_kinds`.
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
    if mask is None or not holes or not any(kinds):
        return mask
    from transformers.masking_utils import create_causal_mask

    window = config.sliding_window
    positions = mask.long().cumsum(-1) - 1

    def within_window(batch_idx, head_idx, q_idx, kv_idx):
        return positions[batch_idx, q_idx] - positions[batch_idx, kv_idx] < window

    sliding = create_causal_mask(config, embeds_like, mask, cache, position_ids,
                                 and_mask_function=within_window, layer_idx=kinds.index(True))
    if all(kinds):
        return sliding
    full = create_causal_mask(config, embeds_like, mask, cache, position_ids, layer_idx=kinds.index(False))
    return {"full_attention": full, "sliding_attention": sliding}
