"""``python -m continuous.remote.server``: its arguments are read before torch and hivemind load."""

import subprocess
import sys

import pytest

from continuous.remote.server.__main__ import parse_args


def test_help_and_arguments_need_neither_torch_nor_hivemind():
    code = ("import sys; from continuous.remote.server.__main__ import parse_args; "
            "a = parse_args(['--model', 'm', '--blocks', '0:2', '--new-swarm']); "
            "print(a.start, a.end, 'torch' in sys.modules, 'hivemind' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["0", "2", "False", "False"]
    shown = subprocess.run([sys.executable, "-m", "continuous.remote.server", "--help"], capture_output=True,
                           text=True)
    assert shown.returncode == 0 and "--blocks" in shown.stdout and "--initial-peers" in shown.stdout
    assert "python -m continuous.remote.server" in shown.stdout and not shown.stderr


@pytest.mark.parametrize("blocks", ["2:1", "a:b", "3"])
def test_bad_blocks_get_a_usage_error(blocks, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(["--model", "m", "--blocks", blocks, "--new-swarm"])
    assert exited.value.code == 2 and "--blocks" in capsys.readouterr().err


def test_the_swarm_errors_are_still_exported_by_the_package():
    from continuous import remote
    from continuous.remote.wire import protocol

    for name in ("RemoteError", "BadRequestError", "MaxLengthError", "AllocationError", "SessionTimeoutError",
                 "ServerShutdownError", "ProtocolError", "ServerFaultError"):
        assert name in remote.__all__ and getattr(remote, name) is getattr(protocol, name)
