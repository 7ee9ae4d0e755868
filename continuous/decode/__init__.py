"""The decode step: the loop and the named units it is made of.

- :mod:`.options`: what a call asks of the loop, checked once (``Options.from_call``).
- :mod:`.loop`: prepare (heal, top up, fork), then per step: processors, the sampler,
  the one host transfer, reorder, advance each row, forward; a coroutine that yields its
  forwards to the model's engine (:mod:`continuous.models.engine`), or runs alone (``drive``).
- :mod:`.batch`: every per-row array of a call, reordered together.
- :mod:`.joined`: calls that start together stepped as one table of rows, each call
  leaving with its own rows once they are done.
- :mod:`.rows`: each row's text part (pieces, stop strings, streaming) and history part
  (tokens, bans, what a rewind undoes).
- :mod:`.finish`: why a row stopped.
- :mod:`.constraints`: each row's constraint matcher and allowed tokens on the device (the
  loop's one way to the engines).
- :mod:`.processors`: what shapes the scores before the sampler.
- :mod:`.prefill`: forward what a call's cache does not cover (``top_up_steps``: as a coroutine).
- :mod:`.grid`: the slots, holes and attention mask a call appends to.
- :mod:`.overlap`: the host transfer and the step queued behind it.
- :mod:`.speculate`: drafts (prompt lookup, a draft model) checked in a step's forward
  (``speculate=``), and the step object the loop calls for them.
- :mod:`.result`: the rows and texts a call hands back.
"""

from .finish import Finish
from .loop import Decoding
from .options import Options, check_rewinds
from .prefill import top_up
from .result import Generation

__all__ = ["Decoding", "Finish", "Generation", "Options", "check_rewinds", "top_up"]
