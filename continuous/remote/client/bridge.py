"""A transformers causal LM whose blocks run in the swarm: embeddings, norm and head are local.

``generate()`` is transformers' own: the model's cache is a
:class:`SwarmSessionCache` that only knows the session's position and turns beam search's
``reorder_cache`` into the ``hypo_ids`` of the next step, so every decoding strategy of
transformers works unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import nn
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from continuous.kv import CACHE_ARG
from continuous.remote.client.head import RowBatcher
from continuous.remote.client.routing import SwarmClient
from continuous.remote.client.session import InferenceSession
from continuous.remote.wire.checkpoint import (
    architecture,
    load_config,
    model_class,
    read_weights,
)
from continuous.remote.wire.protocol import default_dht_prefix

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

    # The cache has no layer objects here; transformers reads these to know that it is an
    # attention cache (so that a call on a session's tokens forwards only the new ones).
    @property
    def is_linear(self) -> list[bool]:
        return [False]

    @property
    def is_sliding(self) -> list[bool]:
        return [False]

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
                position_ids: torch.LongTensor | None = None, inputs_embeds: torch.Tensor | None = None,
                logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        """Logits of the new tokens; the blocks run in the session of the cache passed.

        The cache comes as ``cache`` or ``past_key_values`` (the name transformers used
        before); without a :class:`SwarmSessionCache`, a session is opened for this call only.
        """
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids)
        rows, n = inputs_embeds.shape[:2]
        if not isinstance(cache, SwarmSessionCache):
            with self.inference_session(max_length=n, batch_size=rows) as session:
                return self.forward(attention_mask=attention_mask, position_ids=position_ids,
                                    inputs_embeds=inputs_embeds, logits_to_keep=logits_to_keep,
                                    cache=SwarmSessionCache(session))
        # An all-ones mask is the default: only padding (holes) needs to travel.
        if attention_mask is None or bool(attention_mask.all()):
            attention_mask = position_ids = None
        hidden = cache.session.step(inputs_embeds, cache.pop_hypo_ids(), attention_mask=attention_mask,
                                    position_ids=position_ids)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return CausalLMOutputWithPast(logits=self.logits(hidden[:, keep]), **{CACHE_ARG: cache})

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
            with self._session_for(inputs, kwargs) as session:
                return self.generate(inputs, *args, session=session, **kwargs)
        record = _GENERATED.setdefault(session, _Generated())
        inputs, n_previous = record.inputs(session, inputs)
        if session.position >= inputs.shape[1]:
            session.position = inputs.shape[1] - 1  # the last token must run again for its logits
        attention_mask = _full_mask(kwargs.pop("attention_mask", None), inputs)
        config = self.generation_config
        kwargs.setdefault("pad_token_id", config.pad_token_id if config.pad_token_id is not None
                          else config.eos_token_id)
        cache = SwarmSessionCache(session)
        try:
            result = super().generate(inputs, *args, attention_mask=attention_mask, **{CACHE_ARG: cache}, **kwargs)
        except BaseException:
            # Positions computed by the failed call hold tokens it never returned.
            session.position = min(session.position, record.position)
            raise
        sequences = result if isinstance(result, torch.Tensor) else result.sequences
        record.ids, record.position = sequences, session.position
        if cache.hypo_ids is not None or sequences.shape[0] != session.rows:
            # Beam search: the cache rows are beams, not the returned sequences; the next
            # call starts over from the tokens (correct, if slower).
            session.position = record.position = 0
        new = sequences[:, n_previous:]
        if isinstance(result, torch.Tensor):
            return new
        result.sequences = new
        return result

    def _session_for(self, inputs: torch.Tensor, kwargs: dict) -> InferenceSession:
        """A session sized for one ``generate()`` call (its tokens, beams and returned sequences)."""
        config = self.generation_config
        max_new = kwargs.get("max_new_tokens", config.max_new_tokens)
        max_length = inputs.shape[1] + max_new if max_new is not None else kwargs.get("max_length",
                                                                                    config.max_length)
        rows = inputs.shape[0] * max(kwargs.get("num_beams", config.num_beams) or 1,
                                     kwargs.get("num_return_sequences", config.num_return_sequences) or 1)
        return self.inference_session(max_length=max_length, batch_size=rows)


@dataclass
class _Generated:
    """What ``generate()`` produced in a session: its tokens, and the session's position after them."""

    ids: torch.Tensor | None = None
    position: int = 0

    def inputs(self, session: InferenceSession, new: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """The tokens a call runs on (the earlier calls' as kept by a rewind, then ``new``) and how many are old."""
        previous = self.ids
        if previous is not None and session.position < self.position:  # rewound: keep the tokens it kept
            previous = previous[:, : session.position]
        if previous is None:
            if new is None:
                raise ValueError("generate(None, session=...) needs a session that has generated before")
            return new, 0
        return (previous if new is None else torch.cat([previous, new.to(previous.device)], 1)), previous.shape[1]


# The bridge's own record of each session it generated in (the session knows nothing of it).
_GENERATED: "weakref.WeakKeyDictionary[InferenceSession, _Generated]" = weakref.WeakKeyDictionary()


def _full_mask(attention_mask: torch.Tensor | None, inputs: torch.Tensor) -> torch.Tensor:
    """An explicit mask over all the tokens, so that transformers forwards only those the session lacks."""
    if attention_mask is None:
        return torch.ones_like(inputs)
    if attention_mask.shape[1] < inputs.shape[1]:
        ones = torch.ones(inputs.shape[0], inputs.shape[1] - attention_mask.shape[1], dtype=attention_mask.dtype)
        return torch.cat([ones, attention_mask], 1)
    return attention_mask
