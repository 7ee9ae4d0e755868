"""Small, reproducible models for tests, benchmarks and examples.

No model hub is needed: a byte-level BPE tokenizer is trained with `tokenizers` on a
synthetic corpus generated from a fixed seed, and a Llama-architecture model gets
random weights from a fixed seed. KV reuse and masking cost the same whatever the
weights are, so these models are faithful for everything but the quality of the text.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

__all__ = ["corpus", "build_tokenizer", "build_llama", "build_model_dir", "REFERENCE_SIZES"]

#: The benchmarks' reference sizes ("small" and "mid"), and a tiny one for unit tests.
REFERENCE_SIZES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1000),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=688, vocab_size=8000),
    "mid": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                intermediate_size=2048, vocab_size=32000),
}

_NAMES = ["Alice", "Bob", "Chloé", "Dmitri", "Eve", "Farah", "Gustavo", "Hana", "Ivan", "Júlia",
          "Kenji", "Lena", "Marco", "Nadia", "Omar", "Priya", "Quentin", "Rosa", "Sven", "Zoë"]
_CITIES = ["Paris", "Lagos", "Kyoto", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Dakar", "Porto"]
_PETS = ["cat", "dog", "parrot", "rabbit", "turtle", "hamster", "goldfish"]
_ITEMS = ["book", "lamp", "chair", "kettle", "bicycle", "guitar", "umbrella", "camera"]
_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "zo", "qui", "bre", "sha", "tor", "vel", "pin",
              "dra", "gu", "xe", "fi", "mon", "sta", "hul", "cre", "jo", "wa", "ys"]


def corpus(n_records: int = 2000, seed: int = 0) -> list[str]:
    """Return a deterministic synthetic corpus of short dialogues, JSON records and words.

    Parameters
    ----------
    n_records
        How many records to generate; each yields a few lines.
    seed
        Seed of the generator: the same seed gives the same corpus.
    """
    rng = random.Random(seed)
    lines = []
    for i in range(n_records):
        name, city = rng.choice(_NAMES), rng.choice(_CITIES)
        pet, item, age = rng.choice(_PETS), rng.choice(_ITEMS), rng.randint(1, 99)
        record = {"name": name, "age": age, "city": city, "pet": pet, "active": rng.random() < 0.5,
                  "tags": rng.sample(_ITEMS, 2), "score": round(rng.uniform(0, 100), 2)}
        lines.append(f"User: Tell me about {name}.\nAssistant: {name} is {age} years old, lives in "
                     f"{city} and has a {pet}.")
        lines.append(json.dumps(record))
        lines.append(f"Order #{1000 + i}: {rng.randint(1, 9)} x {item} shipped to {city} on "
                     f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} at {rng.randint(0, 23):02d}:"
                     f"{rng.randint(0, 59):02d}.")
        # Invented words give the BPE trainer enough distinct pieces to fill large vocabularies.
        words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 5))) for _ in range(12)]
        lines.append(" ".join(words) + rng.choice([".", "!", "?", ";", ","]))
    return lines


def build_tokenizer(vocab_size: int = 1000, seed: int = 0):
    """Train a byte-level BPE tokenizer on :func:`corpus` and wrap it for transformers.

    Parameters
    ----------
    vocab_size
        Target vocabulary size, special tokens included. The corpus may yield fewer
        merges for very large sizes; the model's embedding is sized separately.
    seed
        Seed of the corpus.

    Returns
    -------
    transformers.PreTrainedTokenizerFast
        With ``<s>`` as BOS (added to every encoding), ``</s>`` as EOS and no pad token,
        like most causal LMs.
    """
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    n = 2000 if vocab_size <= 4000 else 20000
    tok.train_from_iterator(corpus(n, seed), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def build_llama(tokenizer, size: str = "tiny", seed: int = 0, max_position_embeddings: int = 2048,
                **overrides):
    """Build a Llama-architecture causal LM with random weights, fp32, in eval mode.

    Parameters
    ----------
    tokenizer
        The tokenizer whose special tokens the config names.
    size
        A key of :data:`REFERENCE_SIZES`.
    seed
        Seed of the weights.
    max_position_embeddings
        The model's context length.
    **overrides
        Any other `LlamaConfig` field.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    params = dict(REFERENCE_SIZES[size])
    params["vocab_size"] = max(params["vocab_size"], len(tokenizer))
    params.update(overrides)
    config = LlamaConfig(
        **params, max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Random init gives tiny logits and near-uniform distributions; a larger scale on
    # the head makes greedy choices well separated, so float noise cannot flip them.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def build_model_dir(path: str | Path, size: str = "tiny", seed: int = 0, **overrides) -> Path:
    """Build tokenizer and model once and save them (safetensors) under ``path``.

    A directory that already holds a saved model is reused as it is.

    Returns
    -------
    pathlib.Path
        The directory, loadable with ``AutoModelForCausalLM.from_pretrained``.
    """
    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    vocab = REFERENCE_SIZES[size]["vocab_size"]
    tokenizer = build_tokenizer(vocab, seed)
    model = build_llama(tokenizer, size, seed, **overrides)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


# --------------------------------------------------------------------- real tokenizers
#: llama.cpp's vocab-only test files that transformers converts (``gguf_file=``).
GGUF_VOCABS = ("llama-bpe", "llama-spm", "qwen2", "gpt-2", "phi-3", "falcon")
_SDIST = "llama-cpp-python==0.3.36"  # pinned: its vendor/llama.cpp/models holds the files
#: The revision of :func:`gguf_tokenizer`'s conversion; it names the cached copies, so that a
#: copy converted by an earlier revision is never used (bump it when the conversion changes).
TOKENIZER_REVISION = 3


def _gguf_field(reader, key: str, default=None):
    """A scalar or string field of a GGUF file's header, or ``default`` when the file has none."""
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0].name == "STRING" else value[0].item()


