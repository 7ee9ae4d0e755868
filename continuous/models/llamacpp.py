"""The llama.cpp backend: a GGUF model run by llama.cpp, each state row's cache a llama.cpp sequence.

llama.cpp keeps, for a context, one KV memory of ``n_ctx`` cells; a cell holds one
token's keys and values at one position and belongs to a set of *sequences*. A state's
cache is a :class:`LlamaCache`: per row, a sequence and how many of its leading
positions are the row's. A sequence only grows, so a cache is a value that never changes:

- continuing a row whose sequence ends where the row does appends to it in place;
- continuing any other row (an older state, a crop, the second sample of a forked row)
  first gives the row a new sequence sharing the cells of its positions (``seq_cp``:
  no keys or values are copied), and appends there;
- a sequence no cache refers to anymore is removed (``seq_rm``), which frees the cells
  that no other sequence shares.

Padding and holes of the library's layout never reach llama.cpp: only real tokens are
sent, at their real positions, so one ``llama_decode`` serves rows of any lengths, and
the rows of concurrent calls together.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import logging
import os
import threading
import warnings
import weakref
from pathlib import Path

import numpy as np
import torch

from .base import Stats, check_layout, stop_ids
from .engine import Engine
from .scheduler import PREFILL_CHUNK, Request

__all__ = ["LlamaCpp", "LlamaCache", "llamacpp"]

#: Sequences a context holds unless ``n_seq_max=`` says otherwise (llama.cpp allows 256).
N_SEQ_MAX = 64

_INSTALL = "pip install continuous[llamacpp]"
_backend_ready = False


def _llama_cpp():
    """The ``llama_cpp`` module (llama-cpp-python), with its backend initialized once."""
    global _backend_ready
    try:
        import llama_cpp
    except ImportError as exc:
        raise ImportError(f"models.llamacpp needs llama-cpp-python: {_INSTALL}") from exc
    if not _backend_ready:
        llama_cpp.llama_backend_init()
        _backend_ready = True
    return llama_cpp


class _Seq:
    """A llama.cpp sequence id, held while a cache refers to it; positions ``[0, n)`` are written."""

    __slots__ = ("id", "n", "pool", "__weakref__")

    def __init__(self, pool: "_Pool", seq_id: int):
        self.pool, self.id, self.n = pool, seq_id, 0
        # Only queued here: the collector may run in any thread, while another decodes.
        weakref.finalize(self, pool.dead.append, seq_id).atexit = False


class _Pool:
    """The sequence ids of one context: free, held by a :class:`_Seq`, or dead (cells still to remove)."""

    def __init__(self, llama, memory, size: int):
        self.llama, self.memory, self.size = llama, memory, size
        self.free = list(range(size - 1, -1, -1))
        self.dead: collections.deque[int] = collections.deque()

    def reclaim(self) -> int:
        """Remove the cells of dead sequences and free their ids; returns how many were freed."""
        freed = 0
        while self.dead:
            seq_id = self.dead.popleft()
            self.llama.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
            self.free.append(seq_id)
            freed += 1
        return freed

    def new(self) -> _Seq:
        """An empty sequence."""
        if not self.free and not self.reclaim():
            gc.collect()  # states kept alive only by reference cycles
            self.reclaim()
        if not self.free:
            raise RuntimeError(
                f"llama.cpp's context holds {self.size} sequences and live states use all of them (each "
                "row of a state holds one, shared with the states it was continued from): release states "
                "you no longer need, or build the model with more, models.llamacpp(path, n_seq_max=...) "
                "(at most 256)")
        return _Seq(self, self.free.pop())

    def fork(self, seq: _Seq, length: int) -> _Seq:
        """A new sequence sharing the cells of ``seq``'s first ``length`` positions."""
        new = self.new()
        self.llama.llama_memory_seq_cp(self.memory, seq.id, new.id, 0, length)
        new.n = length
        return new

    def in_use(self) -> int:
        """Sequences that live caches hold."""
        self.reclaim()
        return self.size - len(self.free)


