"""speculate= over the swarm: a draft is checked in one round trip, and a rejection costs none."""

import collections

import pytest
from pydantic import BaseModel, Field
from support.models import build_llama
from support.states import real_ids

from continuous import PromptLookup, continuous, generate, models
from continuous.decode.speculate import DraftModel
from continuous.remote.client.session import ServerSession

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # the first test also starts the swarm

# Prompts to copy from: the test model soon loops on what it wrote (drafts copied from it
# pass), and a JSON prompt gives JSON drafts (which the random model rejects).
PROMPTS = {"text": "abc abd abe abf", "json": 'abc abd abe abf {"name":"abc","count":12}'}


class Item(BaseModel):
    name: str = Field(max_length=8)
    count: int = Field(ge=0, le=999)


@pytest.fixture(scope="module")
def remote(swarm, swarm_model_dir):
    model = models.remote(swarm_model_dir, initial_peers=swarm.maddrs, max_length=64, max_batch=2,
                          step_timeout=20.0)
    try:
        yield model
    finally:
        model.model.shutdown()


@pytest.fixture
def server_steps(monkeypatch):
    """Step messages sent to the servers, per span of blocks."""
    counts = collections.Counter()
    send = ServerSession.step_async

    async def counted(self, *args, **kwargs):
        counts[self.hop.start, self.hop.end] += 1
        return await send(self, *args, **kwargs)

    monkeypatch.setattr(ServerSession, "step_async", counted)
    return counts


GENERATORS = {"text": lambda m: generate.text(m), "json": lambda m: generate.json(m, Item, whitespace_pattern="")}


@pytest.mark.parametrize("kind", list(GENERATORS))
def test_drafts_go_through_the_servers_in_one_round_trip_each(remote, server_steps, kind):
    gen = continuous(GENERATORS[kind](remote))
    base = gen(PROMPTS[kind], max_tokens=0)  # prefilled: the calls below count their own steps only
    plain = gen(base, max_tokens=24)
    held = plain._rows.cache.length  # (the next call rewinds the session that both share)
    before = remote.stats.snapshot()
    server_steps.clear()
    state = gen(base, max_tokens=24, speculate=PromptLookup(k=8, ngram=3))
    assert real_ids(state) == real_ids(plain) and str(state) == str(plain)
    assert state.value == plain.value
    forwards = remote.stats.forward_calls - before["forward_calls"]
    # Each forward is one step message to each server of the chain: the rewind after a
    # rejected draft goes with the next step, never on its own.
    assert set(server_steps.values()) == {forwards} and len(server_steps) >= 2
    outputs = len(real_ids(state)) - len(real_ids(base))
    assert remote.stats.tokens_drafted > before["tokens_drafted"]
    assert forwards < outputs
    if kind == "text":
        assert remote.stats.tokens_accepted > before["tokens_accepted"]
    # Rejected drafts leave no slot behind: the session holds what the call without drafts holds.
    assert state.attention_mask.shape == plain.attention_mask.shape and bool(state.attention_mask.all())
    assert state._rows.cache.length == held


def test_rejected_drafts_do_not_fill_the_session(remote):
    """A draft model that is mostly wrong drafts at every step: the slots its rejected tokens
    took are written over, so a session of 64 positions holds a call of 60 tokens."""
    other = models.transformers(build_llama(remote.tokenizer, "tiny", seed=1, max_position_embeddings=512),
                                remote.tokenizer)
    gen = continuous(generate.text(remote))
    prompt = "the cat sat on the mat"
    n = remote.max_length - len(remote.tokenizer(prompt).input_ids) - 4
    plain = gen(prompt, max_tokens=n)
    before = remote.stats.snapshot()
    state = gen(prompt, max_tokens=n, speculate=DraftModel(other, k=4))
    assert real_ids(state) == real_ids(plain)
    drafted = remote.stats.tokens_drafted - before["tokens_drafted"]
    accepted = remote.stats.tokens_accepted - before["tokens_accepted"]
    assert drafted - accepted > remote.max_length  # holes left in place would not have fit