def gguf_tokenizer(gguf: Path):
    """A GGUF file's tokenizer as its model splits text: transformers' loader, with the steps it drops.

    transformers' GGUF loader reads the vocabulary and merges faithfully but not the
    pre-tokenizer that llama.cpp names in ``tokenizer.ggml.pre``: for most names it writes a
    plain byte-level step. This restores, as llama.cpp applies them:

    - ``smollm`` (SmolLM, SmolLM2): digits split one by one before the byte-level step, so
      ``"\\n\\n1."`` is ``ĊĊ 1 .``, not ``Ċ Ċ 1 .``;
    - ``falcon``: punctuation runs split first, digits grouped in threes after;
    - ``llama-bpe`` (Llama 3): a piece that is one token of the vocabulary is that token,
      whatever the merges say (``ignore_merges``);
    ``qwen2`` and ``gpt-2`` are converted right already and are left as they are.

    One difference is left, and known: a SentencePiece vocabulary (``llama-spm``: Llama 2,
    and the mistral and gemma2 test architectures) loses a text's *leading* space (``" Hello"``
    is ``▁Hello``, not ``▁ ▁Hello``; 15 of llama.cpp's 46 test texts). Restored, it made
    ``layout.retokenize`` wrong at a cut inside leading whitespace (`` " :"`` cut after the
    space), which the library does not handle yet; elsewhere the ids are the model's own.

    Parameters
    ----------
    gguf
        The GGUF file (weights or vocabulary only).

    Returns
    -------
    transformers.PreTrainedTokenizerFast
    """
    from gguf import GGUFReader
    from tokenizers import Regex
    from tokenizers import pre_tokenizers as pre
    from transformers import AutoTokenizer

    reader = GGUFReader(gguf)
    name = _gguf_field(reader, "tokenizer.ggml.pre", "default")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    backend = tok.backend_tokenizer
    byte_level = pre.ByteLevel(add_prefix_space=False, use_regex=True)
    if name == "smollm":
        backend.pre_tokenizer = pre.Sequence([pre.Digits(individual_digits=True), byte_level])
    elif name == "falcon":
        backend.pre_tokenizer = pre.Sequence([
            pre.Punctuation("contiguous"), byte_level, pre.Digits(individual_digits=False),
            pre.Split(Regex("[0-9][0-9][0-9]"), "isolated")])
    elif name == "llama-bpe":
        backend.model.ignore_merges = True
    return tok


def cache_dir() -> Path:
    """Where converted tokenizers are kept (``$CONTINUOUS_CACHE``, else ``~/.cache/continuous``)."""
    import os

    return Path(os.environ.get("CONTINUOUS_CACHE") or Path.home() / ".cache" / "continuous")


def llama_cpp_sdist() -> Path:
    """llama-cpp-python's pinned sdist (llama.cpp's sources under ``vendor/``), downloaded once."""
    import subprocess
    import sys

    sdists = cache_dir() / "sdist"
    found = sorted(sdists.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        sdists.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        "-d", str(sdists), _SDIST], check=True, timeout=300)  # within a test's 600 s
        found = sorted(sdists.glob("llama_cpp_python-*.tar.gz"))
    return found[-1]