class LlamaCache:
    """A state's cache: per row, a llama.cpp sequence whose first ``held`` positions are the row's tokens.

    ``length`` counts slots of the library's layout (holes and padding included); which
    of them are real tokens the attention mask says at the next forward.
    """

    __slots__ = ("_seqs", "_held", "length", "__weakref__")
    movable = False  # the cells stay where llama.cpp put them

    def __init__(self, seqs: tuple, held: tuple, length: int):
        self._seqs, self._held, self.length = seqs, held, length

    @property
    def rows(self) -> int:
        return len(self._seqs)

    def __repr__(self) -> str:
        return f"LlamaCache(length={self.length}, rows={self.rows})"

    def crop(self, length: int) -> "LlamaCache | None":
        length = min(length, self.length)
        return LlamaCache(self._seqs, self._held, length) if length > 0 else None

    def select_rows(self, rows) -> "LlamaCache":
        idx = torch.as_tensor(rows, dtype=torch.long).tolist()
        return LlamaCache(tuple(self._seqs[i] for i in idx), tuple(self._held[i] for i in idx), self.length)

    def gather_rows_slots(self, rows, slots):
        raise TypeError("a llama.cpp cache cannot move its slots (movable is False)")

    def settle(self) -> None:
        """Make the value hold only its own rows' memory (its sequences: nothing to copy)."""

    def release(self, length: int) -> None:
        """Nothing to give back: a sequence only grows, and a crop continued later gets its own."""

    def storage(self) -> tuple[object, int]:
        """The sequences' pool, and 0 bytes: the cells are in llama.cpp's KV memory, allocated once
        for the context (``n_ctx`` cells), so dropping a state frees no memory of the process."""
        seq = next((s for s in self._seqs if s is not None), None)
        return (seq.pool if seq is not None else self), 0


class _Batch:
    """A ``llama_batch`` over arrays this process owns (one sequence id per token), refilled for each decode."""

    def __init__(self, llama, size: int):
        self.size = size
        self.token = np.zeros(size, dtype=np.int32)
        self.pos = np.zeros(size, dtype=np.int32)
        self.seq = np.zeros(size, dtype=np.int32)
        self.logits = np.zeros(size, dtype=np.int8)
        self.n_seq = np.ones(size, dtype=np.int32)
        base = self.seq.ctypes.data
        i32 = ctypes.POINTER(ctypes.c_int32)
        self.seq_ptrs = (i32 * size)(*[ctypes.cast(base + 4 * i, i32) for i in range(size)])
        self.batch = llama.llama_batch(
            n_tokens=0, token=self.token.ctypes.data_as(i32), embd=None, pos=self.pos.ctypes.data_as(i32),
            n_seq_id=self.n_seq.ctypes.data_as(i32), seq_id=ctypes.cast(self.seq_ptrs, ctypes.POINTER(i32)),
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)))


