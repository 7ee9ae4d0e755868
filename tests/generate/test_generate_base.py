"""generate's make(): every generator checks its model once, before it compiles anything."""

import warnings
from datetime import date

import pytest

from continuous import generate
from continuous.engines import EngineFallbackWarning

BUILDERS = {
    "text": lambda m: generate.text(m),
    "choice": lambda m: generate.choice(m, ["a", "b"]),
    "json": lambda m: generate.json(m, {"type": "integer"}),
    "regex": lambda m: generate.regex(m, "[0-9]+"),
    "format": lambda m: generate.format(m, date),
    "cfg": lambda m: generate.cfg(m, 'start: "x"'),
    "tools": lambda m: generate.tools(m, [len]),
}


@pytest.mark.parametrize("kind", sorted(BUILDERS))
@pytest.mark.parametrize("not_a_model", ["some/model", 42, object()])
def test_every_generator_refuses_what_is_not_a_model(kind, not_a_model):
    with pytest.raises(TypeError, match="model must come from continuous.models"):
        BUILDERS[kind](not_a_model)


def test_a_compile_warning_points_at_the_users_line(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate.json(model, {"type": "number"}, engine="outlines_core")
    fallback = [w for w in caught if issubclass(w.category, EngineFallbackWarning)]
    assert fallback and fallback[0].filename == __file__
