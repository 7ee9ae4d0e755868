"""``python -m continuous.serve``: its arguments are read before torch and FastAPI load."""

import subprocess
import sys

import pytest

from continuous.serve.__main__ import parse_args


def test_help_and_arguments_need_neither_torch_nor_fastapi():
    code = ("import sys; from continuous.serve.__main__ import parse_args; "
            "a = parse_args(['m', '--port', '9', '--prefix-cache', '512MB', '--max-queue', '3']); "
            "print(a.model, a.port, a.prefix_cache, a.max_queue, 'torch' in sys.modules, 'fastapi' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.split() == ["m", "9", "512MB", "3", "False", "False"]
    shown = subprocess.run([sys.executable, "-m", "continuous.serve", "--help"], capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0 and "--prefix-cache" in shown.stdout and "--max-queue" in shown.stdout


def test_the_prefix_cache_is_on_by_default_and_can_be_turned_off():
    assert parse_args(["m"]).prefix_cache == "2GB"
    assert parse_args(["m", "--prefix-cache", "1000000"]).prefix_cache == 1000000
    assert parse_args(["m", "--prefix-cache", "0"]).prefix_cache is None
    assert parse_args(["m", "--prefix-cache", "off"]).prefix_cache is None


@pytest.mark.parametrize("argv", [[], ["m", "--max-queue", "0"], ["m", "--dtype", "float8"], ["m", "--port", "x"],
                                  ["m", "--threads", "0"]])
def test_mistakes_get_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2 and "usage:" in capsys.readouterr().err
