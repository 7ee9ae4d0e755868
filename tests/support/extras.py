"""The package's optional extras in the tests: skipped with the reason where one is not
installed, a failure where it is expected.

``CONTINUOUS_REQUIRE`` names the extras that must be there (``llamacpp``; several apart
by commas): CI sets it once it has installed them, so that a broken extra fails its tests
loudly instead of turning them into one skip line.
"""

from __future__ import annotations

import importlib
import os

import pytest


def required(extra: str) -> bool:
    """Whether ``CONTINUOUS_REQUIRE`` names ``extra``."""
    return extra in os.environ.get("CONTINUOUS_REQUIRE", "").replace(",", " ").split()


def need(module: str, extra: str):
    """``module`` imported; else the caller (a test, or a whole test module) is skipped with the
    reason, or fails where ``extra`` is required.

    A binding whose native library cannot load fails to import with ``OSError`` or
    ``RuntimeError`` rather than ``ImportError``: it counts as missing too.
    """
    try:
        return importlib.import_module(module)
    except (ImportError, OSError, RuntimeError) as exc:
        why = (f"{module} cannot be imported ({type(exc).__name__}: {exc}): "
               f"pip install continuous[{extra}] (or make {extra})")
        if required(extra):
            pytest.fail(f"CONTINUOUS_REQUIRE names {extra}, but {why}", pytrace=False)
        pytest.skip(why, allow_module_level=True)
