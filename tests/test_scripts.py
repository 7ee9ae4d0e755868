"""The console scripts that pyproject.toml installs: each names a function that runs its command."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
SCRIPTS = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]


def test_the_two_servers_have_their_commands():
    assert SCRIPTS == {"continuous-serve": "continuous.serve.__main__:main",
                       "continuous-swarm-server": "continuous.remote.server.__main__:main"}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_each_script_runs_its_command(name):
    module, function = SCRIPTS[name].split(":")
    assert callable(getattr(importlib.import_module(module), function))
    # What the installed script does: call the function, its arguments in sys.argv.
    code = f"import sys; sys.argv = [{name!r}, '--help']; from {module} import {function}; sys.exit({function}())"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert shown.stdout.startswith("usage:") and "--port" in shown.stdout
