"""The examples, run as a user runs them (``python examples/X.py --quick``) on the shipped model.

Each test checks what the example shows, not only that it exits: the turns of a chat
forward less than their history, extracted records agree with their sentences, branches
do not disturb each other, beams come best first.
"""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RUN_S = 180  # seconds an example may run; its test gets a minute more
pytestmark = [pytest.mark.slow, pytest.mark.timeout(RUN_S + 60)]  # make test-fast leaves it out


def run(name: str, *args: str) -> str:
    # The package of this checkout, not whichever one the environment has installed.
    path = os.pathsep.join(filter(None, [str(EXAMPLES.parent), os.environ.get("PYTHONPATH")]))
    try:
        done = subprocess.run([sys.executable, str(EXAMPLES / name), "--quick", *args], capture_output=True,
                              text=True, timeout=RUN_S, cwd=EXAMPLES.parent, env={**os.environ, "PYTHONPATH": path})
    except subprocess.TimeoutExpired:
        pytest.fail(f"examples/{name} ran past its {RUN_S} s")
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module", autouse=True)
def _shipped_model():
    from continuous.assets import DEMO_MODEL

    if not (Path(DEMO_MODEL) / "model.safetensors").exists():
        pytest.fail(f"the demo model is missing from {DEMO_MODEL}: run scripts/train_demo_model.py")


def test_chat_turns_forward_only_their_new_tokens():
    out = run("chat.py")
    turns = [tuple(map(int, t)) for t in re.findall(r"\[turn (\d+): forwarded (\d+) tokens; history (\d+) tokens\]", out)]
    assert [t[0] for t in turns] == [1, 2, 3]
    histories = [t[2] for t in turns]
    assert histories == sorted(histories)
    for _, spent, history in turns[1:]:
        # a later turn pays for its message and answer, not for the history before it
        assert 0 < spent < history - turns[0][2] + 1
    answers = re.findall(r"^Assistant:(.*)$", out, re.M)
    assert len(answers) == 3
    assert "Oslo" in answers[2]  # "Where do I live?" after "I live in Oslo"


def test_extract_json_records_parse_and_agree_with_their_sentences():
    out = run("extract_json.py")
    records = [json.loads(line) for line in re.findall(r"-> Person (\{.*\})$", out, re.M)]
    assert records == [
        {"name": "Sven", "age": 41, "city": "Porto", "pet": "parrot"},
        {"name": "Mei", "age": 27, "city": "Nairobi", "pet": "rabbit"},
    ]


def test_constraint_cost_is_nothing_for_the_model_s_own_answer_and_more_when_pushed():
    out = run("constraint_cost.py")
    costs = dict((name.strip(), float(cost)) for name, cost in re.findall(r"^(.*?): cost ([\d.]+) nats", out, re.M))
    assert costs["free text"] == 0
    own, pushed = costs["schema, the model's own"], costs["schema, pushed off it"]
    assert own < 0.5 < 10 * own + 5 < pushed  # about nothing, against many nats
    record = ast.literal_eval(re.search(r"pushed off it\s*: cost [\d.]+ nats -> (\{.*\})$", out, re.M).group(1))
    assert record["pet"] in ("dragon", "unicorn") and 90 <= record["age"] <= 99


def test_branching_keeps_branches_apart_and_ranks_by_weight():
    out = run("branching.py")
    answers = dict(re.findall(r"branch (\w+): '(.*)'$", out, re.M))
    assert answers == {"dog": "Your dog is called Max.", "turtle": "Your turtle is called Kiwi."}
    assert "the base, continued after both: 'You live in Cairo.'" in out
    for spent, history, base in re.findall(r"forwarded (\d+) tokens for a history of (\d+); the base's (\d+)", out):
        # a branch never pays for the base again (its last token, cut by stop_at, excepted)
        assert int(spent) <= int(history) - int(base) + 1
    ranked = re.findall(r"#\d weight +(-?[\d.]+) ('.*')$", out, re.M)
    assert len(ranked) == 2
    # The best-weighted answer is the row that part 3 selects (state[row, :]) and slices.
    sliced = re.search(r"kept \d+ cached tokens of \d+\n  ('.*')$", out, re.M).group(1)
    assert sliced == ranked[0][1]
    kept, total = map(int, re.search(r"kept (\d+) cached tokens of (\d+)", out).groups())
    assert 0 < kept < total


