"""The local backend: a transformers causal LM whose KV cache is a :class:`~continuous.kv.KVCache`."""

from __future__ import annotations

import logging
import weakref

import torch

from ..kv import ForwardCache, KVCache
from .base import Stats, check_layout
from .masks import attention_masks, check_supported, layer_kinds

__all__ = ["Transformers", "transformers"]

logger = logging.getLogger(__name__)

_WRAPPED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class Transformers:
    """A local transformers causal LM.

    Use :func:`transformers` to build one. Attributes: ``model`` (the HF model),
    ``tokenizer`` (a fast HF tokenizer), ``stats``, ``vocab_size``, ``max_length``,
    ``device``.

    Every method may be called from several threads at once: the cache claims the slots
    it appends under a lock and the counters are atomic. The HF model itself must then
    be safe to call concurrently (inference-mode PyTorch modules are).
    """

    def __init__(self, model, tokenizer):
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError("continuous needs a fast (Rust) tokenizer: it maps characters to tokens "
                            "with offset mappings")
        check_supported(model)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.stats = Stats()
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_length = int(getattr(model.config, "max_position_embeddings", 0)
                              or getattr(model.config, "n_positions", 0) or 10**9)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.kinds = layer_kinds(model.config)

    def __repr__(self) -> str:
        return f"models.transformers({type(self.model).__name__}, vocab={self.vocab_size})"

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: KVCache | None,
                logits_to_keep: int = 1, *, n_real: int | None = None, holes: bool = True,
                ) -> tuple[torch.Tensor, KVCache]:
        """Forward the slots the cache does not cover; see :class:`~continuous.models.base.Model`.

        Returns float32 logits on the model's device.
        """
        rows, n = input_ids.shape
        start = cache.length if cache is not None else 0
        device = self.device
        input_ids = input_ids.to(device, non_blocking=True)
        if attention_mask is None:  # every slot is a real token: plain causal attention
            positions = torch.arange(start, start + n, device=device).expand(rows, n)
            mask, n_real = None, rows * n
        else:
            check_layout(input_ids, attention_mask, start)
            if n_real is None:
                n_real = int(attention_mask[:, start:].sum())
            mask = attention_mask.to(device, non_blocking=True)
            positions = (mask.long().cumsum(-1)[:, start:] - 1).clamp(min=0)
        fc = ForwardCache(cache, rows, n, self.kinds)
        try:
            with torch.inference_mode():
                embeds_like = torch.empty((rows, n, 0), dtype=self.dtype, device=device)
                masks = attention_masks(self.model.config, self.kinds, embeds_like, mask, fc, positions, holes)
                out = self.model(input_ids=input_ids, attention_mask=masks, position_ids=positions,
                                 past_key_values=fc, use_cache=True, logits_to_keep=logits_to_keep)
        except BaseException:
            fc.abort()
            raise
        self.stats.record(n_real, rows * n)
        return out.logits.float(), fc.result()


def transformers(model_or_path, tokenizer=None, *, device=None, dtype=None) -> Transformers:
    """A local transformers model.

    Parameters
    ----------
    model_or_path
        A path or hub name (loaded with ``AutoModelForCausalLM`` and ``AutoTokenizer``),
        or a loaded ``PreTrainedModel``, taken as it is.
    tokenizer
        A loaded fast tokenizer; loaded from ``model_or_path`` when omitted.
    device, dtype
        Where and in which dtype to load or move the model.

    Returns
    -------
    Transformers
        The same object for the same loaded HF model, so its ``stats`` are shared.

    Raises
    ------
    ValueError
        For a model whose state cannot be cropped (Mamba, linear attention, chunked
        attention), with the reason.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(model_or_path, (str, bytes)) or hasattr(model_or_path, "__fspath__"):
        path = str(model_or_path)
        kwargs = {"dtype": dtype} if dtype is not None else {}
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path)
    else:
        model = model_or_path
        if tokenizer is None:
            raise TypeError("models.transformers(model) needs the tokenizer when given a loaded model")
    if device is not None or dtype is not None:
        model = model.to(device=device, dtype=dtype)
    wrapped = _WRAPPED.get(model)
    if wrapped is None or wrapped.tokenizer is not tokenizer:
        wrapped = Transformers(model, tokenizer)
        _WRAPPED[model] = wrapped
    return wrapped
