"""CUDA graphs of compiled steps, replayed from whichever thread runs the step.

``torch.compile(mode="reduce-overhead")`` records CUDA graphs in "graph trees" whose
manager lives in thread-local state. A model's steps run on the thread that drives the
engine's step, which changes from call to call (each caller's thread, an async call's
worker). torch 2.11 then fails on any thread but the one that compiled
(``assert torch._C._is_key_in_tls``), and later versions give each thread graphs and a
memory pool of its own. Steps run one at a time, so every thread can share the
manager of the thread that made the model, as autograd's worker threads do.
"""

from __future__ import annotations

import torch

__all__ = ["GraphTrees"]

_KEYS = ("tree_manager_containers", "tree_manager_locks")


class GraphTrees:
    """The graph trees' thread-local state of the thread that makes this, for other threads to use.

    Call :meth:`share` on a thread before it runs a compiled step. Without the private
    hooks this relies on (another torch version), it does nothing.
    """

    def __init__(self):
        self.state = {}
        try:
            from torch._inductor import cudagraph_trees as trees

            self.state = {key: trees.get_obj(trees.local, key) for key in _KEYS}
        except (ImportError, AttributeError, AssertionError):  # pragma: no cover - another torch
            pass

    def share(self) -> None:
        """Make the calling thread use the shared state (a no-op where it already has some)."""
        for key, obj in self.state.items():
            if not torch._C._is_key_in_tls(key):
                torch._C._stash_obj_in_tls(key, obj)
