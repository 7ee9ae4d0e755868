"""generate() over the swarm equals the local model's, token for token."""

import pytest
import torch
from transformers import DynamicCache

from continuous.kv import CACHE_ARG

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # the first test also starts the swarm


def test_greedy(remote_model, local_model, prompt):
    expected = local_model.generate(prompt, max_new_tokens=12, do_sample=False)
    out = remote_model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, expected)


def test_sampling_with_seed(remote_model, local_model, prompt):
    options = dict(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=50, top_p=0.9,
                   repetition_penalty=1.3)
    torch.manual_seed(123)
    expected = local_model.generate(prompt, **options)
    torch.manual_seed(123)
    out = remote_model.generate(prompt, **options)
    assert torch.equal(out, expected)


def test_beam_search(remote_model, local_model, prompt):
    expected = local_model.generate(prompt, max_new_tokens=10, num_beams=3, do_sample=False)
    out = remote_model.generate(prompt, max_new_tokens=10, num_beams=3, do_sample=False)
    assert torch.equal(out, expected)


def test_turns_of_one_session(remote_model, local_model, prompt):
    turn2 = torch.tensor([[61, 62, 63]])
    with remote_model.inference_session(max_length=64) as session:
        out1 = remote_model.generate(prompt, session=session, max_new_tokens=5)
        out2 = remote_model.generate(turn2, session=session, max_new_tokens=5)
        out3 = remote_model.generate(None, session=session, max_new_tokens=4)
        # Only the last generated token is not in the servers' caches yet.
        assert session.position == prompt.shape[1] + 5 + 3 + 5 + 4 - 1
    full = torch.cat([out1, out2, out3], 1)
    expected1 = local_model.generate(prompt, max_new_tokens=5, do_sample=False)
    expected2 = local_model.generate(torch.cat([expected1, turn2], 1), max_new_tokens=5, do_sample=False)
    expected3 = local_model.generate(expected2, max_new_tokens=4, do_sample=False)
    assert torch.equal(full, expected3)


def test_rewind(remote_model, local_model, prompt):
    other = torch.tensor([[70, 71, 72, 73]])
    with remote_model.inference_session(max_length=64) as session:
        remote_model.generate(prompt, session=session, max_new_tokens=6)
        session.position = 4  # keep the first 4 tokens of the prompt
        out = remote_model.generate(other, session=session, max_new_tokens=6)
        with pytest.raises(ValueError):
            session.position = session.position + 1  # only backwards
    expected = local_model.generate(torch.cat([prompt[:, :4], other], 1), max_new_tokens=6, do_sample=False)
    assert torch.equal(out, expected[:, 4:])


def test_left_padded_batch(remote_model, local_model):
    ids = torch.tensor([[1, 1, 0, 5, 17, 300], [0, 44, 45, 46, 47, 48]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    expected = local_model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=1)
    out = remote_model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=1)
    assert torch.equal(out, expected)


def _local_logits(local_model, ids, cache, **kwargs):
    return local_model(ids, **{CACHE_ARG: cache}, use_cache=True, **kwargs).logits


def _remote_logits(remote_model, session, ids, **kwargs):
    hidden = session.step(remote_model.model.embed_tokens(ids), **kwargs)
    return remote_model.lm_head(remote_model.model.norm(hidden))


@torch.inference_mode()
def test_step_rewind_fork_and_masks(remote_model, local_model):
    """The low-level API the core's backend uses: explicit start, hypo_ids fork, masks, positions."""
    a = torch.tensor([[0, 11, 12, 13, 14, 15]])
    with remote_model.inference_session(max_length=32, batch_size=3) as session:
        logits = _remote_logits(remote_model, session, a)
        cache = DynamicCache(config=local_model.config)
        assert torch.allclose(logits, _local_logits(local_model, a, cache), atol=1e-4)

        # Rewind to 4 positions and fork row 0 into two rows, each continuing differently.
        b = torch.tensor([[20, 21], [30, 31]])
        logits = _remote_logits(remote_model, session, b, hypo_ids=torch.tensor([0, 0]), start_position=4)
        assert session.position == 6 and session.rows == 2
        for row in range(2):
            cache = DynamicCache(config=local_model.config)
            expected = _local_logits(local_model, torch.cat([a[:, :4], b[row : row + 1]], 1), cache)[:, 4:]
            assert torch.allclose(logits[row : row + 1], expected, atol=1e-4)

        # A hole: the new token of row 1 must not see position 2, and sits at RoPE position 5;
        # explicit mask and positions, as the core sends them.
        mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 1, 1]])
        c = torch.tensor([[40], [41]])
        positions = torch.tensor([[6], [5]])
        logits = _remote_logits(remote_model, session, c, attention_mask=mask, position_ids=positions)
        for row in range(2):
            cache = DynamicCache(config=local_model.config)
            _local_logits(local_model, torch.cat([a[:, :4], b[row : row + 1]], 1), cache)
            expected = _local_logits(local_model, c[row : row + 1], cache, attention_mask=mask[row : row + 1],
                                     position_ids=positions[row : row + 1])
            assert torch.allclose(logits[row], expected[0], atol=1e-4)


@torch.inference_mode()
def test_fork(remote_model, local_model, prompt):
    """Two sessions sharing a prefix both continue correctly."""
    embed = remote_model.model.embed_tokens
    with remote_model.inference_session(max_length=32) as a:
        a.step(embed(prompt))
        with a.fork() as b:
            assert b.position == a.position
            out_a = a.step(embed(torch.tensor([[21]])))
            out_b = b.step(embed(torch.tensor([[22]])))
            assert [s[0] for s in a.servers] != [] and b.position == a.position
    for token, out in ((21, out_a), (22, out_b)):
        ids = torch.cat([prompt, torch.tensor([[token]])], 1)
        expected = local_model(ids).logits[:, -1]
        logits = remote_model.lm_head(remote_model.model.norm(out))[:, -1]
        assert torch.allclose(logits, expected, atol=1e-4)