class _Native:
    """One llama.cpp model and context, freed with this object; ``lock`` guards every call into them."""

    def __init__(self, path: Path, n_ctx: int, n_threads: int | None, options: dict):
        llama = _llama_cpp()
        verbose = options.pop("verbose", False)
        logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG if verbose else logging.ERROR)
        model_params, ctx_params = llama.llama_model_default_params(), llama.llama_context_default_params()
        settings = _settings(n_ctx, n_threads, options, ctx_params.n_batch)
        _configure(model_params, ctx_params, settings)
        self.llama = llama
        self.model = llama.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {path} (see its log with verbose=True)")
        _check_architecture(llama, self.model, path)
        self.ctx = llama.llama_init_from_model(self.model, ctx_params)
        if not self.ctx:
            llama.llama_model_free(self.model)
            raise ValueError(f"llama.cpp could not make a context for {path} with {settings} "
                             "(see its log with verbose=True)")
        weakref.finalize(self, _free, llama, self.model, self.ctx)
        self.vocab = llama.llama_model_get_vocab(self.model)
        self.n_vocab = llama.llama_vocab_n_tokens(self.vocab)
        self.n_ctx = llama.llama_n_ctx(self.ctx)
        self.max_length = min(self.n_ctx, llama.llama_model_n_ctx_train(self.model) or self.n_ctx)
        self.pool = _Pool(llama, llama.llama_get_memory(self.ctx), llama.llama_n_seq_max(self.ctx))
        self.batch = _Batch(llama, llama.llama_n_batch(self.ctx))
        self.lock = threading.Lock()

    def meta(self, key: str) -> str | None:
        """A string field of the GGUF file's header (``None`` when absent)."""
        buf = ctypes.create_string_buffer(256)
        n = self.llama.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's own token ids of ``text``, with the special tokens its vocabulary adds (BOS)."""
        raw = text.encode()
        out = (self.llama.llama_token * (len(raw) + 8))()
        n = self.llama.llama_tokenize(self.vocab, raw, len(raw), out, len(out), True, False)
        return list(out[:n])

    def decode(self, batch: "_Step") -> torch.Tensor:
        """Run the step's tokens, ``n_batch`` at a time; the logits of its output tokens, in order."""
        llama, buf, size = self.llama, self.batch, self.batch.size
        found = []
        for at in range(0, batch.n_tokens, size):
            end = min(at + size, batch.n_tokens)
            n = end - at
            buf.token[:n], buf.pos[:n] = batch.tokens[at:end], batch.pos[at:end]
            buf.seq[:n], buf.logits[:n] = batch.seqs[at:end], batch.outputs[at:end]
            buf.batch.n_tokens = n
            code = llama.llama_decode(self.ctx, buf.batch)
            if code == 1:  # no room: cells of states collected since may be freed, then once more
                gc.collect()
                code = llama.llama_decode(self.ctx, buf.batch) if self.pool.reclaim() else code
            if code == 1:
                raise RuntimeError(
                    f"llama.cpp's context is full: its {self.n_ctx} cells (n_ctx) hold the tokens of the live "
                    f"states, and this step needs {n} more: release states you no longer need, or build the "
                    "model with a larger n_ctx (models.llamacpp(path, n_ctx=...))")
            if code != 0:
                raise RuntimeError(f"llama_decode failed with code {code} (see its log with verbose=True)")
            outputs = int(batch.outputs[at:end].sum())
            if outputs:
                logits = np.ctypeslib.as_array(llama.llama_get_logits(self.ctx), shape=(outputs, self.n_vocab))
                found.append(torch.from_numpy(logits.copy()))
        return found[0] if len(found) == 1 else torch.cat(found) if found else torch.zeros((0, self.n_vocab))


def _free(llama, model, ctx) -> None:
    llama.llama_free(ctx)
    llama.llama_model_free(model)


