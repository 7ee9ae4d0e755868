"""``models.transformers(..., compile=True)``: compiled decode steps on fixed shapes equal eager ones.

On a CPU this runs inductor (seconds per new shape); on CUDA the same path also
captures CUDA graphs ("reduce-overhead"). The compiled step attends over the whole
buffer capacity, so it also checks that unused slots can never leak into attention.
"""

import pytest
import torch
from support.models import build_arch

from continuous import continuous, generate, models

pytestmark = pytest.mark.slow  # make test-fast leaves it out

PROMPTS = ["User: Tell me about Omar and his twelve cats, one by one.\nAssistant:", "Hi"]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])  # sdpa; sliding window; eager + hybrid
def test_compiled_decode_equals_eager(arch, device):
    hf, tok = build_arch(arch, max_position_embeddings=256)
    hf = hf.to(device)
    eager = models.transformers(hf, tok)
    ref = continuous(generate.text(eager))(PROMPTS, max_tokens=40)
    ref_more = continuous(generate.text(eager))(ref + [" and", " then a much longer addition"], max_tokens=30)
    compiled = models.transformers(hf, tok, compile=True)
    assert compiled is not eager and compiled.compiled is not None
    gen = continuous(generate.text(compiled))
    out = gen(PROMPTS, max_tokens=40)  # crosses the first buffer's capacity (64 slots): a new shape
    more = gen(out + [" and", " then a much longer addition"], max_tokens=30)  # holes between turns
    for a, b in ((out, ref), (more, ref_more)):
        assert list(a) == list(b)
        assert torch.equal(a.token_ids, b.token_ids)
        assert torch.allclose(a.weights, b.weights, atol=1e-3)
    assert compiled.stats.tokens_forwarded == eager.stats.tokens_forwarded
    # One row, every slot real: steps are queued before the host reads the ids (CUDA's
    # default), through the compiled step, and give the same text.
    compiled.overlap = True
    one = gen(PROMPTS[0], max_tokens=20)
    assert list(one) == list(continuous(generate.text(eager))(PROMPTS[0], max_tokens=20))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_steps_run_on_every_thread_that_drives_a_step(device):
    """Concurrent async calls drive steps from worker threads: on CUDA each replays the
    graphs the main thread recorded."""
    import asyncio
    import threading

    hf, tok = build_arch("llama", max_position_embeddings=256)
    hf = hf.to(device)
    model = models.transformers(hf, tok, compile=True)
    gen = continuous(generate.text(model))
    prompts = [f"User: count to {i}.\nAssistant:" for i in range(3)]
    alone = [str(gen(p, max_tokens=12)) for p in prompts]  # records the graphs on this thread
    threads, step = set(), model._static_step
    model._static_step = lambda *args: threads.add(threading.get_ident()) or step(*args)

    async def together():
        return await asyncio.gather(*[gen.acall(p, max_tokens=12) for p in prompts])

    assert [str(s) for s in asyncio.run(together())] == alone
    assert str(asyncio.run(gen.acall(prompts[0], max_tokens=12))) == alone[0]  # alone, on a worker thread
    assert threads - {threading.get_ident()}  # compiled steps ran on another thread
    assert alone == [str(continuous(generate.text(models.transformers(hf, tok)))(p, max_tokens=12)) for p in prompts]


def test_merged_steps_run_compiled_on_a_few_row_counts_and_equal_each_call_alone(monkeypatch):
    """Where merged steps are compiled (CUDA's default), calls of several kinds that leave at
    different steps each give what they give alone; the stacked rows keep to buckets."""
    from pydantic import BaseModel

    from continuous.models.table import ALL

    class City(BaseModel):
        name: str
        people: int

    hf, tok = build_arch("llama", max_position_embeddings=256)
    model = models.transformers(hf, tok, compile=True)
    model.compiled = torch.compile(model._step, backend="eager", dynamic=False)  # dynamo's tracing only: fast
    model.joint.compiled = True
    text, json = continuous(generate.text(model)), continuous(generate.json(model, City))
    asks = [(text, "Once upon", 3), (text, "User: tell me about Lima.\nAssistant:", 9), (json, "A city:", 12),
            (text, "A list: 1, 2,", 20), (json, "Another city:", 20)]
    alone = [gen(p, max_tokens=n) for gen, p, n in asks]
    rows, step = [], model._static_step
    monkeypatch.setattr(model, "_static_step", lambda ids, *a: rows.append(ids.shape[0]) or step(ids, *a))
    monkeypatch.setattr(model.engine, "_start_thread", lambda: None)  # stepped by hand, below
    streams = [gen.stream(p, max_tokens=n) for gen, p, n in asks]
    calls = [s._submitted() for s in streams]
    for call in calls:
        model.engine.ask(call, ALL)
    while not all(c.done for c in calls):
        model.engine.step()
    for a, s in zip(alone, streams):
        b = s.run()
        assert str(a) == str(b) and a.token_ids.tolist() == b.token_ids.tolist()
        # Copied out of the stacked rows, each layer still a tensor of its own: a compiled step's inputs.
        assert len(b.kv_cache.holder().groups) == b.kv_cache.layers == len(model.kinds)
    assert 8 in rows and set(rows) <= {1, 2, 4, 8}  # five calls on eight rows, then fewer


