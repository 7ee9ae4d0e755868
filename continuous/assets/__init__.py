"""The small model that ships with continuous, for the demo, the examples and the docs.

``DEMO_MODEL`` is the directory of a Llama-architecture model of 3.5M parameters and
its byte-level BPE tokenizer, trained by ``scripts/train_demo_model.py`` on a synthetic
corpus of short dialogues about people, pets, orders and cities, and of the same facts
as JSON records. It is a toy: it knows these formats and nothing else. Its weights are
stored in fp16; load it in fp32 for speed and accuracy on a CPU::

    import torch
    from continuous import models
    from continuous.assets import DEMO_MODEL

    model = models.transformers(DEMO_MODEL, dtype=torch.float32)
"""

from pathlib import Path

__all__ = ["DEMO_MODEL"]

#: Directory of the shipped demo model (``config.json``, ``model.safetensors``, ``tokenizer.json``).
DEMO_MODEL: str = str(Path(__file__).resolve().parent / "demo-model")