def _settings(n_ctx: int, n_threads: int | None, options: dict, n_batch: int) -> dict:
    """llama.cpp's parameters for a context whose sequences states share (one unified KV memory)."""
    threads = n_threads if n_threads is not None else max(1, (os.cpu_count() or 2) // 2)
    # One KV memory for every sequence (cells shared across them), keeping every position
    # of sliding-window layers too (a crop may go back before the window).
    settings = {"n_ctx": n_ctx, "n_threads": threads, "n_threads_batch": threads, "n_seq_max": N_SEQ_MAX,
                **options, "kv_unified": True, "swa_full": True}
    seqs = settings["n_seq_max"]
    if not isinstance(seqs, int) or not 1 <= seqs <= 256:
        raise ValueError(f"n_seq_max must be an int between 1 and 256 (llama.cpp's limit), got {seqs!r}")
    # llama.cpp reserves an output per sequence and aborts the process (an assertion) when
    # n_outputs_max, n_batch unless set, is below n_seq_max.
    settings.setdefault("n_outputs_max", max(settings.get("n_batch", n_batch), seqs))
    if settings["n_outputs_max"] < seqs:
        raise ValueError(f"n_outputs_max ({settings['n_outputs_max']}) must be at least n_seq_max ({seqs})")
    return settings


def _configure(model_params, ctx_params, settings: dict) -> None:
    """Set llama.cpp's model and context parameters by name, with a clear error for an unknown one."""
    known = {name for name, _ in type(ctx_params)._fields_} | {name for name, _ in type(model_params)._fields_}
    for name, value in settings.items():
        if name not in known:
            raise TypeError(f"models.llamacpp got an unknown option {name!r}: it takes llama.cpp's context and "
                            f"model parameters ({', '.join(sorted(known))}) and verbose")
        if name in ("type_k", "type_v") and isinstance(value, str):
            value = _ggml_type(value)
        target = ctx_params if name in {n for n, _ in type(ctx_params)._fields_} else model_params
        setattr(target, name, value)


def _ggml_type(name: str) -> int:
    value = getattr(_llama_cpp(), f"GGML_TYPE_{name.upper()}", None)
    if not isinstance(value, int):
        raise ValueError(f"unknown KV cache type {name!r}: use \"f32\", \"f16\", \"q8_0\"...")
    return value


def _check_architecture(llama, model, path: Path) -> None:
    """Refuse a model whose sequences cannot be cut at any position: states crop and fork them."""
    kinds = [("recurrent (Mamba, RWKV...)", llama.llama_model_is_recurrent),
             ("hybrid recurrent", llama.llama_model_is_hybrid),
             ("an encoder-decoder", llama.llama_model_has_encoder),
             ("a diffusion model", llama.llama_model_is_diffusion)]
    for kind, test in kinds:
        if test(model):
            llama.llama_model_free(model)
            raise ValueError(f"{path.name} is {kind}: continuous runs decoder-only models with an attention "
                             "cache, whose sequences can be cropped and shared at any position")


class _Step:
    """The tokens of one ``llama_decode`` (the requests of one round): each row's real new tokens,
    at its real positions, on the sequence it appends to."""

    def __init__(self, pool: _Pool):
        self.pool = pool
        self.parts: list[tuple] = []  # per request: (rows, keep, out_rows, out_cols, seqs, held, length)
        self.claimed: dict[int, tuple[_Seq, int, int]] = {}  # id -> (sequence appended to, from, count)
        self.tokens, self.pos, self.seqs, self.outputs = [], [], [], []

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def add(self, request: Request) -> None:
        """Plan a request's rows: which sequence each appends to, its tokens, positions, outputs."""
        ids, cache, mask = request.input_ids.cpu(), request.cache, request.attention_mask
        rows, n = ids.shape
        start = cache.length if cache is not None else 0
        if mask is None:
            cached = torch.full((rows,), start, dtype=torch.long)
            new = torch.ones((rows, n), dtype=torch.bool)
        else:
            mask = mask.cpu()
            check_layout(ids, mask, start)
            cached, new = mask[:, :start].sum(1), mask[:, start:].bool()
        row_of, slot = new.nonzero(as_tuple=True)
        counts = new.sum(1).tolist()
        targets, held = self._targets(cache, cached.tolist(), counts)
        keep = min(request.logits_to_keep, n)
        out = slot >= n - keep
        self.tokens.append(ids[row_of, slot].numpy())
        self.pos.append((cached[row_of] + new.cumsum(1)[row_of, slot] - 1).numpy())
        self.seqs.append(np.array([-1 if t is None else t.id for t in targets], dtype=np.int32)[row_of.numpy()])
        self.outputs.append(out.numpy())
        self.parts.append((rows, keep, row_of[out], slot[out] - (n - keep), tuple(targets), tuple(held), start + n))

    def _targets(self, cache: LlamaCache | None, cached: list[int], counts: list[int]) -> tuple[list, list]:
        """Per row, the sequence that holds it after the step, and how many positions of it are the row's."""
        targets, held = [], []
        for r, (k, m) in enumerate(zip(cached, counts)):
            seq = cache._seqs[r] if cache is not None else None
            if k > (cache._held[r] if cache is not None else 0):
                raise ValueError(f"the attention mask gives row {r} {k} cached tokens, more than its cache holds")
            if m == 0:
                targets.append(seq if k else None)
            elif k == 0:
                targets.append(self._claim(self.pool.new(), 0, m))
            elif seq.n == k and id(seq) not in self.claimed:
                targets.append(self._claim(seq, k, m))  # the sequence ends where the row does: append in place
            else:
                targets.append(self._claim(self.pool.fork(seq, k), k, m))
            held.append(k + m)
        return targets, held

    def _claim(self, seq: _Seq, start: int, count: int) -> _Seq:
        self.claimed[id(seq)] = (seq, start, count)
        return seq

    def seal(self) -> None:
        """Join the requests' arrays (after every :meth:`add`)."""
        join = lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)  # noqa: E731
        self.tokens, self.pos = join(self.tokens, np.int32), join(self.pos, np.int32)
        self.seqs, self.outputs = join(self.seqs, np.int32), join(self.outputs, np.int8)

    def commit(self) -> None:
        """The decode succeeded: the sequences appended to have grown."""
        for seq, start, count in self.claimed.values():
            seq.n = start + count

    def undo(self, llama) -> None:
        """The decode failed: remove what part of it llama.cpp may have written."""
        for seq, start, _ in self.claimed.values():
            llama.llama_memory_seq_rm(self.pool.memory, seq.id, start, -1)

    def results(self, logits: torch.Tensor) -> list[tuple[torch.Tensor, LlamaCache]]:
        """Each request's logits ``[rows, keep, vocab]`` (zeros where a slot is no real token) and cache."""
        out, at = [], 0
        for rows, keep, out_rows, out_cols, targets, held, length in self.parts:
            mine = logits[at : at + len(out_rows)]
            at += len(out_rows)
            if len(out_rows) == rows * keep:  # every kept slot is a real token, in row order
                own = mine.view(rows, keep, -1)
            else:
                own = torch.zeros((rows, keep, logits.shape[-1]), dtype=torch.float32)
                own[out_rows, out_cols] = mine
            out.append((own, LlamaCache(targets, held, length)))
        return out


