"""The swarm backend: embeddings and head local, blocks on servers, the cache in a remote session.

A state's cache is a :class:`RemoteCache` view ``(session, length, rows)`` on a server
session. Sessions hold one history per row; views share it as long as it still holds
their slots:

- continuing the newest view appends at the session's position;
- continuing an older or cropped view rewinds the session to it (``start_position``);
  views that went further are then cut back to what the session still holds, and
  recompute only what they lost;
- continuing a view of selected, reordered or repeated rows sends ``hypo_ids``; the
  session's rows change, so views of the old rows lose their cache (recomputed on use).

Sessions are closed when no state refers to them anymore.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import itertools
import logging
import weakref

import torch

from .base import Stats, check_layout, stop_ids
from .masks import positions

__all__ = ["Remote", "RemoteCache", "remote"]

logger = logging.getLogger(__name__)

_ids = itertools.count(1)


class _Chunk:
    """Slots ``[start, end)`` written by one step, on top of ``parent``."""

    __slots__ = ("parent", "start", "end", "id")

    def __init__(self, parent: "_Chunk | None", start: int, end: int):
        self.parent, self.start, self.end, self.id = parent, start, end, next(_ids)


class _Handle:
    """One server session, and which of the chunks written into it it still holds."""

    def __init__(self, session):
        self.session = session
        self.live: list[_Chunk] = []  # chunks the session holds, by position
        self.live_end: dict[int, int] = {}  # chunk id -> end of what is still held
        self.epoch = 0  # changes when the session's rows are selected or reordered
        # Close the servers' side when no view refers to the session anymore.
        self._finalizer = weakref.finalize(self, _close, session)

    def held(self, chunk: _Chunk | None, length: int, epoch: int) -> int:
        """How many leading slots of a view (last chunk, length, epoch) the session still holds."""
        if epoch != self.epoch:
            return 0
        while chunk is not None:
            end = self.live_end.get(chunk.id)
            if end is not None:
                return min(end, length)
            chunk = chunk.parent
        return 0

    def write(self, start: int, n: int) -> _Chunk:
        """Record that a step wrote ``n`` slots at ``start`` (dropping what was after it)."""
        while self.live and self.live[-1].start >= start:
            del self.live_end[self.live.pop().id]
        parent = self.live[-1] if self.live else None
        if parent is not None:
            self.live_end[parent.id] = min(self.live_end[parent.id], start)
        chunk = _Chunk(parent, start, start + n)
        self.live.append(chunk)
        self.live_end[chunk.id] = chunk.end
        return chunk


def _close(session) -> None:
    try:
        session.close()
    except Exception:  # closing is best effort: the servers time idle sessions out anyway
        logger.debug("closing a remote session failed", exc_info=True)


class RemoteCache:
    """A state's view on a remote session: its first ``length`` slots, for the given rows."""

    __slots__ = ("_handle", "_chunk", "_length", "_epoch", "_rows", "__weakref__")
    movable = False  # the servers hold the slots where they were written

    def __init__(self, handle: _Handle, chunk: _Chunk | None, length: int, epoch: int,
                 rows: torch.Tensor | None = None):
        self._handle, self._chunk, self._length = handle, chunk, length
        self._epoch, self._rows = epoch, rows

    @property
    def length(self) -> int:
        """Slots the session still holds for this view (less than it had if another view rewound it)."""
        return self._handle.held(self._chunk, self._length, self._epoch)

    @property
    def rows(self) -> int:
        return len(self._rows) if self._rows is not None else self._handle.session.rows

    @property
    def session(self):
        """The :class:`~continuous.remote.InferenceSession` holding this cache (``servers``, ``position``)."""
        return self._handle.session

    def __repr__(self) -> str:
        return f"RemoteCache(length={self.length}, rows={self.rows})"

    def crop(self, length: int) -> "RemoteCache | None":
        length = min(length, self.length)
        return RemoteCache(self._handle, self._chunk, length, self._epoch, self._rows) if length > 0 else None

    def settle(self) -> None:
        """Make the value hold only its own rows' memory (on the servers: nothing to copy)."""

    def release(self, length: int) -> None:
        """Nothing to give back here: a step that starts at ``length`` rewinds the session there."""

    def storage(self) -> tuple[_Handle, int]:
        """The session's handle; the memory is on the servers, none here."""
        return self._handle, 0

    def select_rows(self, rows) -> "RemoteCache":
        rows = torch.as_tensor(rows, dtype=torch.long)
        if self._rows is not None:
            rows = self._rows[rows]
        elif rows.numel() == self.rows and torch.equal(rows, torch.arange(self.rows)):
            return self
        return RemoteCache(self._handle, self._chunk, self._length, self._epoch, rows)


