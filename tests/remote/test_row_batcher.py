"""The client's head batched across threads: concurrent sessions of one process share one
product over their rows, and each gets its own logits and its own errors."""

import copy
import threading
import time

import pytest
import torch

from continuous.remote.client.bridge import DistributedModelForCausalLM
from continuous.remote.client.head import RowBatcher

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def _gated(fn, batcher_of, n):
    """``fn``, whose first run waits until ``n - 1`` other calls are queued behind it."""
    first = threading.Event()

    def run(x):
        if not first.is_set():
            first.set()
            deadline = time.monotonic() + 10
            while len(batcher_of()._queued) < n - 1:
                assert time.monotonic() < deadline, "the other calls never queued"
                time.sleep(0.001)
        return fn(x)

    return run


def _in_threads(fn, inputs, modes=None):
    """``fn`` on each input in its own thread (under no_grad, or the given context per input)."""
    results = [None] * len(inputs)

    def call(i):
        with (modes[i] if modes else torch.no_grad()):
            try:
                results[i] = fn(inputs[i])
            except Exception as e:
                results[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return results


def test_concurrent_logits_share_a_product_and_equal_each_alone(swarm_model_dir):
    model = DistributedModelForCausalLM.local_parts(swarm_model_dir)
    hidden = [torch.randn(rows, n, model.config.hidden_size) for rows, n in [(1, 1), (2, 1), (1, 3), (1, 1), (3, 2)]]
    with torch.no_grad():
        alone = [model.logits(h) for h in hidden]
    batcher = model._head_batcher
    calls, runs = batcher.calls, batcher.runs
    batcher.fn = _gated(batcher.fn, lambda: batcher, len(hidden))
    results = _in_threads(model.logits, hidden)
    # The first call ran alone, the four queued behind it as one product.
    assert (batcher.calls - calls, batcher.runs - runs) == (5, 2)
    for got, want in zip(results, alone):
        assert got.shape == want.shape
        # Rows of a product round as the same rows alone, up to the order of a sum.
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_bad_input_fails_alone_and_the_batcher_goes_on():
    def fn(x):
        if (x < 0).any():
            raise ValueError("negative input")
        return x * 2

    batcher = RowBatcher(fn)
    batcher.fn = _gated(fn, lambda: batcher, 4)
    inputs = [torch.ones(1, 4), torch.ones(2, 4), -torch.ones(1, 4), torch.full((1, 1, 4), 3.0)]
    results = _in_threads(batcher, inputs)
    assert isinstance(results[2], ValueError)
    for i in (0, 1, 3):
        assert torch.equal(results[i], inputs[i] * 2)
    with torch.no_grad():
        assert torch.equal(batcher(torch.ones(1, 4)), torch.full((1, 4), 2.0))  # usable afterwards


def test_each_call_keeps_its_autograd_mode_and_kind():
    batcher = RowBatcher(lambda x: x + 1)
    batcher.fn = _gated(batcher.fn, lambda: batcher, 4)
    inputs = [torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(2, 5), torch.zeros(1, 3, dtype=torch.float64)]
    modes = [torch.no_grad(), torch.inference_mode(), torch.inference_mode(), torch.no_grad()]
    results = _in_threads(batcher, inputs, modes)
    assert [r.is_inference() for r in results] == [False, True, True, False]
    assert [r.shape for r in results] == [x.shape for x in inputs]
    assert results[3].dtype == torch.float64 and all(torch.equal(r, x + 1) for r, x in zip(results, inputs))
    # Stacked only within a kind (dtype, width, mode): the first ran alone, then 3 kinds.
    assert batcher.runs == 4


def test_an_interrupt_reaches_every_caller_of_its_batch():
    class Interrupt(BaseException):
        pass

    def fn(x):
        if len(x) > 1:
            raise Interrupt()
        return x

    batcher = RowBatcher(fn)
    batcher.fn = _gated(fn, lambda: batcher, 3)
    caught = []

    def call(x):
        try:
            with torch.no_grad():
                return batcher(x)
        except Interrupt as e:
            caught.append(e)

    threads = [threading.Thread(target=call, args=(torch.ones(1, 2),)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads) and len(caught) == 2  # the two stacked ones
    with torch.no_grad():
        assert torch.equal(batcher(torch.ones(1, 2)), torch.ones(1, 2))


def test_with_grad_the_head_runs_alone_and_a_copy_has_its_own_batcher(swarm_model_dir):
    model = DistributedModelForCausalLM.local_parts(swarm_model_dir)
    hidden = torch.randn(1, 2, model.config.hidden_size, requires_grad=True)
    model.logits(hidden).sum().backward()  # autograd goes through
    assert hidden.grad is not None and model._head_batcher.calls == 0
    twin = copy.deepcopy(model)
    assert twin._head_batcher is not model._head_batcher and twin._head_batcher.fn.__self__ is twin
    with torch.no_grad():
        assert torch.equal(twin.logits(hidden), model.logits(hidden))


def test_after_company_a_leader_takes_in_the_burst_and_alone_it_never_waits():
    batcher = RowBatcher(lambda x: x * 3, max_wait=60.0, gap=60.0)
    # Alone (the last run took one call): no wait, however long max_wait is.
    assert torch.equal(_in_threads(batcher, [torch.ones(1, 2)])[0], torch.full((1, 2), 3.0))
    assert batcher.runs == 1
    # Company: one alone, then two together; the next leader will wait for arrivals.
    batcher.fn = _gated(batcher.fn, lambda: batcher, 3)
    batcher.gap = 0.2
    _in_threads(batcher, [torch.ones(1, 2)] * 3)
    assert (batcher.calls, batcher.runs, batcher._last) == (4, 3, 2)
    batcher.gap = 60.0
    results = []

    def call():
        with torch.no_grad():
            results.append(batcher(torch.ones(1, 2)))

    leader = threading.Thread(target=call)
    leader.start()
    deadline = time.monotonic() + 10
    while not batcher._running:  # it leads, and waits for company
        assert time.monotonic() < deadline and leader.is_alive()
        time.sleep(0.001)
    batcher.gap = 0.3  # after the next arrival, the wait for more ends in 0.3 s
    second = threading.Thread(target=call)
    second.start()
    for t in (second, leader):
        t.join(30)
    assert len(results) == 2 and all(torch.equal(r, torch.full((1, 2), 3.0)) for r in results)
    assert (batcher.calls, batcher.runs) == (6, 4)  # the two calls in one run