class LlamaCpp:
    """A GGUF model run by llama.cpp. Build it with :func:`llamacpp`.

    Attributes: ``path`` (the GGUF file), ``tokenizer`` (a fast HF tokenizer), ``stats``,
    ``vocab_size``, ``max_length`` (the context's ``n_ctx``, at most the model's training
    context), ``n_ctx`` and ``n_seq_max`` (its cells and sequences), ``device`` (the CPU:
    logits come back there).

    Calls running at the same time share one ``llama_decode`` per step, each row with its
    own sequence; every call into llama.cpp holds one lock.
    """

    def __init__(self, native: _Native, tokenizer, path: Path):
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError("continuous needs a fast (Rust) tokenizer: it maps characters to tokens "
                            "with offset mappings")
        if len(tokenizer) > native.n_vocab:
            raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, more than {path.name}'s vocabulary "
                             f"({native.n_vocab}): it is not this model's tokenizer")
        self.native, self.tokenizer, self.path = native, tokenizer, path
        self.stats = Stats()
        self.vocab_size = native.n_vocab
        self.max_length = native.max_length
        self.n_ctx, self.n_seq_max = native.n_ctx, native.pool.size
        self.device = torch.device("cpu")
        self.overlap = False  # llama_decode returns when its work is done
        self.eos_token_ids = _stop_ids(native, tokenizer)
        # Only real tokens go to llama.cpp: nothing is padded, every request of a step runs in one decode.
        self.engine = Engine(self._run_one, self._run_joint, prefill_chunk=PREFILL_CHUNK, pads=False, stats=self.stats)
        self.prefix_cache = None

    def __repr__(self) -> str:
        return f"models.llamacpp({self.path.name!r}, vocab={self.vocab_size})"

    def sequences_in_use(self) -> int:
        """How many llama.cpp sequences the live states hold (at most ``n_seq_max``)."""
        with self.native.lock:
            return self.native.pool.in_use()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache: LlamaCache | None,
                logits_to_keep: int = 1, *, n_real: int | None = None, holes: bool = True,
                ) -> tuple[torch.Tensor, LlamaCache]:
        """Forward the slots the cache does not cover; see :class:`~continuous.models.base.Model`.

        Only the real tokens go to llama.cpp; the logits of a kept slot that holds no real
        token are zeros. This forward runs now, alone; the calls of generators run on the
        model's engine, which shares each decode among them (:mod:`~continuous.models.engine`).
        """
        return self.engine.forward(Request(input_ids, attention_mask, cache, logits_to_keep=logits_to_keep,
                                           n_real=n_real, holes=holes))

    def _run_one(self, request: Request) -> tuple[torch.Tensor, LlamaCache]:
        return self._run_joint([request])[0]

    def _run_joint(self, requests: list[Request]) -> list[tuple[torch.Tensor, LlamaCache]]:
        """One ``llama_decode`` for the rows of every request, each row on its own sequence."""
        native = self.native
        for r in requests:
            if r.cache is not None and (not isinstance(r.cache, LlamaCache) or any(
                    s is not None and s.pool is not native.pool for s in r.cache._seqs)):
                raise ValueError("this cache is not one of this llama.cpp model's: states of different models "
                                 "cannot be mixed")
        with native.lock:
            native.pool.reclaim()
            step = _Step(native.pool)
            for r in requests:
                step.add(r)
            step.seal()
            try:
                logits = native.decode(step)
            except BaseException:
                step.undo(native.llama)
                raise
            step.commit()
        self.stats.record(step.n_tokens, step.n_tokens)
        return step.results(logits)


