"""The local backend: a transformers causal LM whose KV cache is a :class:`~continuous.kv.KVCache`."""

from __future__ import annotations

import contextlib
import logging
import os
import weakref

import torch

from ..kv import CACHE_ARG, ForwardCache, JointRows, KVCache, Shape, StaticStepCache
from .base import Stats, check_layout, stop_ids
from .masks import attention_masks, check_supported, layer_windows, near, positions
from ..prefix import PrefixCache, parse_bytes
from ..transfer import cat_rows, to_device
from .engine import Engine
from .graphs import GraphTrees
from .joint import Joint
from .scheduler import PREFILL_CHUNK, PREFILL_CHUNK_GPU, Request

__all__ = ["Transformers", "transformers", "check_causal"]

logger = logging.getLogger(__name__)

_WRAPPED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


#: How many shapes a compiled decode step may be compiled for (``torch._dynamo``'s
#: ``recompile_limit`` is raised to it): rows x capacities x with or without a mask.
COMPILED_SHAPES = 64
#: The longest run of tokens (a constraint's forced tokens) a compiled step forwards at
#: once, padded to 2, 4 or 8; longer runs and prefills run eagerly.
COMPILED_WIDTH = 8


class Transformers:
    """A local transformers causal LM.

    Use :func:`transformers` to build one. Attributes: ``model`` (the HF model),
    ``tokenizer`` (a fast HF tokenizer), ``stats``, ``vocab_size``, ``max_length``,
    ``device``, and ``overlap``: whether free-text decoding queues each step on the
    device before the host has read the previous step's tokens (on by default on CUDA;
    a step that turns out unneeded, when a row ends, is discarded and counted in
    ``stats.tokens_rewound``).

    Every method may be called from several threads at once: the cache claims the slots
    it appends under a lock and the counters are atomic. The HF model itself must then
    be safe to call concurrently (inference-mode PyTorch modules are).
    """

    def __init__(self, model, tokenizer, *, compile: bool | str | dict = False, prefill_chunk: int | None = None,
                 prefix_cache: int | str | None = None, max_rows: int | None = None, max_kv: int | str | None = None):
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError("continuous needs a fast (Rust) tokenizer: it maps characters to tokens "
                            "with offset mappings")
        check_causal(model.config)
        check_supported(model)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.stats = Stats()
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_length = int(getattr(model.config, "max_position_embeddings", 0)
                              or getattr(model.config, "n_positions", 0) or 10**9)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.windows = layer_windows(model.config)
        self.kinds = [w is not None for w in self.windows]
        self.eos_token_ids = stop_ids(tokenizer, model.generation_config)
        # Queue each decode step before the host has read the last step's ids (see
        # decoding.decode): it pays where the device runs asynchronously.
        self.overlap = self.device.type == "cuda"
        self.compiled = None
        # Per layer, its KV shape, learned from the first forward: the caches of an eager model then
        # hold their layers grouped (a copy of rows or slots is two operations a group, not two a
        # layer); a compiled step takes each layer's tensors as inputs of their own, never views
        # of one tensor, which it would have to write back whole.
        self.kv_shapes: list[Shape] | None = None
        self._graph_trees = None  # CUDA graphs of compiled steps, shared by the threads that step
        self._arange = None
        # The merged steps' stacked cache, used by the engine's step only. Merged steps run
        # compiled where compiled steps are CUDA graphs (eager, a step is its kernel launches);
        # on a CPU they measured faster eager (attention over the whole buffer, rows padded to
        # a few shapes and dynamo's guards cost more than they save).
        self.joint = Joint(compiled=bool(compile) and self.device.type == "cuda")
        self.engine = Engine(self._run_one, self._run_joint, prefill_chunk=_check_chunk(prefill_chunk, self.device),
                             max_rows=_check_limit(max_rows, "max_rows"),
                             max_kv=_check_limit(parse_bytes(max_kv) if isinstance(max_kv, str) else max_kv, "max_kv"),
                             token_bytes=_token_bytes(model.config, self.dtype), stats=self.stats,
                             on_leave=self.joint.leave)
        self.prefix_cache = PrefixCache(parse_bytes(prefix_cache)) if prefix_cache else None
        self.compile = compile
        if compile:
            # Decode steps (one token, or a short forced run) run compiled, on fixed shapes
            # (a buffer's capacity), so that nothing is specialized on the step; on CUDA
            # "reduce-overhead" also captures them in CUDA graphs. Prefills stay eager.
            mode = compile if isinstance(compile, str) else ("reduce-overhead" if self.device.type == "cuda" else None)
            # Inductor options are set around every call, not given to torch.compile: dynamo
            # reads "freezing" while it traces (to make the weights constants), and
            # torch.compile's options reach inductor alone.
            self._inductor = dict(compile) if isinstance(compile, dict) else {}
            try:
                with torch._inductor.config.patch(self._inductor):
                    pass
            except (AttributeError, KeyError, TypeError) as exc:
                raise ValueError(f"compile={compile!r}: not inductor's options ({exc})") from None
            self.compiled = torch.compile(self._step, mode=None if self._inductor else mode, dynamic=False)
            if self.device.type == "cuda":
                self._graph_trees = GraphTrees()
            # Each (rows, capacity, mask kind) is a shape of its own. Past dynamo's
            # default of 8 compiled shapes per function, every new shape would run eager
            # steps for the rest of the process, with one log line as the only sign.
            config = torch._dynamo.config
            config.recompile_limit = max(config.recompile_limit, COMPILED_SHAPES)

    def __repr__(self) -> str:
        return f"models.transformers({type(self.model).__name__}, vocab={self.vocab_size})"

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: KVCache | None,
                logits_to_keep: int = 1, *, n_real: int | None = None, holes: bool = True,
                ) -> tuple[torch.Tensor, KVCache]:
        """Forward the slots the cache does not cover; see :class:`~continuous.models.base.Model`.

        Returns float32 logits on the model's device. This forward runs now, alone; the
        calls of generators run on the model's engine, which merges their forwards
        (:mod:`~continuous.models.engine`).
        """
        return self.engine.forward(Request(input_ids, attention_mask, cache, logits_to_keep=logits_to_keep,
                                           n_real=n_real, holes=holes))

    def _run_one(self, request: Request, compiled: bool = True) -> tuple[torch.Tensor, KVCache]:
        """One request's forward, alone."""
        input_ids, attention_mask, cache = request.input_ids, request.attention_mask, request.cache
        logits_to_keep, n_real, holes = request.logits_to_keep, request.n_real, request.holes
        rows, n = input_ids.shape
        start = cache.length if cache is not None else 0
        device = self.device
        input_ids = to_device(input_ids, device)
        if attention_mask is None:  # every slot is a real token: plain causal attention
            at = torch.arange(start, start + n, device=device).expand(rows, n)
            mask, n_real = None, rows * n
        else:
            check_layout(input_ids, attention_mask, start)
            if n_real is None:
                n_real = int(attention_mask[:, start:].sum())
            mask = to_device(attention_mask, device)
            at = positions(mask, start)
        width = self._compiled_width(n, mask, cache, logits_to_keep) if compiled else 0
        fc = ForwardCache(cache, rows, width or n, self.kinds, request.reserve,
                          self.kv_shapes if self.compiled is None else None)
        if width:
            try:
                if width > n:
                    # Pads after the real tokens fill the width: real tokens never attend
                    # to them (causal), and their slots go back to the buffer afterwards.
                    input_ids = torch.cat([input_ids, input_ids[:, -1:].expand(rows, width - n)], 1)
                logits = self._static_step(input_ids, mask, fc, n)
            except BaseException:
                fc.abort()
                raise
            fc.trim(n)
            self.stats.record(n_real, rows * width)
            return logits, fc.result()
        try:
            with torch.inference_mode():
                embeds_like = torch.empty((rows, n, 0), dtype=self.dtype, device=device)
                masks = attention_masks(self.model.config, self.windows, embeds_like, mask, fc, at, holes)
                out = self.model(input_ids=input_ids, attention_mask=masks, position_ids=at,
                                 **{CACHE_ARG: fc}, use_cache=True, logits_to_keep=logits_to_keep)
        except BaseException:
            fc.abort()
            raise
        self.stats.record(n_real, rows * n)
        if self.kv_shapes is None and len(fc._buffer.keys) == len(self.kinds):
            self.kv_shapes = fc._buffer.shapes()
        return out.logits.float(), fc.result()

    def _run_joint(self, requests: list[Request]) -> list[tuple[torch.Tensor, KVCache]]:
        """One forward for the requests of several calls; each gets its own logits and cache.

        Row blocks are stacked (:mod:`.joint`): each request's cached slots, holes where
        another's are, then its new slots right-aligned at the end (so the last slots are
        every row's newest). Positions count real tokens only, so a row computes what it
        would alone. Each request gets its rows of the stacked cache as a
        :class:`~continuous.kv.JointRows`, copied out only if read.
        """
        layout = self.joint.layout(requests)
        width, start = max(r.width for r in requests), layout.start
        ids, mask, n_real = self._joint_inputs(layout, width)
        keep = max(r.logits_to_keep for r in requests)
        logits, cache = self._run_one(Request(ids, mask, layout.cache, logits_to_keep=keep, n_real=n_real),
                                     self.joint.compiled)
        out, buffer, then = {}, cache._buffer, {}
        # The last slot's logits are cut out once for the requests that read only those (decode steps).
        lasts = layout.blocks(logits[:, -1]) if any(r.last for r in layout.requests) else None
        blocks = None if all(r.last for r in layout.requests) else layout.blocks(logits)
        for i, (r, slots, at) in enumerate(zip(layout.requests, layout.slots, layout.at)):
            # Calls stacked together hold one Slots object, and go on sharing one: made once a step.
            key = (id(slots), r.width)
            if key not in then:
                then[key] = slots.then(range(start + width - r.width, start + width))
            own = JointRows(buffer, slice(at, at + r.batch_rows), then[key])
            if r.last:
                block = lasts[i]
            else:
                block = blocks[i] if r.logits_to_keep == keep else blocks[i][:, keep - r.logits_to_keep :]
            out[id(r)] = (block, own)
        self.joint.keep(layout, cache, [out[id(r)][1] for r in layout.requests], mask)
        return [out[id(r)] for r in requests]

    def _joint_inputs(self, layout, width: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """The stacked ``[rows, width]`` ids and ``[rows, start + width]`` attention mask of a merged
        step (no mask when every slot is real: attention then takes its plain causal path), and the
        real tokens among them. Rows of calls that left take pad ids, and are never read."""
        requests, start, device, dead = layout.requests, layout.start, self.device, layout.dead
        if layout.kept and all(r.attention_mask is None for r in requests):
            # The same calls go on, every slot of theirs real: the last step's mask grows by the
            # new columns, each request's right-aligned (holes before a narrower one's).
            same = all(r.width == width for r in requests)
            if same and not dead:  # most steps: the ids of one shared draw, forwarded as they are
                ids = to_device(cat_rows([r.input_ids for r in requests]), device)
            else:
                pieces = [(at, _pad_left(to_device(r.input_ids, device), width)) for r, at in zip(requests, layout.at)]
                pieces += [(a, torch.zeros((b - a, width), dtype=torch.long, device=device)) for a, b in dead]
                pieces.sort(key=lambda p: p[0])
                ids = torch.cat([t for _, t in pieces]) if len(pieces) > 1 else pieces[0][1]
            n_real = sum(r.batch_rows * r.width for r in requests)
            if same:
                return ids, self.joint.mask_after(layout.mask, width), n_real
            new = [[1] * width] * layout.rows  # rows of no call: attended over, never read
            for r, at in zip(requests, layout.at):
                new[at : at + r.batch_rows] = [[0] * (width - r.width) + [1] * r.width] * r.batch_rows
            cached = layout.mask if layout.mask is not None else torch.ones((layout.rows, start), dtype=torch.long,
                                                                             device=device)
            return ids, torch.cat([cached, to_device(new, device, cached.dtype)], 1), n_real
        ids = torch.zeros((layout.rows, width), dtype=torch.long, device=device)
        mask = torch.zeros((layout.rows, start + width), dtype=torch.long, device=device)
        for r, slots, at in zip(requests, layout.slots, layout.at):
            length, n = len(slots), r.batch_rows
            own = r.attention_mask if r.attention_mask is not None else torch.ones((n, length + r.width),
                                                                                   dtype=torch.long, device=device)
            own = to_device(own, device)
            ids[at : at + n, width - r.width :] = to_device(r.input_ids, device)
            if len(slots.base):
                mask[at : at + n, to_device(slots.tensor(), device)] = own[:, :length]
            else:  # a run of slots (a call's cache stacked as it is)
                mask[at : at + n, slots.tail.start : slots.tail.stop] = own[:, :length]
            mask[at : at + n, start + width - r.width :] = own[:, length:]
        n_real = int(mask[:, start:].sum())
        for a, b in dead:
            mask[a:b] = 1  # attended over, never read: a row with no slot at all would give NaN
        return ids, None if bool(mask.all()) else mask, n_real

    def _compiled_width(self, n: int, mask, cache: KVCache | None, logits_to_keep: int) -> int:
        """The width a compiled step forwards ``n`` tokens at (0: run eagerly).

        One token, or (with every slot real and only the last logits kept) a short run
        such as the tokens a constraint forces, padded to a power of two so that few
        widths are ever compiled.
        """
        if self.compiled is None or cache is None or len(cache._buffer.keys) != len(self.kinds):
            return 0  # a fresh buffer is allocated by an eager prefill
        if n == 1:
            return 1
        if mask is not None or logits_to_keep != 1 or n > COMPILED_WIDTH:
            return 0
        return 1 << (n - 1).bit_length()

    def _static_step(self, input_ids: torch.Tensor, mask: torch.Tensor | None, fc: ForwardCache,
                     n_real: int = 1) -> torch.Tensor:
        """A step on fixed shapes: the whole capacity, masks saying which slots count.

        ``input_ids`` is ``[rows, width]``, the first ``n_real`` columns real; the logits
        are those after the last real one. Nothing here copies from the host: the slots
        written and the positions are views of a device ``arange``, so the step is queued
        while the GPU still runs the last one.
        """
        (rows, width), start, capacity = input_ids.shape, fc.start, fc._buffer.capacity
        slots = self._slots(capacity)
        write_at = slots[start : start + width]
        if mask is None:  # every slot up to the queries is real: positions are the slots
            full = (slots[None, :] <= write_at[:, None]).expand(rows, width, capacity)
            at = slots.expand(rows, capacity)
            query = write_at.expand(rows, width)
        else:  # one token (see _compiled_width)
            full = torch.zeros((rows, capacity), dtype=torch.bool, device=self.device)
            full[:, : start + 1] = mask.bool()
            at = positions(full)
            query = at[:, start : start + 1].contiguous()
            full = full[:, None, :]
        keys = full[:, None, :, :]
        masks = keys
        if any(self.kinds):
            window = next(w for w in self.windows if w is not None)
            windowed = keys & near(query[:, :, None], at[:, None, :], window)[:, None, :, :]
            masks = windowed if all(self.kinds) else {"full_attention": keys, "sliding_attention": windowed}
        if self.model.config._attn_implementation == "eager":  # eager attention adds its mask
            low = torch.finfo(self.dtype).min
            as_bias = lambda m: torch.zeros(m.shape, dtype=self.dtype, device=self.device).masked_fill(~m, low)  # noqa: E731
            masks = {k: as_bias(m) for k, m in masks.items()} if isinstance(masks, dict) else as_bias(masks)
        # Inductor's options only where given: patching its config costs on every step.
        options = torch._inductor.config.patch(self._inductor) if self._inductor else contextlib.nullcontext()
        with torch.inference_mode(), options:
            # Frozen, only the weights are constants: the KV buffers stay the step's inputs.
            cache = StaticStepCache.of(fc, self.kinds, write_at, static=not torch._inductor.config.freezing)
            if self._graph_trees is not None:
                self._graph_trees.share()
            # A copy: a CUDA graph's outputs live in its pool, and its next replay writes there.
            return self.compiled(input_ids, query, masks, cache, slots[n_real - 1 : n_real]).clone()

    def _slots(self, capacity: int) -> torch.Tensor:
        """``arange(capacity)`` on the model's device, made once per capacity."""
        table = self._arange
        if table is None or table.numel() < capacity:
            table = self._arange = torch.arange(max(capacity, 1024), device=self.device)
        return table[:capacity]

    def _step(self, input_ids, position_ids, masks, cache, keep):
        return self.model(input_ids=input_ids, attention_mask=masks, position_ids=position_ids,
                          **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=keep).logits.float()


#: What names the checkpoint: the tokenizer is loaded with these too.
_CHECKPOINT_OPTIONS = ("revision", "trust_remote_code", "token", "cache_dir", "local_files_only", "subfolder",
                       "gguf_file")


def _is_path(x) -> bool:
    return isinstance(x, (str, bytes, os.PathLike))


def _dtype(dtype):
    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype):
        return dtype
    named = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(named, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, its name (\"bfloat16\", \"float16\", \"float32\") or "
                         f"\"auto\"; got {dtype!r}")
    return named


def _load(path: str, tokenizer, dtype, options: dict):
    """Load a causal LM and its tokenizer from a folder or hub name, with errors that say what to pass."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    local = os.path.expanduser(path)
    if os.path.isfile(local):
        raise FileNotFoundError(f"{path} is a file: pass the folder that holds config.json"
                                + (" and gguf_file= its name" if local.endswith(".gguf") else ""))
    if not os.path.isdir(local) and (local.startswith((os.sep, ".", "~")) or local.count("/") > 1):
        raise FileNotFoundError(f"no model folder at {path}")
    path = local if os.path.isdir(local) else path
    checkpoint = {k: v for k, v in options.items() if k in _CHECKPOINT_OPTIONS}
    try:
        config = AutoConfig.from_pretrained(path, **checkpoint)
    except OSError as exc:
        raise FileNotFoundError(f"{path} is not a local model folder, and loading it from the hub failed: "
                                f"{str(exc).splitlines()[0]}") from exc
    check_causal(config)
    model = AutoModelForCausalLM.from_pretrained(path, **({"dtype": dtype} if dtype is not None else {}), **options)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(path, **checkpoint)
    return model, tokenizer


def check_causal(config) -> None:
    """Refuse, naming what to use instead, a model that is not a decoder-only causal LM.

    Raises
    ------
    ValueError
        For an encoder-decoder model (T5, BART) or an encoder (BERT, RoBERTa) whose
        attention sees the whole text unless its config makes it a decoder.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    kind = config.model_type
    # Some encoders' configs (DistilBERT, DeBERTa-v2) have no is_decoder at all.
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{kind} is an encoder-decoder model: continuous generates with decoder-only causal LMs "
                         "(AutoModelForCausalLM: Llama, Qwen, Mistral, Gemma, Phi, GPT-2...)")
    if kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        raise ValueError(f"{kind} is an encoder: its attention sees the whole text, so it cannot generate "
                         "token by token; use a decoder-only causal LM (or a config with is_decoder=True)")


