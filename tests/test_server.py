"""``python -m continuous.server``: the old name of the swarm's block server, kept one release, warns and works."""

import importlib
import subprocess
import sys

import pytest

import continuous.remote.server.__main__ as new


def test_running_the_old_name_warns_with_the_new_command_then_runs_it():
    shown = subprocess.run([sys.executable, "-m", "continuous.server", "--help"], capture_output=True, text=True)
    assert shown.returncode == 0 and "--blocks" in shown.stdout and "--initial-peers" in shown.stdout
    assert "DeprecationWarning" in shown.stderr and "python -m continuous.remote.server" in shown.stderr
    refused = subprocess.run([sys.executable, "-m", "continuous.server", "--model", "m", "--blocks", "2:1",
                              "--new-swarm"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--blocks must name at least one block" in refused.stderr


def test_importing_the_old_name_warns_and_gives_the_new_functions():
    sys.modules.pop("continuous.server", None)
    with pytest.warns(DeprecationWarning, match=r"python -m continuous\.remote\.server"):
        old = importlib.import_module("continuous.server")
    assert old.parse_args is new.parse_args and old.main is new.main
    args = old.parse_args(["--model", "m", "--blocks", "0:2", "--new-swarm"])
    assert (args.start, args.end, args.new_swarm) == (0, 2, True)