def _stop_ids(native: _Native, tokenizer) -> tuple[int, ...]:
    """The tokenizer's EOS, then every special token llama.cpp ends a generation on (end of turn...)."""
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    ends = [i for i in sorted(special) if 0 <= i < native.n_vocab and native.llama.llama_vocab_is_eog(native.vocab, i)]
    return tuple(dict.fromkeys(stop_ids(tokenizer) + tuple(ends)))


#: A text that tells pre-tokenizers apart (digits, whitespace runs, punctuation, scripts,
#: contractions); it starts with a letter, where every vocabulary reads the same way.
_PROBE = ("Hello world! It's 2024-05-17: 12345 items at $3.50 each.\n\n1. Don't  panic\t(ok?)\n"
          "    indented, then ... \"quoted\" 'single' I'VE we'll\nÀ bientôt — 你好，世界 🦙 ------=======")


def _gguf_tokenizer(native: _Native, path: Path):
    """The GGUF file's tokenizer as llama.cpp splits text: transformers' GGUF loader, checked.

    The loader reads the vocabulary and merges but writes a plain byte-level pre-tokenizer
    for most of the names llama.cpp reads from ``tokenizer.ggml.pre``: the few whose rule
    is known are put back (:func:`_restore_pre_tokenizer`). Then the tokenizer must split
    a probe text as llama.cpp does, or it is refused.
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # noqa: BLE001 - any failure of the loader means the same to the user
        raise ValueError(f"transformers could not build a tokenizer from {path.name} ({exc}): pass "
                         "tokenizer= the model's own (AutoTokenizer.from_pretrained(...))") from exc
    pre = native.meta("tokenizer.ggml.pre")
    _restore_pre_tokenizer(tokenizer, pre)
    ours, theirs = tokenizer(_PROBE)["input_ids"], native.tokenize(_PROBE)
    if ours != theirs:
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        raise ValueError(f"the tokenizer transformers reads from {path.name} (pre-tokenizer {pre!r}) splits text "
                         f"unlike llama.cpp (token {at}: {ours[at:at + 3]} vs {theirs[at:at + 3]}): pass "
                         "tokenizer= the model's own (AutoTokenizer.from_pretrained(...))")
    return tokenizer


def _restore_pre_tokenizer(tokenizer, pre: str | None) -> None:
    """Put back the pre-tokenization llama.cpp applies for ``pre`` where transformers' loader drops it."""
    from tokenizers import Regex
    from tokenizers import pre_tokenizers as steps

    byte_level = steps.ByteLevel(add_prefix_space=False, use_regex=True)
    backend = tokenizer.backend_tokenizer
    if pre == "smollm":  # digits one by one, then byte-level
        backend.pre_tokenizer = steps.Sequence([steps.Digits(individual_digits=True), byte_level])
    elif pre == "falcon":  # punctuation runs first, digits in threes after
        backend.pre_tokenizer = steps.Sequence([
            steps.Punctuation("contiguous"), byte_level, steps.Digits(individual_digits=False),
            steps.Split(Regex("[0-9][0-9][0-9]"), "isolated")])
    elif pre == "llama-bpe":  # a piece that is one token of the vocabulary is that token
        backend.model.ignore_merges = True


