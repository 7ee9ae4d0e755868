"""Backends: ``models.transformers`` (local) and ``models.remote`` (a hivemind swarm)."""

from .base import Cache, Model, Stats
from .remote import Remote, remote
from .transformers import Transformers, transformers

__all__ = ["Model", "Cache", "Stats", "Transformers", "transformers", "Remote", "remote"]
