"""Architectures on the swarm, without a network: the blocks of a server and the client's
local parts together give the logits of the transformers model; others are refused."""

import pytest
import torch
from support.models import build_arch

from continuous.remote.client.bridge import DistributedModelForCausalLM
from continuous.remote.server.blocks import Blocks
from continuous.remote.server.memory import MemoryBudget

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SUPPORTED = ["llama", "qwen2", "mistral", "gemma2"]
TEXT = ("The quick brown fox jumps over the lazy dog, then runs far away into the green hills at dawn, "
        "where seven old farmers count their sheep and sing songs about rivers, winds and distant towns.")


@pytest.fixture(scope="module", params=SUPPORTED)
def arch(request, tmp_path_factory):
    model, tok = build_arch(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return request.param, model, tok, path


def _swarm_parts(path, n_layers):
    return DistributedModelForCausalLM.local_parts(path), Blocks(path, 0, n_layers)


@torch.inference_mode()
def test_prefill_and_decode_equal_transformers(arch):
    name, model, tok, path = arch
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :30]
    assert ids.shape[1] > 2 * (getattr(model.config, "sliding_window", None) or 0)  # past the window
    expected = model(ids).logits
    client, blocks = _swarm_parts(path, model.config.num_hidden_layers)
    cache = blocks.new_cache(0, blocks.end, 64, MemoryBudget(2**30))
    outs = [blocks.step(cache, 0, blocks.end, client.embed(ids[:, :10]), 0, None, None, None)]
    for i in range(10, ids.shape[1]):  # decode one token at a time, past the window
        outs.append(blocks.step(cache, 0, blocks.end, client.embed(ids[:, i:i + 1]), i, None, None, None))
    logits = client.logits(torch.cat(outs, 1))
    assert torch.allclose(logits, expected, atol=1e-4), (name, (logits - expected).abs().max())
    # The head is stored transposed (the faster GEMV), and stays so through a dtype move.
    vocab = model.config.vocab_size
    assert client.lm_head.weight.stride() == (1, vocab)
    assert client.to(torch.float64).lm_head.weight.stride() == (1, vocab)


@torch.inference_mode()
def test_holes_count_real_tokens_in_the_window(arch):
    """A row with masked slots in the middle equals the same row without them: the sliding
    window counts positions (real tokens), not slots."""
    name, model, tok, path = arch
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :24]
    expected = model(ids).logits
    holes = 5
    junk = torch.full((1, holes), 7)
    padded = torch.cat([ids[:, :8], junk, ids[:, 8:]], 1)
    mask = torch.ones_like(padded)
    mask[:, 8:8 + holes] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    client, blocks = _swarm_parts(path, model.config.num_hidden_layers)
    cache = blocks.new_cache(0, blocks.end, 64, MemoryBudget(2**30))
    split = 16  # prefill past the holes, then decode: both paths build the mask
    out = [blocks.step(cache, 0, blocks.end, client.embed(padded[:, :split]), 0, None, mask[:, :split],
                       positions[:, :split])]
    for i in range(split, padded.shape[1]):
        out.append(blocks.step(cache, 0, blocks.end, client.embed(padded[:, i:i + 1]), i, None, mask[:, :i + 1],
                               positions[:, i:i + 1]))
    logits = client.logits(torch.cat(out, 1))
    real = mask[0].bool()
    assert torch.allclose(logits[:, real], expected, atol=1e-4), (name, (logits[:, real] - expected).abs().max())


@pytest.mark.parametrize("name", ["phi3", "gpt2"])
def test_other_architectures_are_refused(name, tmp_path):
    model, tok = build_arch(name)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"{name}.*not supported on the swarm.*supported: gemma2, llama"):
        Blocks(tmp_path, 0, 1)
    with pytest.raises(ValueError, match="not supported on the swarm"):
        DistributedModelForCausalLM.local_parts(tmp_path)


@torch.inference_mode()
def test_a_batch_of_sessions_equals_each_alone(arch):
    """Sessions of different lengths, rows, masks and numbers of new tokens (decode steps,
    a forced run, a fresh prefill) stepped as one forward give what each gives alone
    (allclose: the matrix products differ in shape only)."""
    from continuous.remote.server.blocks import Step

    name, model, tok, path = arch
    _, blocks = _swarm_parts(path, model.config.num_hidden_layers)
    torch.manual_seed(0)
    hidden = blocks.hidden_size
    prompts = [torch.randn(1, 5, hidden), torch.randn(2, 17, hidden), torch.randn(1, 9, hidden), None]
    masks = [None, None, torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]]), None]
    new = [torch.randn(1, 1, hidden), torch.randn(2, 2, hidden), torch.randn(1, 3, hidden),
           torch.randn(1, 11, hidden)]

    def prefilled():
        caches = []
        for p, m, x in zip(prompts, masks, new):
            cache = blocks.new_cache(0, blocks.end, 64, MemoryBudget(2**30))
            if p is not None:
                blocks.step(cache, 0, blocks.end, p, 0, None, None if m is None else m[:, :p.shape[1]], None)
            caches.append(cache)
        return caches

    starts = [0 if p is None else p.shape[1] for p in prompts]
    alone = [blocks.step(c, 0, blocks.end, x, s, None, m, None)
             for c, x, s, m in zip(prefilled(), new, starts, masks)]
    caches = prefilled()
    batched = blocks.step_batch(0, blocks.end, [Step(c, x, s, None, m)
                                                for c, x, s, m in zip(caches, new, starts, masks)])
    for a, b in zip(alone, batched):
        assert a.shape == b.shape
        assert torch.allclose(a, b, atol=1e-5), (name, (a - b).abs().max())
    # Each cache goes on as alone: one more decode step of every session.
    after = [torch.randn(x.shape[0], 1, hidden) for x in new]
    again = blocks.step_batch(0, blocks.end, [Step(c, x, s + n.shape[1], None, None if m is None else
                                                   torch.cat([m, torch.ones(1, 1, dtype=m.dtype)], 1))
                                              for c, x, s, n, m in zip(caches, after, starts, new, masks)])
    for c, x, s, n, m, b in zip(prefilled(), after, starts, new, masks, again):
        blocks.step(c, 0, blocks.end, n, s, None, m, None)
        a = blocks.step(c, 0, blocks.end, x, s + n.shape[1], None,
                        None if m is None else torch.cat([m, torch.ones(1, 1, dtype=m.dtype)], 1), None)
        assert torch.allclose(a, b, atol=1e-5), (name, (a - b).abs().max())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_sliding_window_models_through_servers_equal_transformers(name, tmp_path):
    """Two servers on 127.0.0.1 (two spans), greedy decoding well past the window: the
    tokens of transformers' generate on the same model."""
    from continuous.demo.swarm import Swarm

    model, tok = build_arch(name)
    model.save_pretrained(tmp_path / name)
    tok.save_pretrained(tmp_path / name)
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :16]
    expected = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    half = model.config.num_hidden_layers // 2
    with Swarm(tmp_path / name, tmp_path, cache_bytes=2**26, max_length=256) as swarm:
        swarm.start(f"0:{half}", f"{half}:{model.config.num_hidden_layers}")
        remote = DistributedModelForCausalLM.from_pretrained(tmp_path / name, initial_peers=swarm.maddrs,
                                                             step_timeout=30.0)
        try:
            out = remote.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        finally:
            remote.shutdown()
    assert torch.equal(out, expected)
