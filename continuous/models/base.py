"""What a backend offers to the decoding loop.

A backend owns a tokenizer, counts its work in :class:`Stats`, and runs one forward
pass over the slots of a padded layout that its cache does not cover yet. The cache
object it returns is a :class:`Cache`: a value that states crop and select rows of,
and never look inside.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Stats", "Model", "Cache", "check_layout", "stop_ids"]


#: Stats that say what runs now, not counters: ``reset`` leaves them.
_GAUGES = ("calls_running", "calls_waiting", "rows_in_use", "kv_bytes_in_use")
#: Times, which no two runs share: ``snapshot`` leaves them out.
_TIMES = ("step_host_seconds", "step_forward_seconds")


@dataclass
class Stats:
    """Counters of the work a model did.

    Attributes
    ----------
    tokens_forwarded
        Token positions sent through the transformer blocks (prefill and decode
        together), padding and holes of a batch excluded.
    forward_calls
        Forward passes.
    positions_forwarded
        Slots sent through the blocks including padding: what a batch really costs.
    tokens_rewound
        Forwarded tokens that a rewind (``ban=``) took back: counted in
        ``tokens_forwarded`` too, they are the cost of backtracking.
    tokens_cached
        Prompt tokens the prefix cache supplied: not forwarded.
    tokens_drafted
        Tokens a speculative call proposed and the model checked (``speculate=``).
    tokens_accepted
        Drafted tokens the check kept.
    steps, step_rows, step_host_seconds, step_forward_seconds
        The engine's steps (those that forwarded), the rows they forwarded, and the time
        they spent on the host (the calls' work between forwards) and in forwards; see
        ``rows_per_step``, ``host_ms_per_step`` and ``forward_ms_per_step``.
    calls_running, calls_waiting, rows_in_use, kv_bytes_in_use
        Now (not counters): the calls the engine holds and those waiting for room, the
        rows and KV bytes the running calls reserve.
    """

    tokens_forwarded: int = 0
    forward_calls: int = 0
    positions_forwarded: int = 0
    tokens_rewound: int = 0
    tokens_cached: int = 0
    tokens_drafted: int = 0
    tokens_accepted: int = 0
    steps: int = 0
    step_rows: int = 0
    step_host_seconds: float = 0.0
    step_forward_seconds: float = 0.0
    calls_running: int = 0
    calls_waiting: int = 0
    rows_in_use: int = 0
    kv_bytes_in_use: int = 0
    # Threads share a model: every update holds the lock, so no count is lost.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def reset(self) -> None:
        """Set every counter and time back to zero (the gauges of what runs now stay)."""
        with self._lock:
            for name in self._counters() + list(_TIMES):
                setattr(self, name, 0)

    def record_step(self, rows: int, host: float, forward: float) -> None:
        """Count one engine step that forwarded ``rows`` rows, with its host and forward seconds."""
        with self._lock:
            self.steps += 1
            self.step_rows += rows
            self.step_host_seconds += host
            self.step_forward_seconds += forward

    def set_gauges(self, **now: int) -> None:
        """Set what runs now (``calls_running``, ``calls_waiting``, ``rows_in_use``, ``kv_bytes_in_use``)."""
        with self._lock:
            for name, value in now.items():
                setattr(self, name, value)

    @property
    def rows_per_step(self) -> float:
        """Rows an engine step forwarded, on average."""
        return self.step_rows / self.steps if self.steps else 0.0

    @property
    def host_ms_per_step(self) -> float:
        """Milliseconds an engine step spent on the host (its calls' work), on average."""
        return 1000 * self.step_host_seconds / self.steps if self.steps else 0.0

    @property
    def forward_ms_per_step(self) -> float:
        """Milliseconds an engine step spent in forwards, on average."""
        return 1000 * self.step_forward_seconds / self.steps if self.steps else 0.0

    def record(self, tokens: int, positions: int) -> None:
        """Count one forward pass over ``positions`` slots of which ``tokens`` are real tokens."""
        with self._lock:
            self.forward_calls += 1
            self.tokens_forwarded += tokens
            self.positions_forwarded += positions

    def record_rewound(self, tokens: int) -> None:
        """Count forwarded tokens that a rewind took back."""
        with self._lock:
            self.tokens_rewound += tokens

    def record_cached(self, tokens: int) -> None:
        """Count prompt tokens that the prefix cache supplied."""
        with self._lock:
            self.tokens_cached += tokens

    def record_draft(self, drafted: int, accepted: int) -> None:
        """Count ``drafted`` tokens checked in one forward, of which ``accepted`` were kept."""
        with self._lock:
            self.tokens_drafted += drafted
            self.tokens_accepted += accepted

    def snapshot(self) -> dict:
        """The counters as a dict, to compare before and after an operation (times and gauges
        left out)."""
        with self._lock:
            return {name: getattr(self, name) for name in self._counters()}

    @classmethod
    def _counters(cls) -> list[str]:
        return [f.name for f in fields(cls) if not f.name.startswith("_") and f.name not in _GAUGES + _TIMES]


class Cache(Protocol):
    """What a backend's cache offers: a value covering the first ``length`` slots of its rows."""

    length: int
    #: Whether its slots can move (:meth:`gather_rows_slots`): a local cache squeezes out
    #: holes that way; a swarm session cannot move what the servers hold.
    movable: bool

    def crop(self, length: int) -> "Cache | None":
        """The view on the first ``min(length, self.length)`` slots (``None`` when empty)."""

    def settle(self) -> None:
        """Make the value hold only its own rows' memory: a view of rows in a buffer shared with
        other calls' rows copies them out (done once a call ends, so that its state is a value)."""

    def release(self, length: int) -> None:
        """This view is being dropped for its first ``length`` slots: what it held past them
        may be written over (a crop that the next forward appends to in place)."""

    def select_rows(self, rows: torch.Tensor) -> "Cache":
        """The cache of the given rows (indices may repeat, for forks and beams)."""

    def gather_rows_slots(self, rows: torch.Tensor, slots: torch.Tensor) -> "Cache | None":
        """Only where ``movable``: row ``i`` slot ``j`` of the result is row ``rows[i]`` slot ``slots[i, j]``."""

    def storage(self) -> tuple[object, int]:
        """What holds the memory (shared by every view grown from one computation), and its
        size in bytes in this process (0 where the memory is elsewhere, as on a swarm)."""


@runtime_checkable
class Model(Protocol):
    """A backend: the local transformers one or the swarm one."""

    tokenizer: Any
    stats: Stats
    vocab_size: int  # width of the logits
    max_length: int  # context length (positions)
    device: torch.device  # where logits come back and where the decoding loop works
    #: Whether the decoding loop queues each step before the host has read the last one's
    #: tokens (it pays where the device runs asynchronously).
    overlap: bool
    #: The ids that end a row (:func:`stop_ids`).
    eos_token_ids: tuple[int, ...]
    #: Steps the calls running at the same time, merging their forwards (:mod:`.engine`), or
    #: ``None`` where each call runs alone (a swarm's model, whose servers batch sessions).
    engine: Any
    #: Recent states that prompts starting like them reuse (:mod:`continuous.prefix`), or ``None``.
    prefix_cache: Any

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: Any,
                logits_to_keep: int = 1, *, n_real: int | None = None, holes: bool = True,
                ) -> tuple[torch.Tensor, Any]:
        """Run the slots after ``cache.length`` and return (logits of the last slots, new cache).

        ``input_ids`` is ``[rows, n]`` (the uncovered slots), ``attention_mask`` is
        ``[rows, cache_length + n]`` over the whole layout (0 marks padding and holes), or
        ``None`` when every slot is a real token; both may live on the model's device,
        where the logits are returned.
        ``n_real`` is the number of real tokens among the new slots when the caller
        knows it (else it is counted from the mask); ``holes`` says whether some row
        may have a hole between two of its tokens.
        """
        ...


def stop_ids(tokenizer, generation_config=None) -> tuple[int, ...]:
    """The ids HF ``generate`` stops on: the tokenizer's EOS, then every EOS of the generation config.

    Chat models often end a turn with another token than their tokenizer's EOS
    (``<end_of_turn>``, ``<|end|>``, ``<|eot_id|>``), listed in ``generation_config.json``.
    """
    ids = [tokenizer.eos_token_id]
    extra = generation_config.eos_token_id if generation_config is not None else None
    ids += extra if isinstance(extra, (list, tuple)) else [extra]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def check_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int) -> None:
    """The mask must cover the ``start`` cached slots and the new ones, row for row."""
    rows, n = input_ids.shape
    if tuple(attention_mask.shape) != (rows, start + n):
        raise ValueError(f"attention mask {tuple(attention_mask.shape)} does not cover the cache "
                         f"({start}) and the {n} new slots of {rows} rows")
