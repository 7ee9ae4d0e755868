"""What client and server both read from a checkpoint: config, architecture, weights.

The swarm runs a model split in two: the client holds the embeddings, the final norm
and the head; servers hold spans of decoder blocks. Each side needs to know what the
architecture does besides its blocks (Gemma scales embeddings and caps logits), so the
architecture table lives here, where neither side has to import the other.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Architecture:
    """What the swarm must reproduce of a model family outside its plain decoder blocks.

    ``prefix`` names the transformers classes (``{prefix}DecoderLayer``,
    ``{prefix}RotaryEmbedding``, ``{prefix}RMSNorm``); ``attention`` is the
    attention implementation the servers run (Gemma 2 needs eager attention for its
    attention-logit softcapping); ``embed_scale`` multiplies embeddings by
    sqrt(hidden_size), as Gemma does.
    """

    prefix: str
    attention: str = "sdpa"
    embed_scale: bool = False


#: model_type -> what it needs; anything else is refused (see :func:`architecture`).
ARCHITECTURES = {
    "llama": Architecture("Llama"),
    "mistral": Architecture("Mistral"),
    "qwen2": Architecture("Qwen2"),
    "gemma2": Architecture("Gemma2", attention="eager", embed_scale=True),
}


def architecture(config) -> Architecture:
    """The swarm's description of ``config``'s architecture, or a clear refusal.

    Raises
    ------
    ValueError
        The architecture is not one the swarm reproduces exactly; the message says why.
    """
    model_type = getattr(config, "model_type", None)
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        raise ValueError(
            f"architecture {model_type!r} ({', '.join(config.architectures or ['?'])}) is not supported on the swarm: "
            f"its blocks, masks and scalings have no server-side implementation here (supported: "
            f"{', '.join(sorted(ARCHITECTURES))})")
    return arch


def load_config(model_path: str | Path):
    """The model's transformers config, with the attention implementation the servers run.

    Raises
    ------
    ValueError
        The architecture is not supported on the swarm.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    config._attn_implementation = architecture(config).attention
    return config


def model_class(config, suffix: str) -> type:
    """The transformers class ``{prefix}{suffix}`` of ``config``'s architecture (``DecoderLayer``...)."""
    model_type = config.model_type
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    name = architecture(config).prefix + suffix
    try:
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"architecture {model_type!r} has no class {name} in this transformers version") from None


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