def test_beam_search_keeps_beams_best_first():
    out = run("beam_search.py")
    beams = [float(w) for w in re.findall(r"beam \d +weight +(-?[\d.]+)", out)]
    greedy = float(re.search(r"greedy +weight +(-?[\d.]+)", out).group(1))
    assert len(beams) == 2 and beams == sorted(beams, reverse=True)
    assert beams[0] >= greedy - 1e-3


def test_swarm_conversation_matches_local_and_survives_a_crash():
    out = run("swarm.py")
    assert "same text on the swarm and locally: True" in out
    spent = re.search(r"tokens forwarded per turn: swarm (\[.*\]), local (\[.*\])", out)
    assert spent and spent.group(1) == spent.group(2)
    assert "killed the server" in out


def test_banned_phrases_never_appear_and_rewinds_are_counted():
    out = run("banned_phrases.py")
    banned = eval(re.search(r"banned        : (\[.*\])", out).group(1))  # the example prints a list literal
    streamed = re.search(r"streamed      : (.*)", out).group(1)
    assert banned and not any(b.lower() in streamed.lower() for b in banned)
    assert "banned text in the answer: none" in out
    assert int(re.search(r"(\d+) of them taken back", out).group(1)) >= 1


def test_grammar_outputs_parse():
    out = run("grammar.py")
    sql = re.compile(r"SELECT (\*|[a-z]{1,8}(, [a-z]{1,8}){0,2}) FROM [a-z]{1,8}"
                     r"( WHERE [a-z]{1,8} [=<>] ([0-9]{1,4}|'[a-z]{1,6}'))?;")
    queries = re.findall(r"sql(?: again)?\s*: '(.*?)'", out)
    assert len(queries) == 2 and all(sql.fullmatch(q) for q in queries)
    assert re.search(r"arithmetic : '[0-9()+\-*/]+;'", out)
    assert int(re.search(r"forwarded (\d+) tokens", out).group(1)) < 60  # the second query: new tokens only


def test_chat_template_turns_forward_only_their_new_tokens_and_match_the_template():
    out = run("chat_template.py")
    turns = [tuple(map(int, t)) for t in re.findall(r"forwarded (\d+) tokens this turn; the conversation holds (\d+)",
                                                   out)]
    assert len(turns) == 3
    for (spent, held), (_, before) in zip(turns[1:], turns):
        assert spent == held - before  # each turn forwards exactly what it adds
    assert "state text == template on all messages: True" in out


def test_agents_think_then_answer_and_call_a_tool():
    out = run("agents.py")
    assert re.search(r"^value      : \d+$", out, re.M)
    assert "piece kinds: reasoning answer" in out
    assert re.search(r"^call       : Order Order\(item='.*', count=[1-9]\)$", out, re.M)
    spent, history = map(int, re.search(r"forwarded (\d+) tokens for a history of (\d+)", out).groups())
    assert spent < history / 2  # the turn after the tool's result does not recompute the history


@pytest.mark.real
def test_intents_scores_every_label_and_calibration_helps():
    from support.real import smollm2

    out = run("intents.py", "--model", str(smollm2()))
    prior = dict((label, float(p)) for label, p in re.findall(r"([a-z ]+?) (\d\.\d\d)(?:,|$)",
                                                               out.splitlines()[0].split(": ", 1)[1]))
    assert len(prior) == 10 and abs(sum(prior.values()) - 1) < 0.02
    rows = re.findall(r"generated: ([a-z ]+); raw: ([a-z ]+) ([\d.]+); calibrated: ([a-z ]+) ([\d.]+)", out)
    assert len(rows) == 10
    raw, calibrated = map(int, re.search(r"accuracy: raw (\d+)/10, calibrated (\d+)/10", out).groups())
    # The model puts most of its mass on one label whatever the message; dividing out that
    # prior lets the message decide.
    assert calibrated > raw
    assert "13 prompts x 10 labels scored" in out
    assert int(re.search(r"(\d+) forward calls in all", out).group(1)) <= 3


def test_streaming_values_fill_in_field_by_field():
    out = run("streaming_values.py")
    fields = [eval(f) for f in re.findall(r"fields so far: (\[.*\])$", out, re.M)]  # list literals
    assert fields[0] == [] and fields[-1] == ["age", "city", "name", "pet"]
    assert all(set(a) <= set(b) for a, b in zip(fields, fields[1:]))
    assert len({len(f) for f in fields}) == 5  # each field appears on its own step
    record = json.loads(re.search(r"complete: Person (\{.*\}); the state's value: True$", out, re.M).group(1))
    assert set(record) == {"name", "age", "city", "pet"}
    text = json.loads(eval(re.search(r"^text: (.*)$", out, re.M).group(1)))
    assert text == record