def llama_cpp_vocab_file(filename: str) -> Path:
    """Extract ``models/FILENAME`` from llama-cpp-python's sdist (downloaded once, pinned).

    The folder holds vocab-only GGUF files ``ggml-vocab-NAME.gguf``, and for most of them
    ``.gguf.inp`` (texts) and ``.gguf.out`` (the ids that the model's own Hugging Face
    tokenizer gives them, one line a text).
    """
    import os
    import tarfile

    out = cache_dir() / "gguf" / filename
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(llama_cpp_sdist()) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(f"/models/{filename}"))
        with tar.extractfile(member) as src:
            tmp = out.with_name(f"{out.name}.{os.getpid()}.part")  # .gguf and .gguf.inp apart
            tmp.write_bytes(src.read())
            tmp.replace(out)
    return out


def real_tokenizer(name: str):
    """A real model family's tokenizer, offline: llama.cpp's vocab-only GGUF files, converted once.

    Parameters
    ----------
    name
        One of :data:`GGUF_VOCABS`: ``llama-bpe`` (Llama 3, 128k BPE, no BOS added),
        ``llama-spm`` (Llama 2 SentencePiece with byte fallback), ``qwen2`` (with a chat
        template), ``gpt-2``, ``phi-3`` (SentencePiece, with a chat template), ``falcon``.

    Returns
    -------
    transformers.PreTrainedTokenizerFast
        Loaded from the converted copy under :func:`cache_dir` (the first call downloads
        llama-cpp-python's pinned sdist with pip and converts, which takes seconds).
    """
    from transformers import AutoTokenizer

    if name not in GGUF_VOCABS:
        raise ValueError(f"unknown vocabulary {name!r}; choose one of {GGUF_VOCABS}")
    saved = cache_dir() / f"tokenizers-{TOKENIZER_REVISION}" / name
    if not (saved / "tokenizer.json").exists():
        tok = gguf_tokenizer(llama_cpp_vocab_file(f"ggml-vocab-{name}.gguf"))
        import os
        import shutil

        tmp = saved.with_name(f"{name}.{os.getpid()}.part")  # test processes may convert it at once
        tok.save_pretrained(tmp)
        if saved.exists() and not (saved / "tokenizer.json").exists():
            shutil.rmtree(saved)  # a copy left incomplete
        try:
            tmp.rename(saved)
        except OSError:  # another process saved it first: its copy stays
            shutil.rmtree(tmp)
    return AutoTokenizer.from_pretrained(saved)


#: Tiny random-weight models of real architectures, each with a real tokenizer. Sliding
#: windows are shorter than the contexts tests use, so they matter.
ARCHITECTURES = {
    "llama": ("llama-bpe", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, intermediate_size=128)),
    "qwen2": ("qwen2", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=128)),
    "mistral": ("llama-spm", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=128, sliding_window=12)),
    "gemma2": ("llama-spm", dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=128, head_dim=16,
                                 sliding_window=12)),
    "phi3": ("phi-3", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128, sliding_window=12,
                           pad_token_id=None)),
    "gpt2": ("gpt-2", dict(n_embd=64, n_layer=2, n_head=4)),
    "opt": ("gpt-2", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                          word_embed_proj_dim=64)),
    "gpt_neox": ("gpt-2", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=128)),
    "falcon": ("falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              new_decoder_architecture=False, multi_query=True)),
}


def build_arch(arch: str, seed: int = 0, max_position_embeddings: int = 512, **overrides):
    """A tiny random-weight causal LM of a real architecture, with its family's real tokenizer.

    Parameters
    ----------
    arch
        A key of :data:`ARCHITECTURES` (``llama``, ``qwen2``, ``mistral``, ``gemma2``,
        ``phi3``, ``gpt2``, ``opt``, ``gpt_neox``, ``falcon``).
    seed
        Seed of the weights.
    max_position_embeddings
        The context length.
    **overrides
        Any other config field.

    Returns
    -------
    (model, tokenizer)
        The model in fp32 and eval mode; its LM head is scaled so that greedy choices are
        well separated (float noise cannot flip them).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab, params = ARCHITECTURES[arch]
    tokenizer = real_tokenizer(vocab)
    params = {**params, **overrides}
    length_key = "n_positions" if arch == "gpt2" else "max_position_embeddings"
    config = AutoConfig.for_model(
        arch, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
        **{length_key: max_position_embeddings}, **params)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval(), tokenizer


def hf_greedy(hf, ids: list[int], n: int, **kwargs) -> list[int]:
    """The ids HF ``generate`` adds greedily to ``ids`` (its own cache, nothing of ours), up to EOS."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, pad_token_id=hf.config.eos_token_id, **kwargs)
    new = out[0, len(ids):].tolist()
    eos = hf.config.eos_token_id
    return new[: new.index(eos)] if eos in new else new
