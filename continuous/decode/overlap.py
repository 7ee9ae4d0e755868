"""The next step queued behind the host's read of the sampled ids.

On a device that runs asynchronously (CUDA), the host reads each step's chosen ids
while the device already computes the next step on them: the queued step is kept if
the step turns out plain (every row goes on with its sampled token), else given back.
"""

from __future__ import annotations

import torch

__all__ = ["Queued"]


class Queued:
    """A decode step forwarded on the sampled ids before the host has read them.

    Parameters
    ----------
    model
        The backend.
    ids
        ``[rows, 1]`` the sampled ids, on the device (the step's input).
    cache
        The cache the step continues.
    """

    def __init__(self, model, ids: torch.Tensor, cache):
        self.model, self.start = model, cache.length
        self.rows = ids.shape[0]
        self.logits, self.cache = model.forward(ids, None, cache, logits_to_keep=1, n_real=self.rows,
                                                holes=False)

    def take(self) -> tuple[torch.Tensor, object]:
        """The step's last logits and cache: the step was what the loop would have forwarded."""
        return self.logits[:, -1], self.cache

    def give_back(self, count: bool = True) -> None:
        """Discard the step: its slots go back to the buffer, its tokens count as rewound."""
        self.cache.release(self.start)
        if count:
            self.model.stats.record_rewound(self.rows)