def _check_limit(value, name: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int (or None: no limit), got {value!r}")
    return value


def _pad_left(ids: torch.Tensor, width: int) -> torch.Tensor:
    """``[rows, n]`` ids padded on the left with zeros to ``width`` columns."""
    n = ids.shape[1]
    return ids if n == width else torch.cat([ids.new_zeros((ids.shape[0], width - n)), ids], 1)


def _token_bytes(config, dtype) -> int:
    """KV bytes one token of one row takes: keys and values of every layer."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", 1)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (getattr(text, "hidden_size", None) or getattr(text, "n_embd", 0)) // heads
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", 0)
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _check_chunk(size, device: torch.device) -> int:
    if size is None:
        return PREFILL_CHUNK_GPU if device.type == "cuda" else PREFILL_CHUNK
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"prefill_chunk must be a positive int of tokens, got {size!r}")
    return size


def transformers(model_or_path, tokenizer=None, *, device=None, dtype=None, compile: bool | str | dict = False,
                 prefix_cache: int | str | None = None, prefill_chunk: int | None = None,
                 max_rows: int | None = None, max_kv: int | str | None = None, **from_pretrained) -> Transformers:
    """A local transformers model.

    Parameters
    ----------
    model_or_path
        A local folder or hub name (loaded with ``AutoModelForCausalLM`` and
        ``AutoTokenizer``), or a loaded ``PreTrainedModel``, taken as it is.
    tokenizer
        A loaded fast tokenizer; loaded from ``model_or_path`` when omitted.
    device, dtype
        Where and in which dtype to load or move the model. ``dtype`` is a
        ``torch.dtype`` or its name (``"bfloat16"``, ``"float16"``...); ``"auto"`` loads
        the checkpoint's own dtype (and leaves a loaded model's as it is).
    compile
        Run decode steps (one token, or up to :data:`COMPILED_WIDTH` forced tokens) compiled
        with ``torch.compile`` on fixed shapes (rows, a power-of-two capacity; dynamo's limit
        of shapes is raised process-wide to :data:`COMPILED_SHAPES`); on CUDA with CUDA graphs
        (``"reduce-overhead"``; a string names another mode). A dict is inductor's options: on
        a CPU ``{"freezing": True, "max_autotune": True}`` makes the weights constants of the
        compiled step (a frozen copy: later changes to the weights do not reach it).
    prefix_cache
        Keep recent states within this many bytes of KV cache (an int, or a string such as
        ``"2GB"``), so that a later prompt starting with a kept state's tokens forwards
        only the rest (``stats.tokens_cached`` counts what it saved). Off by default.
    prefill_chunk
        While other calls are decoding, a long prompt is forwarded this many tokens at a
        time, between their steps, so that it does not stall them (default: 512 on a CPU,
        8192 on a GPU, where a forward's fixed cost is launching its kernels).
    max_rows, max_kv
        Most rows (prompts x samples) and KV bytes (an int, or ``"4GB"``; a call reserves its
        rows x (longest prompt + ``max_tokens``)) the running calls may hold; past either,
        calls wait, and one that could never fit is refused. ``None``: no limit.
    **from_pretrained
        Given to ``from_pretrained`` when loading from a path (``device_map``,
        ``attn_implementation``, ``trust_remote_code``, ``revision``, ``gguf_file``...);
        those that name the checkpoint go to the tokenizer's too.

    Returns
    -------
    Transformers
        The same object for the same loaded HF model and options, so its ``stats`` (and its
        engine and prefix cache) are shared, while the model keeps its device and dtype
        (one moved or cast gets a new wrapper).

    Raises
    ------
    ValueError
        For a model whose state cannot be cropped (Mamba, linear attention, chunked
        attention), or that is not a causal LM (an encoder, or a base model with no
        language-model head), with the reason; for an unknown dtype.
    FileNotFoundError
        For a local path that does not exist, or a file where a folder is expected.
    TypeError
        For a tokenizer given as a path, or a loaded model given without its tokenizer.
    """
    dtype = _dtype(dtype)
    model, tokenizer = _model_and_tokenizer(model_or_path, tokenizer, dtype, from_pretrained)
    _check_head(model)
    if device is not None or dtype not in (None, "auto"):
        model = model.to(device=device, dtype=None if dtype == "auto" else dtype)
    return _wrapper(model, tokenizer, dict(compile=compile, prefill_chunk=prefill_chunk, prefix_cache=prefix_cache,
                                           max_rows=max_rows, max_kv=max_kv))


def _model_and_tokenizer(model_or_path, tokenizer, dtype, from_pretrained: dict):
    """The HF model and tokenizer: loaded from a path, or as given (with clear errors for a mix-up)."""
    if tokenizer is not None and _is_path(tokenizer):
        raise TypeError(f"tokenizer must be a loaded tokenizer, not the path {str(tokenizer)!r}: pass "
                        "AutoTokenizer.from_pretrained(path), or leave it out to load the model path's own")
    if _is_path(model_or_path):
        return _load(str(model_or_path), tokenizer, dtype, from_pretrained)
    if from_pretrained:
        raise TypeError(f"{', '.join(from_pretrained)}: loading options need a path, not a loaded model")
    if tokenizer is None:
        raise TypeError("models.transformers(model) needs the tokenizer when given a loaded model")
    return model_or_path, tokenizer


def _wrapper(model, tokenizer, options: dict) -> Transformers:
    """One wrapper per model and options, reused while it describes the model: moved or cast
    (in place, as ``model.to`` does), the model gets a new one."""
    wrappers = _WRAPPED.setdefault(model, {})
    key = (id(tokenizer),) + tuple(tuple(sorted(v.items())) if isinstance(v, dict) else v for v in options.values())
    wrapped = wrappers.get(key)
    weights = next(model.parameters())
    if (wrapped is None or wrapped.tokenizer is not tokenizer or wrapped.dtype != weights.dtype
            or wrapped.device != weights.device):
        wrapped = wrappers[key] = Transformers(model, tokenizer, **options)
    return wrapped


def _check_head(model) -> None:
    """Refuse a model without a language-model head (a base ``AutoModel``): it gives no logits."""
    check_causal(model.config)
    if getattr(model, "get_output_embeddings", lambda: None)() is None:
        raise ValueError(f"{type(model).__name__} has no language-model head, so it gives no next-token "
                         "logits: load it with AutoModelForCausalLM (or pass a path)")
