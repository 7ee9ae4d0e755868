"""llama.cpp for the tests and benchmarks, offline: its sources, an F32 GGUF of a Hugging Face folder, its server.

Everything comes from llama-cpp-python's pinned sdist (:func:`support.models.llama_cpp_sdist`),
whose ``vendor/llama.cpp`` is llama.cpp itself: ``convert_hf_to_gguf.py`` with its own
``gguf-py``, and the sources of ``llama-server``. Results are kept under the cache folder.

Run as a script: ``python tests/support/llamacpp.py server`` builds ``llama-server``
(about 10 minutes on two cores) and prints its path; ``python tests/support/llamacpp.py
gguf FOLDER`` prints the F32 GGUF of a Hugging Face folder.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from support.models import cache_dir, llama_cpp_sdist


def llama_cpp_source() -> Path:
    """llama.cpp's source tree (the sdist's ``vendor/llama.cpp``), extracted once."""
    sdist = llama_cpp_sdist()
    out = cache_dir() / "llama.cpp" / sdist.name.removesuffix(".tar.gz")
    if (out / "convert_hf_to_gguf.py").exists():
        return out
    part = out.with_name(f"{out.name}.{os.getpid()}.part")
    prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(part, members=members, filter="data")
    part.replace(out)
    return out


def f32_gguf(folder: Path) -> Path:
    """The F32 GGUF of a Hugging Face model folder, converted once by llama.cpp's own script.

    The file's name carries a hash of the folder's config and tokenizer, so a changed
    folder is converted again. Needs ``sentencepiece`` (the script imports it).
    """
    folder = Path(folder)
    digest = hashlib.sha256()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (folder / name).exists():
            digest.update((folder / name).read_bytes())
    out = cache_dir() / "gguf" / f"{folder.name}-{digest.hexdigest()[:12]}-f32.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    source = llama_cpp_source()
    part = out.with_name(f"{out.name}.{os.getpid()}.part")
    env = dict(os.environ, PYTHONPATH=str(source / "gguf-py"))
    subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f32",
                    "--outfile", str(part)], check=True, env=env, capture_output=True, timeout=300)
    part.replace(out)
    return out


def llama_server(build: bool = False) -> Path | None:
    """The ``llama-server`` binary built from the same sources (``None`` if not built and ``build`` is false).

    Built with the CPU options in ``CMAKE_ARGS`` (``make llama-server`` gives the wheel's; by
    default for this CPU, ``GGML_NATIVE``), without CURL, tests or examples.
    """
    source = llama_cpp_source()
    binary = source / "build" / "bin" / "llama-server"
    if binary.exists() or not build:
        return binary if binary.exists() else None
    subprocess.run(["cmake", "-S", str(source), "-B", str(source / "build"), "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    *os.environ.get("CMAKE_ARGS", "-DGGML_NATIVE=ON").split()], check=True)
    subprocess.run(["cmake", "--build", str(source / "build"), "--target", "llama-server",
                    "-j", str(os.cpu_count() or 2)], check=True)
    return binary


if __name__ == "__main__":
    if sys.argv[1:2] == ["server"]:
        print(llama_server(build=True))
    elif sys.argv[1:2] == ["gguf"] and len(sys.argv) == 3:
        print(f32_gguf(Path(sys.argv[2])))
    else:
        sys.exit(__doc__)
