"""A transformers causal LM whose blocks run in the swarm: embeddings, norm and head are local.

``generate()`` is transformers' own: the model's ``past_key_values`` is a
:class:`SwarmSessionCache` that only knows the session's position and turns beam search's
``reorder_cache`` into the ``hypo_ids`` of the next step, so every decoding strategy of
transformers works unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Sequence

import torch
from torch import nn
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from continuous.remote.checkpoint import architecture, load_config, model_class, read_weights
from continuous.remote.client import InferenceSession
from continuous.remote.protocol import default_dht_prefix
from continuous.remote.routing import SwarmClient

logger = logging.getLogger(__name__)


class SwarmSessionCache(Cache):
    """The stand-in for a KV cache that lives on the servers of a session.

    Parameters
    ----------
    session
        The session holding the cache.
    """

    is_compileable = False

    def __init__(self, session: InferenceSession):
        super().__init__(layers=[])
        self.session = session
        self.hypo_ids: torch.Tensor | None = None  # rows of the cache the next step continues

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.session.position

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.session.max_length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        # Compose with a reorder not yet applied (never happens in generate(), but cheap).
        beam_idx = beam_idx.cpu()
        self.hypo_ids = beam_idx if self.hypo_ids is None else self.hypo_ids[beam_idx]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (transformers 5: the argument is <= 0).

        Raises
        ------
        ValueError
            ``tokens_to_remove`` is positive (transformers' legacy "final length" form,
            which it refuses too).
        """
        if tokens_to_remove > 0:
            raise ValueError(f"crop() takes the number of tokens to remove as a negative integer, got "
                             f"{tokens_to_remove}")
        self.session.position = max(0, self.session.position + tokens_to_remove)

    def pop_hypo_ids(self) -> torch.Tensor | None:
        hypo_ids, self.hypo_ids = self.hypo_ids, None
        return hypo_ids


class _Call:
    """One caller's input to a :class:`RowBatcher`, then its result or error."""

    def __init__(self, x: torch.Tensor):
        self.x, self.result, self.error, self.done = x, None, None, False
        # Inputs are stacked only with inputs of the same kind, run under the same mode.
        self.kind = (x.dtype, x.device, x.shape[-1], torch.is_inference_mode_enabled())


class RowBatcher:
    """Concurrent calls of a row-wise function, made from threads, run as one call.

    The threads of a process serving many sessions (its clients, one per user) then share
    one matrix product instead of one each, as the servers batch their steps. A caller
    that finds no call running leads: it runs the calls queued meanwhile, its own among
    them. When the last run had company, it first takes in the burst of calls arriving
    (until none came for ``gap`` seconds, ``max_wait`` at most), as the sessions of one
    server batch get their replies together. A thread alone runs exactly its own call,
    and waits for no one (but for ``gap`` once, right after it had company).

    Parameters
    ----------
    fn
        The function: each row of its output (all dimensions but the last) depends only
        on the same row of its input.
    max_wait, gap
        Bounds of the wait for company, in seconds.
    """

    def __init__(self, fn, max_wait: float = 0.004, gap: float = 0.001):
        self.fn, self.max_wait, self.gap = fn, max_wait, gap
        self.calls = self.runs = 0  # calls served, and runs of ``fn`` that served them
        lock = threading.Lock()
        self._done = threading.Condition(lock)  # callers wait for their call, or to lead
        self._arrival = threading.Condition(lock)  # a leader waiting for company hears arrivals
        self._queued: list[_Call] = []
        self._running = False
        self._last = 1  # calls taken by the last run

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # a result that autograd records is computed alone
            return self.fn(x)
        call = _Call(x)
        with self._done:
            self._queued.append(call)
            self._arrival.notify()
            while not call.done:
                if self._running:
                    self._done.wait()
                else:
                    self._lead()
        if call.error is not None:
            raise call.error
        return call.result

    def _lead(self) -> None:
        """Run the queued calls (the lock is held, and released while they run)."""
        self._running = True
        try:
            if self._last > 1:
                deadline = time.monotonic() + self.max_wait
                while (left := deadline - time.monotonic()) > 0 and self._arrival.wait(min(left, self.gap)):
                    pass
            batch, self._queued = self._queued, []
            self._last = len(batch)
            self._done.release()
            try:
                self._run(batch)
            except BaseException as e:  # an interrupt: no caller of the batch may wait forever
                for other in batch:
                    if not other.done:
                        other.error, other.done = e, True
            finally:
                self._done.acquire()
        finally:
            self._running = False
            self._done.notify_all()

    def _run(self, batch: list[_Call]) -> None:
        kinds: dict[tuple, list[_Call]] = {}
        for call in batch:
            kinds.setdefault(call.kind, []).append(call)
        for kind, calls in kinds.items():
            with torch.inference_mode(kind[-1]), torch.no_grad():
                if len(calls) > 1:
                    try:
                        rows = [call.x.reshape(-1, call.x.shape[-1]) for call in calls]
                        outs = self.fn(torch.cat(rows)).split([len(r) for r in rows])
                    except Exception:  # someone's input is bad: each alone, so that the others get theirs
                        pass
                    else:
                        for call, out in zip(calls, outs):
                            call.result = out.reshape(*call.x.shape[:-1], out.shape[-1])
                        self.runs += 1
                for call in calls:
                    if call.result is None:
                        try:
                            call.result = self.fn(call.x)
                        except Exception as e:
                            call.error = e
                        self.runs += 1
                    call.done = True
            self.calls += len(calls)