def test_a_copied_buffer_does_not_compile_the_step_again():
    from torch._dynamo.utils import counters

    hf, tok = build_arch("llama", max_position_embeddings=256)
    gen = continuous(generate.text(models.transformers(hf, tok, compile=True)))
    base = gen("Hello there", max_tokens=0)
    first = gen(base, max_tokens=4)  # compiles; appends to base's buffer in place
    graphs = counters["stats"]["unique_graphs"]
    again = gen(base, max_tokens=4)  # base is no longer its buffer's tip: a copy of it
    assert again.kv_cache._buffer is not first.kv_cache._buffer
    assert counters["stats"]["unique_graphs"] == graphs
    assert list(again) == list(first)


def test_every_batch_size_stays_compiled_past_dynamos_default_limit():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # shapes other tests compiled for the same step would not count again
    hf, tok = build_arch("llama", max_position_embeddings=256)
    model = models.transformers(hf, tok, compile=True)
    # Dynamo's tracing only (backend "eager"): the shapes are what is counted, not kernels.
    model.compiled = torch.compile(model._step, backend="eager", dynamic=False)
    gen = continuous(generate.text(model))
    eager = continuous(generate.text(models.transformers(hf, tok)))
    graphs = counters["stats"]["unique_graphs"]
    for rows in range(1, 11):  # ten shapes: dynamo alone would stop compiling after eight
        assert list(gen(["Hi"] * rows, max_tokens=3)) == list(eager(["Hi"] * rows, max_tokens=3))
    assert counters["stats"]["unique_graphs"] - graphs == 10


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_a_short_run_of_tokens_is_one_compiled_step(arch):
    hf, tok = build_arch(arch, max_position_embeddings=256)
    eager = models.transformers(hf, tok)
    compiled = models.transformers(hf, tok, compile=True)
    compiled.compiled = torch.compile(compiled._step, backend="eager", dynamic=False)  # dynamo's graphs only
    calls = []
    step = compiled._static_step
    compiled._static_step = lambda ids, *a: calls.append(ids.shape[1]) or step(ids, *a)
    ids = tok("User: Tell me about Omar and his twelve cats, one by one.", return_tensors="pt").input_ids
    run = tok(" One, two and three", add_special_tokens=False, return_tensors="pt").input_ids[:, :3]
    results = []
    for model in (eager, compiled):
        _, cache = model.forward(ids, None, None)  # a prefill: eager in both
        logits, after = model.forward(run, None, cache)  # three tokens: padded to a width of 4
        nxt, _ = model.forward(run[:, -1:], None, after)  # reads the three slots written
        results.append((logits, nxt, after))
    assert calls == [4, 1]
    (l1, n1, a1), (l2, n2, a2) = results
    assert torch.allclose(l1[:, -1], l2[:, -1], atol=1e-4) and torch.allclose(n1, n2, atol=1e-4)
    # The pads' slots went back: the state of the run is its buffer's tip again.
    assert a2.length == ids.shape[1] + 3 and a2._buffer.filled == a2.length + 1
    # The tokens a constraint forces run compiled too, with the same text.
    schema = '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, ' \
             '"required": ["name", "age"]}'
    texts = [str(continuous(generate.json(m, schema, whitespace_pattern=""))("Omar as JSON:", max_tokens=24))
             for m in (eager, compiled)]
    assert texts[0] == texts[1]
    assert any(1 < w <= 8 for w in calls[2:])


def test_inductor_options_freeze_the_weights_and_keep_the_outputs():
    """``compile=`` as inductor's options: frozen weights and its C++ GEMM templates, eager's tokens."""
    hf, tok = build_arch("llama", max_position_embeddings=256)
    ref = continuous(generate.text(models.transformers(hf, tok)))(PROMPTS, max_tokens=20)
    options = {"freezing": True, "max_autotune": True}
    model = models.transformers(hf, tok, compile=options)
    assert model is models.transformers(hf, tok, compile=dict(reversed(options.items())))
    out = continuous(generate.text(model))(PROMPTS, max_tokens=20)
    assert list(out) == list(ref) and torch.equal(out.token_ids, ref.token_ids)
    assert not torch._inductor.config.freezing  # set around the compiled calls only
    with pytest.raises(ValueError, match="no_such_option"):
        models.transformers(hf, tok, compile={"no_such_option": True})


def test_a_frozen_step_reads_the_cache_of_the_state_it_continues():
    """Frozen, only the weights are constants: after one prompt, another (of another length) gets eager's tokens."""
    hf, tok = build_arch("llama", max_position_embeddings=256)
    eager = continuous(generate.text(models.transformers(hf, tok)))
    frozen = continuous(generate.text(models.transformers(hf, tok, compile={"freezing": True})))
    first, other = PROMPTS
    assert list(frozen(first, max_tokens=4)) == list(eager(first, max_tokens=4))  # compiled on this state's buffer
    for _ in range(2):  # a new state's buffer, of the same capacity: the same compiled step
        out, ref = frozen(other, max_tokens=8), eager(other, max_tokens=8)
        assert str(out) == str(ref) and torch.equal(out.token_ids, ref.token_ids)
        assert torch.allclose(out.weights, ref.weights, atol=1e-3)
