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


def test_the_api_key_comes_from_the_command_line_or_a_file(tmp_path, capsys):
    assert parse_args(["m"]).api_key is None
    assert parse_args(["m", "--api-key", "sk-1"]).api_key == "sk-1"
    (tmp_path / "key").write_text("sk-2\n")
    assert parse_args(["m", "--api-key-file", str(tmp_path / "key")]).api_key == "sk-2"
    for argv in (["m", "--api-key", ""], ["m", "--api-key-file", str(tmp_path / "nowhere")],
                 ["m", "--api-key", "a", "--api-key-file", str(tmp_path / "key")]):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert "--api-key" in capsys.readouterr().err


def test_the_model_names_its_backend():
    from continuous.serve.__main__ import backend

    assert backend(parse_args(["folder"])) == "transformers"
    assert backend(parse_args(["models/tiny.Q8_0.GGUF", "--n-ctx", "512"])) == "llamacpp"
    args = parse_args(["folder", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/Qm1", "/ip4/127.0.0.1/tcp/2/p2p/Qm2",
                       "--max-length", "256", "--max-batch", "4"])
    assert backend(args) == "remote" and len(args.initial_peers) == 2 and args.max_length == 256


def test_compile_takes_a_mode_or_inductor_options_as_json():
    assert parse_args(["m"]).compile is None
    assert parse_args(["m", "--compile"]).compile is True
    assert parse_args(["m", "--compile", "max-autotune"]).compile == "max-autotune"
    assert parse_args(["m", "--compile", '{"freezing": true, "max_autotune": true}']).compile == \
        {"freezing": True, "max_autotune": True}


def test_admission_limits_are_a_transformers_model_s():
    args = parse_args(["m", "--max-rows", "8", "--max-kv", "4GB"])
    assert (args.max_rows, args.max_kv) == (8, "4GB") and parse_args(["m", "--max-kv", "1024"]).max_kv == 1024


@pytest.mark.parametrize("argv, says", [
    (["m.gguf", "--max-rows", "8"], "--max-rows is for a transformers model"),
    (["m", "--max-rows", "0"], "--max-rows must be at least 1"),
    (["m", "--compile", "{freezing}"], "JSON"),
    (["m", "--compile", '{"a": 1'], "JSON"),
    (["m.gguf", "--compile"], "--compile is for a transformers model"),
    (["m.gguf", "--dtype", "float32"], "--dtype is for a transformers model"),
    (["m.gguf", "--initial-peers", "/ip4/1.2.3.4/tcp/1"], "not a .gguf file"),
    (["m", "--n-ctx", "512"], "--n-ctx is for a .gguf file"),
    (["m", "--max-batch", "2"], "--max-batch is for a swarm"),
    (["m", "--initial-peers", "/ip4/1.2.3.4/tcp/1", "--device", "cpu"], "--device is for a transformers model"),
    (["m.gguf", "--n-ctx", "0"], "--n-ctx must be at least 1"),
])
def test_options_of_another_backend_are_refused(argv, says, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert says in capsys.readouterr().err
