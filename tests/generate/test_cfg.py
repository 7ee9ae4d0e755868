"""generate.cfg: outputs of arithmetic, SQL-subset and JSON-like grammars parse (checked by other parsers)."""

import json
import random
import re

import pytest
from support.constraints import arithmetic as expression  # the recursive-descent twin of its grammar

from continuous import continuous, generate, samplers

ARITHMETIC = r"""
start: expr ";"
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""

SQL = r"""
start: "SELECT " columns " FROM " NAME where? ";"
columns: "*" | NAME (", " NAME)*
where: " WHERE " NAME OP VALUE
OP: " = " | " < " | " > "
VALUE: /[0-9]{1,4}/ | /'[a-z]{1,6}'/
NAME: /[a-z]{1,8}/
"""

JSON_LIKE = r"""
start: value
value: object | array | STRING | NUMBER | "true" | "false" | "null"
object: "{" (pair ("," pair)*)? "}"
pair: STRING ":" value
array: "[" (value ("," value)*)? "]"
STRING: /"[a-z]{1,5}"/
NUMBER: /-?[0-9]{1,3}/
"""


def arithmetic(text: str) -> bool:
    """ARITHMETIC's language: an expression of test_engines' parser, then ";"."""
    return text.endswith(";") and expression(text[:-1])


SQL_RE = re.compile(r"SELECT (\*|[a-z]{1,8}(, [a-z]{1,8})*) FROM [a-z]{1,8}( WHERE [a-z]{1,8} [=<>] ([0-9]{1,4}|'[a-z]{1,6}'))?;")


def json_like(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("grammar, check", [(ARITHMETIC, arithmetic), (SQL, SQL_RE.fullmatch), (JSON_LIKE, json_like)],
                         ids=["arithmetic", "sql", "json-like"])
def test_grammar_outputs_parse(model, grammar, check):
    gen = continuous(generate.cfg(model, grammar, samplers.multinomial(6)))
    state = gen("Write one:\n", max_tokens=60, seed=4)
    complete = 0
    for s in range(6):
        row = state[s, :]
        try:
            value = row.value
        except ValueError:  # cut short by max_tokens: its text is a prefix of the language
            continue
        complete += 1
        assert check(value), value
        assert str(row).endswith(value)
    assert complete >= 1


def test_a_grammar_continues_a_state_and_keeps_the_cache(model):
    sql = continuous(generate.cfg(model, SQL))
    first = sql("Query:\n", max_tokens=60)
    before = model.stats.tokens_forwarded
    again = sql(first + "\nAnother query:\n", max_tokens=60)
    new_prompt = len(model.tokenizer("\nAnother query:\n", add_special_tokens=False).input_ids)
    generated = int(again.attention_mask.sum()) - int(first.attention_mask.sum()) - new_prompt
    # Only the added text and the new tokens (the last one is never forwarded), a boundary token at most.
    assert model.stats.tokens_forwarded - before <= new_prompt + generated + 1
    try:
        value = again.value
    except ValueError:  # cut short by max_tokens
        return
    assert SQL_RE.fullmatch(value)


def test_bad_grammars_fail_when_built(model):
    with pytest.raises(ValueError, match="llguidance refuses"):
        generate.cfg(model, "start: ( \n")
    with pytest.raises(TypeError):
        generate.cfg(model, 42)


def test_a_grammar_the_engine_cannot_serve_fails_when_built_and_briefly():
    from support.models import real_tokenizer

    tok = real_tokenizer("llama-bpe")
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 9))) for _ in range(1000)]
    grammar = "start: " + " | ".join(f"/[a-z ]*{w}[a-z ]*/" for w in words) + "\n"
    with pytest.raises(ValueError, match="cannot serve") as failure:
        generate.cfg(_model(tok), grammar)
    assert len(str(failure.value)) < 600  # the reason, not the engine's dump of its state


def test_a_grammar_whose_language_is_empty_fails_when_built(model):
    for grammar in ['start: a\na: "x" a\n', 'start: "x" start\n']:  # rules that never end
        with pytest.raises(ValueError, match="matches no text"):
            generate.cfg(model, grammar)
    generate.cfg(model, 'start: a\na: "x" a | "y"\n')  # with a way out it builds


def test_a_regex_ending_in_a_lone_backslash_is_refused(model):
    with pytest.raises(ValueError, match="backslash"):
        generate.regex(model, "a\\")
    assert generate.regex(model, "a\\\\").constraint is not None  # an escaped backslash is text


def _model(tok):
    from support.models import build_llama

    from continuous import models

    return models.transformers(build_llama(tok, "tiny", vocab_size=len(tok)), tok)


def _words(n, seed=0):
    rng = random.Random(seed)
    return sorted({"".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(4)) for _ in range(n)})


def test_a_rule_of_thousands_of_literals_is_served_as_one_lexeme(model):
    from support.constraints import accepts

    words = _words(3000)
    gen = generate.cfg(model, "start: w\nw: " + " | ".join(f'"{w}"' for w in words) + "\n")
    state = continuous(gen)(["Word:", "Another:"], max_tokens=10)
    assert state.finish_reasons == ["eos", "eos"] and all(v in words for v in state.value)
    assert accepts(gen, words[7]) and not accepts(gen, words[7] + "a") and not accepts(gen, "zzzzz")


def test_alternations_of_literals_become_terminals_and_nothing_else_changes():
    from continuous.engines.lark import lexemes

    grammar = 'start: w " " v\n?w: "ab" | "cd"i\n   | "e\\"f"\nv: w | "x"\nN: /[a-z]/ | "q"\nu: "a" // one\n'
    assert lexemes(grammar) == ('start: w " " v\n?w: W_LITERALS\nW_LITERALS: "ab" | "cd"i\n   | "e\\"f"\n'
                                'v: w | "x"\nN: /[a-z]/ | "q"\nu: "a" // one\n')


def test_a_rule_with_more_alternatives_than_the_parser_takes_is_refused_when_built(model):
    grammar = "start: w\nw: " + " | ".join(f'"{w}" x' for w in _words(2500)) + '\nx: "!"\n'
    with pytest.raises(ValueError, match="'w' has 2[0-9]{3} alternatives"):
        generate.cfg(model, grammar)
    # Alternatives inside a group, a regex or a literal are not the rule's own.
    generate.cfg(model, 'start: w\nw: ("a" | "b") "c" | /x|y|z/ | "|"\n')
