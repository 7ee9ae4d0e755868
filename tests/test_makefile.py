"""The Makefile: which Python makes the environment, and how torch is installed (never CUDA by accident)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make(*args):
    return subprocess.run(["make", "-s", "-C", str(ROOT), *args], capture_output=True, text=True, check=True,
                          timeout=120).stdout


def test_the_environment_is_made_with_a_python_of_at_least_3_10():
    python = make("python").strip()
    version = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2] >= (3, 10))"],
                             capture_output=True, text=True, check=True, timeout=120).stdout
    assert version.strip() == "True"
    assert make("python", f"PYTHON={sys.executable}").strip() == sys.executable


def test_torch_comes_from_a_local_wheel_or_the_cpu_index(tmp_path):
    # A dry run of a fresh install into an empty folder: the commands, not their effects.
    plan = make("-n", "install", f"VENV={tmp_path / 'venv'}")
    torch_lines = [line for line in plan.splitlines() if "\"torch==" in line]
    assert len(torch_lines) == 1
    local, fallback = torch_lines[0].split(" || ")
    assert "--no-index" in local and "https://download.pytorch.org/whl/cpu" in fallback
    cuda = make("-n", "install", f"VENV={tmp_path / 'venv'}", "TORCH_INDEX=https://download.pytorch.org/whl/cu126")
    assert "whl/cu126" in cuda


def _pins(path):
    lines = [line.strip() for line in path.read_text().splitlines()]
    return dict(line.split("==", 1) for line in lines if line and not line.startswith("#"))


def test_install_and_test_use_the_tested_constraints(tmp_path):
    pins = _pins(ROOT / "constraints.txt")
    assert "continuous" not in pins and all(pins.values())
    assert "+" not in pins["torch"]  # a CPU or CUDA build of it satisfies the pin alike
    plan = make("-n", "install", f"VENV={tmp_path / 'venv'}")
    assert f'"torch=={pins["torch"]}"' in plan  # the Makefile's TORCH is the tested torch
    package = [line for line in plan.splitlines() if " -e " in line]
    assert package and all("-c constraints.txt" in line for line in package)
    for required in ("transformers", "llguidance", "outlines", "torch", "jsonschema", "pydantic"):
        assert required in pins


def test_test_latest_takes_the_newest_releases_in_an_environment_of_its_own():
    plan = make("-n", "test-latest")
    assert "constraints.txt" not in plan and ".venv-latest/bin/python -m pytest -q -m \"not slow\"" in plan
    tested = _pins(ROOT / "constraints.txt")["torch"]
    assert "--upgrade" in plan and f'"torch=={tested}"' in plan  # the tested torch: a local wheel first


def test_the_llama_cpp_extra_is_built_once_from_the_tested_pin_and_never_by_the_demo(tmp_path):
    pins = {name.lower().replace("-", "_"): v for name, v in _pins(ROOT / "constraints.txt").items()}
    version = pins["llama_cpp_python"]
    plan = make("-n", "llamacpp", f"VENV={tmp_path / 'venv'}", f"WHEELS={tmp_path / 'wheels'}")
    guard = next(line for line in plan.splitlines() if "llama_cpp_python-" in line and ".whl" in line)
    assert f"{tmp_path / 'wheels'}\"/llama_cpp_python-{version}-" in guard and guard.rstrip().endswith("|| \\")
    assert "CMAKE_BUILD_PARALLEL_LEVEL=" in plan
    # Built for AVX2 (not -march=native, whose AMX kernels crash on some VMs), never from pip's cache of
    # a wheel built with other CPU options.
    assert 'CMAKE_ARGS="-DGGML_NATIVE=OFF' in plan and "-DGGML_AVX2=ON" in plan
    assert f'pip wheel --quiet --no-cache-dir --no-deps --wheel-dir "{tmp_path / "wheels"}"' in plan
    install = next(line for line in plan.splitlines() if "[test,llamacpp]" in line)
    assert "--find-links" in install and "-c constraints.txt" in install
    demo = make("-n", "demo", f"VENV={tmp_path / 'venv'}").replace(str(tmp_path), "TMP")
    assert "pip wheel" not in demo and "llamacpp" not in demo and "/wheels" not in demo


def test_test_runs_all_but_the_benchmarks_and_names_the_slowest_tests():
    assert '-m pytest -q --durations=25 -m "not bench"' in make("-n", "test")
    assert '-m pytest -q --durations=25 -m bench' in make("-n", "test-bench")
    # The fast tier reads llama-cpp-python's sdist (real tokenizers): install fetches it, so tests run offline.
    for target in ("install", "test-latest"):
        assert "llama_cpp_sdist()" in make("-n", target, "VENV=/nonexistent")


def ci(tmp_path, total: int, fail: str = "") -> subprocess.CompletedProcess:
    """.ci/run with a fake ``make`` on the PATH that logs its target and fails on ``fail``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "make"
    fake.write_text(f'#!/bin/sh\necho "$1 ${{CONTINUOUS_REQUIRE:-}}" >> {tmp_path / "log"}\n'
                    f'[ "$1" != "{fail}" ]\n')
    fake.chmod(0o755)
    checkout = tmp_path / "checkout"
    (checkout / ".ci").mkdir(parents=True, exist_ok=True)
    (checkout / ".ci" / "run").write_bytes((ROOT / ".ci" / "run").read_bytes())
    (checkout / ".ci" / "run").chmod(0o755)
    # As CI starts it: without the CONTINUOUS_REQUIRE that .ci/run exports to the tests this runs in.
    env = {k: v for k, v in os.environ.items() if k != "CONTINUOUS_REQUIRE"}
    env |= {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CI_TOTAL": str(total)}
    return subprocess.run([str(checkout / ".ci" / "run")], capture_output=True, text=True, env=env, timeout=60)


def test_ci_runs_its_stages_in_order_and_only_blocking_ones_fail_it(tmp_path):
    done = ci(tmp_path, 2400, fail="test-latest")
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "log").read_text().split("\n")
    # Blocking stages first; the llama.cpp tests are expected (not skipped) once the extra is built.
    assert log == ["llamacpp ", "test llamacpp", "test-latest ", "llama-server llamacpp", "test-bench llamacpp",
                   "test-clients llamacpp", ""]
    assert "stage 'test-latest' failed" in done.stderr
    (tmp_path / "log").unlink()
    done = ci(tmp_path, 2400, fail="test")
    assert done.returncode != 0 and "stage 'test' failed" in done.stderr
    assert (tmp_path / "log").read_text().split() == ["llamacpp", "test", "llamacpp"]


def test_ci_refuses_a_blocking_stage_it_has_no_time_left_for(tmp_path):
    done = ci(tmp_path, 30)
    assert done.returncode != 0
    assert "stage 'llamacpp' not run" in done.stderr
    assert not (tmp_path / "log").exists()
