"""A span of transformer blocks loaded from a checkpoint, and the forward of one step."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from continuous.kv import CACHE_ARG
from continuous.models.masks import layer_windows, near
from continuous.remote.server.memory import MemoryBudget, SessionCache
from continuous.remote.wire.checkpoint import load_config, model_class, read_weights

logger = logging.getLogger(__name__)


@dataclass
class Step:
    """One session's step, as :meth:`Blocks.step` takes it (see there)."""

    cache: SessionCache
    hidden: torch.Tensor
    start_position: int
    hypo_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None


class _PerSession(list):
    """Keys, values or masks of a batched step, one per session (see :func:`_attention`).

    ``shapes`` holds each session's (rows, new tokens): in a batched step the sessions'
    new tokens lie end to end in one sequence (see :meth:`Blocks.step_batch`).
    """

    def __init__(self, items=(), shapes=()):
        super().__init__(items)
        self.shapes = list(shapes)


def _split(x: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Each session's part of [1, heads, tokens, dim], as a [rows, heads, n, dim] view."""
    parts, a = [], 0
    for rows, n in shapes:
        parts.append(x[0, :, a : a + rows * n].unflatten(1, (rows, n)).transpose(0, 1))
        a += rows * n
    return parts


class _BatchCache:
    """The caches of the sessions of one batched step, seen by attention layers as one.

    ``update`` writes each session's new keys and values into its own cache and returns
    views of every session's keys and values, unpadded and uncopied: attention then runs
    for each session on its own cache, as it does when the session is alone.
    """

    def __init__(self, caches: list[SessionCache], shapes: list[tuple[int, int]]):
        self.caches, self.shapes = caches, shapes

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = _PerSession(shapes=self.shapes), _PerSession(shapes=self.shapes)
        for cache, k, v in zip(self.caches, _split(key, self.shapes), _split(value, self.shapes)):
            k, v = cache.update(k, v, layer_idx)
            keys.append(k)
            values.append(v)
        return keys, values


#: The attention implementation of every loaded block (registered with transformers).
_ATTENTION = "continuous_per_session"


def _attention(module: nn.Module, query: torch.Tensor, key, value, attention_mask, **kwargs):
    """Attention of a step: the block's own implementation, once per session of a batch.

    The projections and MLPs of a batch run on all its tokens at once; attention, which
    reads each session's own cache, runs per session on its rows and tokens, exactly as
    alone: no keys are copied into a padded batch, and each session keeps sdpa's causal
    path when it has no mask.
    """
    inner = module.continuous_attention
    if not isinstance(key, _PerSession):
        return inner(module, query, key, value, attention_mask, **kwargs)
    outs = [inner(module, q, k, v, mask, **kwargs)[0].flatten(0, 1)  # [rows, n, heads, dim] -> [rows * n, ...]
            for q, k, v, mask in zip(_split(query, key.shapes), key, value, attention_mask)]
    return torch.cat(outs)[None], None


AttentionInterface.register(_ATTENTION, _attention)


class Blocks(nn.Module):
    """Blocks ``start:end`` of a supported model (see ``checkpoint.ARCHITECTURES``), loaded alone.

    Parameters
    ----------
    model_path
        Directory of the model (config and safetensors weights).
    start, end
        The span of blocks, ``end`` excluded.
    dtype
        Dtype of weights, computation and cache.
    """

    def __init__(self, model_path: str | Path, start: int, end: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        config = load_config(model_path)
        if not 0 <= start < end <= config.num_hidden_layers:
            raise ValueError(f"blocks {start}:{end} out of range for a model of {config.num_hidden_layers} blocks")
        layer_cls, rotary_cls = model_class(config, "DecoderLayer"), model_class(config, "RotaryEmbedding")
        self.windows = layer_windows(config)
        # Eager attention (Gemma 2) has no causal path of its own: it always needs a mask.
        self.needs_mask = config._attn_implementation == "eager"
        self.config, self.start, self.end, self.dtype_ = config, start, end, dtype
        self.hidden_size = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.max_position = config.max_position_embeddings

        weights = read_weights(model_path, [f"model.layers.{i}." for i in range(start, end)])
        layers = []
        for i in range(start, end):
            # Built on the meta device: no time is spent on a random init that is overwritten.
            with torch.device("meta"):
                layer = layer_cls(config, i)
            prefix = f"model.layers.{i}."
            state = {k[len(prefix):]: v.to(dtype) for k, v in weights.items() if k.startswith(prefix)}
            layer.load_state_dict(state, strict=True, assign=True)
            # The implementation the config asks for (the model's own eager one by default),
            # which _attention runs for each session of a batch.
            attention = layer.self_attn
            attention.continuous_attention = ALL_ATTENTION_FUNCTIONS.get_interface(
                config._attn_implementation, sys.modules[type(attention).__module__].eager_attention_forward)
            layers.append(layer.eval())
        self.layers = nn.ModuleList(layers)
        self.rotary = rotary_cls(config=config).to(dtype).eval()
        config._attn_implementation = _ATTENTION
        logger.info("loaded blocks %d:%d of %s", start, end, model_path)

    def cache_nbytes(self, n_blocks: int, batch_size: int, max_length: int) -> int:
        """Bytes of cache of ``batch_size`` rows of ``max_length`` positions over ``n_blocks`` blocks."""
        return SessionCache.nbytes_for(n_blocks, batch_size, self.n_kv_heads, max_length, self.head_dim,
                                       self.dtype_)

    def new_cache(self, start: int, end: int, max_length: int, budget: MemoryBudget) -> SessionCache:
        """An empty cache for blocks ``start:end``, growing on demand within ``budget``."""
        return SessionCache(start, end - start, self.n_kv_heads, max_length, self.head_dim, self.dtype_, budget)

    def step(self, cache: SessionCache, start: int, end: int, hidden: torch.Tensor, start_position: int,
             hypo_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
             position_ids: torch.Tensor | None) -> torch.Tensor:
        """Run blocks ``start:end`` over new hidden states, extending the session's cache.

        The caller has checked every argument against the session (see the handler).
        ``attention_mask`` is 2D, [rows, start_position + n] of 0/1; ``position_ids`` is
        [rows, n]; without them the step is plainly causal at positions
        ``start_position .. start_position + n``.
        """
        return self.step_batch(start, end, [Step(cache, hidden, start_position, hypo_ids, attention_mask,
                                                 position_ids)])[0]

    @torch.inference_mode()
    def step_batch(self, start: int, end: int, steps: list["Step"]) -> list[torch.Tensor]:
        """Run the steps of several sessions as one forward of blocks ``start:end``.

        Each session keeps its own cache, positions and mask, and its own number of rows
        and of new tokens (decode steps, prefill chunks, forced runs share one forward):
        the new tokens of all steps lie end to end as one sequence for the projections and
        MLPs, and attention runs per session on its own cache (see :func:`_attention`). Row
        for row the result is that of each step alone, up to the rounding of differently
        shaped matrix products.
        """
        shapes = [tuple(s.hidden.shape[:2]) for s in steps]
        masks = {w: _PerSession(shapes=shapes) for w in set(self.windows[start:end])}
        for s in steps:
            rows, n = s.hidden.shape[:2]
            s.cache.prepare(s.start_position, rows, n, s.hypo_ids)
            if s.position_ids is None:
                s.position_ids = torch.arange(s.start_position, s.start_position + n).expand(rows, n)
            slot_positions = s.cache.write_positions(s.position_ids)
            for w, out in masks.items():
                out.append(self._mask(s.start_position, n, s.attention_mask, slot_positions, w))
        if len(steps) == 1:
            s = steps[0]
            mask, cache, x, position_ids = {w: ms[0] for w, ms in masks.items()}, s.cache, s.hidden, s.position_ids
        else:
            mask, cache = masks, _BatchCache([s.cache for s in steps], shapes)
            x = torch.cat([s.hidden.flatten(0, 1) for s in steps])[None]
            position_ids = torch.cat([s.position_ids.flatten() for s in steps])[None]
        x = x.to(self.dtype_)
        position_embeddings = self.rotary(x, position_ids)
        for i, layer in enumerate(self.layers[start - self.start : end - self.start], start):
            x = layer(x, attention_mask=mask[self.windows[i]], position_ids=position_ids, **{CACHE_ARG: cache},
                      position_embeddings=position_embeddings)
        for s in steps:
            s.cache.commit(s.hidden.shape[1])
        if len(steps) == 1:
            return [x.to(steps[0].hidden.dtype)]
        outs = x[0].split([s.hidden.shape[0] * s.hidden.shape[1] for s in steps])
        return [out.unflatten(0, s.hidden.shape[:2]).to(s.hidden.dtype) for out, s in zip(outs, steps)]

    def _mask(self, start: int, n: int, attention_mask: torch.Tensor | None, positions: torch.Tensor,
              window: int | None) -> torch.Tensor | None:
        """The additive attention mask of one step: the one place masks are built on the swarm.

        Keys are slots: a query sees the slots up to its own that ``attention_mask`` keeps,
        and, under a sliding window, only those less than ``window`` *positions* behind it.
        Positions, not slot distances: a row may have masked holes in the middle, and the
        window counts real tokens, as it does locally on the unpadded sequence. ``None``
        (sdpa's own causal path) where that is the same.
        """
        rows, total = positions.shape
        windowed = window is not None and int(positions.max() - positions.min()) >= window
        if attention_mask is None and not windowed and not self.needs_mask and (start == 0 or n == 1):
            # Plain causal attention: sdpa's own causal path, the one the local model takes too.
            return None
        query = torch.arange(start, total)[:, None]
        key = torch.arange(total)[None, :]
        allowed = (key <= query)[None].expand(rows, n, total)
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, :].bool()
        if windowed:
            allowed = allowed & near(positions[:, start:, None], positions[:, None, :], window)
        # A query always sees itself, so a row whose keys are all masked cannot yield NaN.
        allowed = allowed | (key == query)[None]
        mask = torch.zeros(rows, 1, n, total, dtype=self.dtype_)
        return mask.masked_fill_(~allowed[:, None], torch.finfo(self.dtype_).min)
