"""The swarm: servers hold spans of blocks and their sessions' attention caches.

Client side, Petals style::

    from continuous.remote import DistributedModelForCausalLM
    model = DistributedModelForCausalLM.from_pretrained(path, initial_peers=[maddr])
    with model.inference_session(max_length=512) as session:
        out = model.generate(inputs, session=session, max_new_tokens=20)

Low level (what a backend needs): ``session.step(hidden_states, hypo_ids, start_position=...,
attention_mask=..., position_ids=...)`` runs new positions through all blocks, after
dropping the positions from ``start_position`` on and selecting rows ``hypo_ids``;
``session.fork()`` copies a session; ``session.close()`` frees the servers' caches.

Server side: ``python -m continuous.remote.server --model PATH --blocks 0:6 --new-swarm``.
Heavy modules (torch, hivemind) are imported on first use, so that ``import
continuous.remote`` is cheap and the server's ``--help`` answers at once.
"""

_ERRORS = ("RemoteError", "BadRequestError", "MaxLengthError", "AllocationError", "SessionTimeoutError",
           "ServerShutdownError", "ProtocolError", "ServerFaultError")

__all__ = ["DistributedModelForCausalLM", "InferenceSession", "SwarmClient", *_ERRORS]

_LAZY = {"DistributedModelForCausalLM": "continuous.remote.client.bridge",
         "InferenceSession": "continuous.remote.client.session", "SwarmClient": "continuous.remote.client.routing",
         **dict.fromkeys(_ERRORS, "continuous.remote.wire.protocol")}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
