"""Context-free grammars: arithmetic and a SQL subset, continued on one state.

``generate.cfg`` takes a Lark grammar (llguidance's dialect) and constrains every token
to keep the text in the grammar's language. The shipped toy model knows nothing of SQL
or arithmetic, so its choices are arbitrary, but they always parse; the second query
continues the first state, so only the new text is forwarded. Run
``python examples/grammar.py`` (``--quick`` is the same, it is short).
"""

import argparse

import torch

from continuous import continuous, generate, models
from continuous.assets import DEMO_MODEL

# Bounded on purpose: a toy model that never picks ";" would otherwise go on until max_tokens.
ARITHMETIC = r"""
start: expr ";"
expr: term (("+" | "-") term)?
term: factor (("*" | "/") factor)?
factor: NUMBER | "(" NUMBER ("+" | "-") NUMBER ")"
NUMBER: /[0-9]{1,3}/
"""

SQL = r"""
start: "SELECT " columns " FROM " NAME where? ";"
columns: "*" | NAME (", " NAME)? (", " NAME)?
where: " WHERE " NAME OP VALUE
OP: " = " | " < " | " > "
VALUE: /[0-9]{1,4}/ | /'[a-z]{1,6}'/
NAME: /[a-z]{1,8}/
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the same, it is short")
    parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = models.transformers(DEMO_MODEL, dtype=torch.float32)
    arithmetic = continuous(generate.cfg(model, ARITHMETIC))
    sql = continuous(generate.cfg(model, SQL))

    state = arithmetic("Compute: ", max_tokens=60)
    print(f"arithmetic : {state.value!r}")
    state = sql(state + "\nQuery: ", max_tokens=60)
    print(f"sql        : {state.value!r}")
    before = model.stats.tokens_forwarded
    state = sql(state + "\nAnother query: ", max_tokens=60)
    print(f"sql again  : {state.value!r} (forwarded {model.stats.tokens_forwarded - before} tokens)")


if __name__ == "__main__":
    main()
