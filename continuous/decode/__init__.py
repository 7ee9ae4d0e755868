"""The decode step: the loop and the named units it is made of.

- :mod:`.loop`: prepare (heal, top up, fork), then per step: logits processors, the
  sampler, the one host transfer, reorder, advance each row, forward.
- :mod:`.prefill`: forward what a call's cache does not cover.
- :mod:`.grid`: the slots, holes and attention mask a call appends to.
- :mod:`.rows`: per-row text, stop strings, bans and rewinds.
- :mod:`.constraints`: each row's constraint matcher and allowed tokens on the device.
- :mod:`.processors`: what shapes the scores before the sampler.
- :mod:`.overlap`: the host transfer and the step queued behind it.
"""

from .loop import Decoding, Generation, Options
from .prefill import top_up

__all__ = ["Decoding", "Generation", "Options", "top_up"]