class Remote:
    """A model whose transformer blocks are served by a swarm. Build it with :func:`remote`.

    Attributes: ``model`` (the local :class:`~continuous.remote.DistributedModelForCausalLM`),
    ``tokenizer``, ``stats``, ``vocab_size``, ``max_length``.

    Each forward is one round trip: one step message through each server of the chain,
    however many slots it carries (a speculative draft with the step's tokens) and wherever
    it starts (a rewind goes with it), so ``stats.forward_calls`` counts the round trips
    (the replays of a failover aside).
    """

    def __init__(self, model, tokenizer, *, max_length: int, max_batch: int, generation_config=None):
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError("continuous needs a fast (Rust) tokenizer: it maps characters to tokens "
                            "with offset mappings")
        self.model = model
        self.tokenizer = tokenizer
        self.stats = Stats()
        self.vocab_size = model.lm_head.weight.shape[0]
        self.max_length = max_length
        self.max_batch = max_batch
        self.device = torch.device("cpu")  # embeddings and head run here; logits come back here
        self.overlap = False  # each step waits for the servers anyway
        # Each call runs alone, its steps sent to the servers as they come (sessions are
        # batched there): no engine; async calls run in worker threads, so that their round
        # trips overlap.
        self.engine = None
        self.executor = ThreadPoolExecutor(max_workers=256, thread_name_prefix="continuous-remote")
        self.prefix_cache = None  # a swarm session cannot be shared by several calls' rows
        self.eos_token_ids = stop_ids(tokenizer, generation_config)

    def __repr__(self) -> str:
        return f"models.remote({self.model.config.name_or_path!r}, vocab={self.vocab_size})"

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache: RemoteCache | None,
                logits_to_keep: int = 1, *, n_real: int | None = None, holes: bool = True,
                ) -> tuple[torch.Tensor, RemoteCache]:
        """Forward the slots the cache does not cover; see :class:`~continuous.models.base.Model`."""
        rows, n = input_ids.shape
        start = cache.length if cache is not None else 0
        if attention_mask is None:
            attention_mask = torch.ones((rows, start + n), dtype=torch.long)
        attention_mask = attention_mask.cpu()
        check_layout(input_ids, attention_mask, start)
        if rows > self.max_batch:
            raise ValueError(f"{rows} rows exceed this model's max_batch of {self.max_batch}: "
                             "build it with models.remote(..., max_batch=...)")
        if start == 0:
            handle = _Handle(self.model.inference_session(max_length=self.max_length, batch_size=self.max_batch))
            hypo_ids = None
        else:
            handle, hypo_ids = cache._handle, cache._rows
        with torch.no_grad():
            hidden = self.model.embed(input_ids.cpu())
            mask = None if bool(attention_mask.all()) else attention_mask
            out = handle.session.step(hidden, hypo_ids, start_position=start, attention_mask=mask,
                                      position_ids=positions(attention_mask, start))
            logits = self.model.logits(out[:, -logits_to_keep:])
        if hypo_ids is not None:
            handle.epoch += 1
        chunk = handle.write(start, n)
        self.stats.record(int(attention_mask[:, start:].sum()) if n_real is None else n_real, rows * n)
        return logits.float(), RemoteCache(handle, chunk, start + n, handle.epoch)


def remote(model_path, *, initial_peers, tokenizer=None, max_length: int = 1024, max_batch: int = 8,
           **options) -> Remote:
    """The model at ``model_path``, its transformer blocks served by a swarm.

    Parameters
    ----------
    model_path
        Directory of the model (config, tokenizer, safetensors): only the embeddings,
        the final norm and the head are loaded here.
    initial_peers
        Multiaddresses of peers of the swarm (what ``python -m continuous.remote.server`` prints).
    tokenizer
        A loaded fast tokenizer (default: loaded from ``model_path``).
    max_length
        Positions (padded slots) a session may hold; servers reserve this much cache.
    max_batch
        Rows a session may hold (samples and beams count).
    **options
        Passed to ``DistributedModelForCausalLM.from_pretrained`` (``dht_prefix``,
        ``step_timeout``, ``max_retries``, ``compression``...).
    """
    from transformers import AutoTokenizer, GenerationConfig

    from ..remote import DistributedModelForCausalLM

    dmodel = DistributedModelForCausalLM.from_pretrained(model_path, initial_peers=list(initial_peers), **options)
    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model_path)
    max_length = min(max_length, getattr(dmodel.config, "max_position_embeddings", max_length))
    try:
        generation_config = GenerationConfig.from_pretrained(model_path)
    except OSError:  # no generation_config.json
        generation_config = None
    return Remote(dmodel, tokenizer, max_length=max_length, max_batch=max_batch,
                  generation_config=generation_config)
