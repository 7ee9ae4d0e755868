"""A span of transformer blocks loaded from a checkpoint, and the forward of one step."""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path

import torch
from torch import nn

from continuous.remote.memory import SessionCache

logger = logging.getLogger(__name__)


def load_config(model_path: str | Path):
    """The model's transformers config, with an attention implementation that takes explicit masks."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    config._attn_implementation = "sdpa"
    return config


def model_classes(config) -> tuple[type, type]:
    """The decoder layer and rotary embedding classes of a Llama-like architecture."""
    arch = (config.architectures or ["LlamaForCausalLM"])[0]
    prefix = arch.removesuffix("ForCausalLM")
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    try:
        return getattr(module, f"{prefix}DecoderLayer"), getattr(module, f"{prefix}RotaryEmbedding")
    except AttributeError:
        raise ValueError(f"unsupported architecture {arch}: no {prefix}DecoderLayer/RotaryEmbedding") from None


def read_weights(model_path: str | Path, prefixes: list[str]) -> dict[str, torch.Tensor]:
    """Read from the safetensors checkpoint only the tensors whose names start with ``prefixes``.

    Sharded checkpoints are read through their index, so only the shards that hold the
    wanted tensors are opened, and ``safe_open`` reads only the requested tensors.
    """
    from safetensors import safe_open

    path = Path(model_path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        with safe_open(path / "model.safetensors", framework="pt") as f:
            weight_map = {name: "model.safetensors" for name in f.keys()}
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        if any(name.startswith(p) for p in prefixes):
            by_file.setdefault(file, []).append(name)
    tensors = {}
    for file, names in by_file.items():
        with safe_open(path / file, framework="pt") as f:
            for name in names:
                tensors[name] = f.get_tensor(name)
    return tensors


class Blocks(nn.Module):
    """Blocks ``start:end`` of a Llama-like model, loaded without the rest of the checkpoint.

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
        layer_cls, rotary_cls = model_classes(config)
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
            layers.append(layer.eval())
        self.layers = nn.ModuleList(layers)
        self.rotary = rotary_cls(config=config).to(dtype).eval()
        logger.info("loaded blocks %d:%d of %s", start, end, model_path)

    def cache_nbytes(self, n_blocks: int, batch_size: int, max_length: int) -> int:
        return SessionCache.nbytes(n_blocks, batch_size, self.n_kv_heads, max_length, self.head_dim, self.dtype_)

    def new_cache(self, start: int, end: int, batch_size: int, max_length: int) -> SessionCache:
        return SessionCache(start, end - start, batch_size, self.n_kv_heads, max_length, self.head_dim, self.dtype_)

    @torch.inference_mode()
    def step(self, cache: SessionCache, start: int, end: int, hidden: torch.Tensor, start_position: int,
             hypo_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
             position_ids: torch.Tensor | None) -> torch.Tensor:
        """Run blocks ``start:end`` over new hidden states, extending the session's cache.

        The caller has checked every argument against the session (see the handler).
        ``attention_mask`` is 2D, [rows, start_position + n] of 0/1; ``position_ids`` is
        [rows, n]; without them the step is plainly causal at positions
        ``start_position .. start_position + n``.
        """
        rows, n, _ = hidden.shape
        cache.prepare(start_position, rows, hypo_ids)
        x = hidden.to(self.dtype_)
        if position_ids is None:
            position_ids = torch.arange(start_position, start_position + n).expand(rows, n)
        mask = self._mask(rows, start_position, n, attention_mask)
        position_embeddings = self.rotary(x, position_ids)
        for layer in self.layers[start - self.start : end - self.start]:
            x = layer(x, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                      position_embeddings=position_embeddings)
        cache.commit(n)
        return x.to(hidden.dtype)

    def _mask(self, rows: int, start: int, n: int, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        if attention_mask is None and (start == 0 or n == 1):
            # Plain causal attention: sdpa's own causal path, the one the local model takes too.
            return None
        total = start + n
        query = torch.arange(start, total)[:, None]
        key = torch.arange(total)[None, :]
        allowed = (key <= query)[None].expand(rows, n, total)
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, :].bool()
        # A query always sees itself, so a row whose keys are all masked cannot yield NaN.
        allowed = allowed | (key == query)[None]
        mask = torch.zeros(rows, 1, n, total, dtype=self.dtype_)
        return mask.masked_fill_(~allowed[:, None], torch.finfo(self.dtype_).min)