class DistributedModelForCausalLM(PreTrainedModel, GenerationMixin):
    """A Llama-like causal LM whose transformer blocks are served by a swarm.

    Build it with :meth:`from_pretrained`; ``model.embed_tokens``, ``model.norm`` and
    ``lm_head`` are local modules, the blocks are reached through ``self.swarm``.
    """

    base_model_prefix = "model"
    _supports_sdpa = True  # attention runs on the servers; this only satisfies transformers' checks

    def __init__(self, config, swarm: SwarmClient | None = None, *, session_kwargs: dict | None = None):
        super().__init__(config)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.norm = model_class(config, "RMSNorm")(config.hidden_size, eps=config.rms_norm_eps)
        # What the architecture does outside its blocks, as its transformers model does.
        self.embed_scale = config.hidden_size**0.5 if architecture(config).embed_scale else None
        self.logit_softcap = getattr(config, "final_logit_softcapping", None)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.swarm = swarm
        self.session_kwargs = dict(session_kwargs or {})
        self._head_batcher = RowBatcher(self._logits)

    def __getstate__(self):
        # A lock is neither copied nor pickled: a copy gets its own batcher.
        state = dict(super().__getstate__())
        del state["_head_batcher"]
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._head_batcher = RowBatcher(self._logits)

    @classmethod
    def from_pretrained(cls, model_path: str | Path, *, initial_peers: Sequence[str], dht_prefix: str | None = None,
                        dtype: torch.dtype = torch.float32, swarm_timeout: float = 15.0,
                        **session_kwargs) -> "DistributedModelForCausalLM":
        """Load the local parts of the model and connect to the swarm.

        Parameters
        ----------
        model_path
            Directory of the model (config, safetensors weights); only the embeddings,
            the final norm and the head are read.
        initial_peers
            Multiaddresses of peers of the swarm.
        dht_prefix
            Name the servers announce the blocks under (default: the directory's name,
            as the servers do).
        dtype
            Dtype of the local modules and of the hidden states sent.
        swarm_timeout
            Bound of DHT look-ups and connections, in seconds.
        **session_kwargs
            Defaults of :class:`InferenceSession` (``step_timeout``, ``max_retries``,
            ``idle_timeout``, ``compression``).
        """
        config = load_config(model_path)
        swarm = SwarmClient(initial_peers, dht_prefix or default_dht_prefix(model_path), config.num_hidden_layers,
                            timeout=swarm_timeout)
        return cls.local_parts(model_path, dtype, swarm=swarm, session_kwargs=session_kwargs)

    @classmethod
    def local_parts(cls, model_path: str | Path, dtype: torch.dtype = torch.float32, *,
                    swarm: SwarmClient | None = None, session_kwargs: dict | None = None
                    ) -> "DistributedModelForCausalLM":
        """The client's part of the model (embeddings, final norm, head), read from ``model_path``.

        Without ``swarm`` it cannot run its blocks; :meth:`embed` and :meth:`logits` work.

        Raises
        ------
        ValueError
            The architecture is not supported on the swarm.
        """
        config = load_config(model_path)
        model = cls(config, swarm, session_kwargs=session_kwargs)
        names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        weights = read_weights(model_path, names)
        if "lm_head.weight" not in weights:  # tied embeddings
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        model.load_state_dict(weights, strict=True)
        with contextlib.suppress(OSError):
            model.generation_config = GenerationConfig.from_pretrained(model_path)
        model = model.to(dtype).eval()
        # The head is the client's largest cost per token: a GEMV over [vocab, hidden]. The
        # same matrix with transposed storage makes it the other BLAS case, which MKL runs
        # in about 0.6x the time on our CPUs (docs/swarm.md); `.to()` keeps the strides.
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().t().contiguous().t(), requires_grad=False)
        return model

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first block's input for ``input_ids`` (Gemma's embedding scale applied)."""
        x = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from the last block's output: final norm, head, and the logit softcapping if any.

        Calls made at once from several threads (sessions served by one process) run as
        one product over their rows (see :class:`RowBatcher`); each gets its own logits.
        """
        return self._head_batcher(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.model.norm(hidden))
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def inference_session(self, max_length: int, batch_size: int | None = None, **kwargs) -> InferenceSession:
        """Open a session through the swarm (usable as a context manager).

        Parameters
        ----------
        max_length
            Most positions the session will hold.
        batch_size
            Most rows a step may have (default: the rows of the first step).
        **kwargs
            Other :class:`InferenceSession` options.
        """
        options = dict(self.session_kwargs, **kwargs)
        return InferenceSession(self.swarm, max_length, hidden_size=self.config.hidden_size,
                                batch_size=batch_size, **options)

    def shutdown(self) -> None:
        """Disconnect from the swarm."""
        if self.swarm is not None:
            self.swarm.shutdown()

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: SwarmSessionCache | None = None,
                inputs_embeds: torch.Tensor | None = None, logits_to_keep: int = 0, **kwargs
                ) -> CausalLMOutputWithPast:
        """Logits of the new tokens; the blocks run in the session of ``past_key_values``.

        Without a :class:`SwarmSessionCache`, a session is opened for this call only.
        """
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids)
        rows, n = inputs_embeds.shape[:2]
        if not isinstance(past_key_values, SwarmSessionCache):
            with self.inference_session(max_length=n, batch_size=rows) as session:
                return self.forward(attention_mask=attention_mask, position_ids=position_ids,
                                    past_key_values=SwarmSessionCache(session), inputs_embeds=inputs_embeds,
                                    logits_to_keep=logits_to_keep)
        # An all-ones mask is the default: only padding (holes) needs to travel.
        if attention_mask is None or bool(attention_mask.all()):
            attention_mask = position_ids = None
        hidden = past_key_values.session.step(inputs_embeds, past_key_values.pop_hypo_ids(),
                                              attention_mask=attention_mask, position_ids=position_ids)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.logits(hidden[:, keep])
        return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)

    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, *args, session: InferenceSession | None = None,
                 **kwargs):
        """transformers' ``generate()``, with the blocks in a swarm session.

        Parameters
        ----------
        inputs
            [rows, n] token ids appended to the session's tokens (those of earlier
            calls, cut at ``session.position`` if it was rewound); ``None`` continues.
        session
            The session to run in; without one, a session sized for this call is
            opened and closed.
        **kwargs
            Any option of transformers' ``generate()`` (``max_new_tokens``,
            ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
            ``repetition_penalty``, ``num_beams``...).

        Returns
        -------
        torch.LongTensor or ModelOutput
            As transformers', without the tokens of earlier calls in the session.
        """
        if inputs is None:
            inputs = kwargs.pop("input_ids", None)
        if session is None:
            if inputs is None:
                raise ValueError("generate() needs inputs, or a session to continue")
            config = self.generation_config
            max_new = kwargs.get("max_new_tokens", config.max_new_tokens)
            max_length = inputs.shape[1] + max_new if max_new is not None else kwargs.get("max_length",
                                                                                        config.max_length)
            rows = inputs.shape[0] * max(kwargs.get("num_beams", config.num_beams) or 1,
                                         kwargs.get("num_return_sequences", config.num_return_sequences) or 1)
            with self.inference_session(max_length=max_length, batch_size=rows) as session:
                return self.generate(inputs, *args, session=session, **kwargs)

        previous = session.output_ids
        if previous is not None:
            if session.position < session.hf_position:  # rewound: keep the tokens it kept
                previous = previous[:, : session.position]
            inputs = previous if inputs is None else torch.cat([previous, inputs.to(previous.device)], 1)
        if inputs is None:
            raise ValueError("generate(None, session=...) needs a session that has generated before")
        n_previous = 0 if previous is None else previous.shape[1]
        if session.position >= inputs.shape[1]:
            session.position = inputs.shape[1] - 1  # the last token must run again for its logits
        attention_mask = kwargs.pop("attention_mask", None)
        if attention_mask is None:
            # Explicit, so that transformers forwards only the tokens the session does not hold.
            attention_mask = torch.ones_like(inputs)
        elif attention_mask.shape[1] < inputs.shape[1]:
            ones = torch.ones(inputs.shape[0], inputs.shape[1] - attention_mask.shape[1], dtype=attention_mask.dtype)
            attention_mask = torch.cat([ones, attention_mask], 1)
        kwargs.setdefault("pad_token_id", self.generation_config.pad_token_id
                          if self.generation_config.pad_token_id is not None else self.generation_config.eos_token_id)

        cache = SwarmSessionCache(session)
        try:
            result = super().generate(inputs, *args, attention_mask=attention_mask, past_key_values=cache, **kwargs)
        except BaseException:
            # Positions computed by the failed call hold tokens it never returned.
            session.position = min(session.position, session.hf_position)
            raise
        sequences = result if isinstance(result, torch.Tensor) else result.sequences
        session.output_ids, session.hf_position = sequences, session.position
        if cache.hypo_ids is not None or sequences.shape[0] != session.rows:
            # Beam search: the cache rows are beams, not the returned sequences; the next
            # call starts over from the tokens (correct, if slower).
            session.position = session.hf_position = 0
        new = sequences[:, n_previous:]
        if isinstance(result, torch.Tensor):
            return new
        result.sequences = new
        return result