def llamacpp(gguf_path, *, n_ctx: int = 4096, n_threads: int | None = None, tokenizer=None,
             **llama_kwargs) -> LlamaCpp:
    """A GGUF model run by llama.cpp (through llama-cpp-python: ``pip install continuous[llamacpp]``).

    Every state row's cache is a llama.cpp sequence: continuing a state appends to it,
    forks and slices share its cells, and a sequence is freed when no state refers to it.

    Parameters
    ----------
    gguf_path
        The GGUF file, at any quantization llama.cpp reads.
    n_ctx
        Cells of the KV memory, shared by every live state: a token of a state's rows
        takes one, shared by the states continued or sliced from it. It bounds one
        row's length too (with the model's training context).
    n_threads
        CPU threads of llama.cpp (default: half the CPU count).
    tokenizer
        A loaded fast HF tokenizer of the model. By default it is read from the GGUF file
        with transformers' loader and checked against llama.cpp's own splitting (refused,
        with a clear error, where they differ).
    **llama_kwargs
        llama.cpp's context and model parameters by name: ``n_seq_max`` (sequences the
        live states may hold, default :data:`N_SEQ_MAX`, at most 256), ``n_batch``,
        ``n_ubatch``, ``type_k``/``type_v`` (the KV cache's type: ``"f16"`` by default,
        ``"f32"``, ``"q8_0"``...), ``flash_attn_type``, ``n_gpu_layers``, ``use_mmap``...;
        and ``verbose=True`` to see llama.cpp's log.

    Returns
    -------
    LlamaCpp

    Notes
    -----
    Loading sets torch's intra-op threads to one, process-wide (the CPU is llama.cpp's):
    a transformers model beside it then needs ``torch.set_num_threads`` to use more.

    Raises
    ------
    ImportError
        When llama-cpp-python is not installed.
    FileNotFoundError
        When ``gguf_path`` is not a file.
    ValueError
        For a file llama.cpp cannot load, a model whose sequences cannot be cropped
        (recurrent, hybrid, encoder-decoder), or a tokenizer that cannot be read from it.
    TypeError
        For an unknown option, or a tokenizer given as a path or that is not fast.
    """
    path = Path(os.path.expanduser(str(gguf_path)))
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_path}")
    if tokenizer is not None and isinstance(tokenizer, (str, bytes, os.PathLike)):
        raise TypeError(f"tokenizer must be a loaded tokenizer, not the path {str(tokenizer)!r}: pass "
                        "AutoTokenizer.from_pretrained(path), or leave it out to read the GGUF file's")
    native = _Native(path, n_ctx, n_threads, dict(llama_kwargs))
    # torch's host work here is small (masks, sampling); its pool would fight llama.cpp's
    # threads for the cores (a reduction over SmolLM2's vocabulary: 60 ms, not 0.5).
    torch.set_num_threads(1)
    if tokenizer is None:
        tokenizer = _gguf_tokenizer(native, path)
    elif tokenizer(_PROBE)["input_ids"] != native.tokenize(_PROBE):
        warnings.warn(f"the tokenizer given splits text unlike {path.name}'s own vocabulary in llama.cpp: "
                      "is it this model's?", stacklevel=2)
    return LlamaCpp(native, tokenizer, path)
