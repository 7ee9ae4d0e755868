"""models.remote: SequenceStates whose cache lives in a swarm session behave exactly as local ones."""

import pytest

from continuous import continuous, generate, models, samplers

pytestmark = pytest.mark.slow  # make test-fast leaves it out


@pytest.fixture(scope="module")
def pair(swarm, swarm_model_dir):
    remote = models.remote(swarm_model_dir, initial_peers=swarm.maddrs, max_length=256, max_batch=6,
                           step_timeout=20.0)
    local = models.transformers(swarm_model_dir)
    try:
        yield local, remote
    finally:
        remote.model.shutdown()


def run(model, script):
    """Apply the same operations on one backend; return the texts and tokens forwarded of each step."""
    gen = continuous(generate.text(model))
    out, state = [], None
    for op, arg in script:
        before = model.stats.tokens_forwarded
        if op == "prompt":
            state = gen(arg, max_tokens=5)
        elif op == "gen":
            state = gen(state, max_tokens=arg)
        elif op == "add":
            state = state + arg
        elif op == "slice":
            state = state[0:state.batch_size, :arg]
        elif op == "sum":
            state = state + state
        elif op == "row":
            state = state[arg:arg + 1, :]
        elif op == "fork":
            state = continuous(generate.text(model, samplers.multinomial(3, top_k=1)))(state, max_tokens=arg)
        out.append((list(state), model.stats.tokens_forwarded - before))
    return out


SCRIPT = [("prompt", ["Alice is 30", "Order #12: 3 x lamp"]), ("gen", 4), ("add", " and Bob"), ("gen", 3),
          ("slice", 14), ("gen", 3), ("sum", None), ("gen", 2), ("row", 1), ("gen", 3), ("fork", 3)]


def test_remote_states_match_local_ones_token_for_token(pair):
    local, remote = pair
    assert run(remote, SCRIPT) == run(local, SCRIPT)


def test_branches_of_one_session_continue_in_any_order(pair):
    local, remote = pair
    results = []
    for model in (local, remote):
        gen = continuous(generate.text(model))
        base = gen("Alice lives in", max_tokens=4)
        a, b = base + " Paris", base + " Lima"
        results.append([list(gen(a, max_tokens=4)), list(gen(b, max_tokens=4)), list(gen(a, max_tokens=4)),
                        list(gen(base[:6], max_tokens=4))])
    assert results[0] == results[1]


def test_json_on_the_swarm(pair):
    local, remote = pair
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"]}
    values = [continuous(generate.json(m, schema, whitespace_pattern=""))("JSON:", max_tokens=30).value
              for m in (local, remote)]
    assert values[0] == values[1] and set(values[0]) == {"ok", "n"}


def test_a_client_s_normal_exit_logs_nothing(swarm, swarm_model_dir):
    import subprocess
    import sys

    client = ("import sys; from continuous import continuous, generate, models; "
              "m = models.remote(sys.argv[1], initial_peers=sys.argv[2:], max_length=128, max_batch=1); "
              "print(str(continuous(generate.text(m))('Hello', max_tokens=3)))")
    done = subprocess.run([sys.executable, "-c", client, str(swarm_model_dir), *swarm.maddrs],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("Hello")
    logged = [line for line in done.stderr.splitlines() if "Loading weights" not in line and line.strip()]
    assert logged == []
