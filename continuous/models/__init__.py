"""Backends: ``models.transformers`` (local), ``models.remote`` (a hivemind swarm) and
``models.llamacpp`` (a GGUF file run by llama.cpp, an optional extra)."""

from .base import Cache, Model, Stats
from .llamacpp import LlamaCpp, llamacpp
from .remote import Remote, remote
from .transformers import Transformers, transformers

__all__ = ["Model", "Cache", "Stats", "Transformers", "transformers", "Remote", "remote", "LlamaCpp", "llamacpp"]
