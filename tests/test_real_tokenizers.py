"""The real tokenizers the tests convert from GGUF files split text as their models do.

Two references, neither from transformers' GGUF loader:

- llama.cpp's ``ggml-vocab-NAME.gguf.out`` files: the ids that each model's own Hugging Face
  tokenizer gave llama.cpp's test texts;
- the rule written down: llama.cpp's pre-tokenizer for the file's ``tokenizer.ggml.pre`` name
  (its regular expressions, applied one after the other, each splitting the pieces of the
  one before), then byte-level BPE of each piece, here in plain Python over the vocabulary
  and merges read from the GGUF file itself.
"""

from __future__ import annotations

import functools
import math

import pytest
import regex
from gguf import GGUFReader
from support.models import GGUF_VOCABS, llama_cpp_vocab_file, real_tokenizer

# They check the test tools' conversion of GGUF vocabularies (support.models), on long texts
# and in plain Python: slow, and needed only when that conversion changes.
pytestmark = pytest.mark.slow

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# llama.cpp's src/llama-vocab.cpp: the regular expressions of each pre-tokenizer name, and
# whether a piece that is one token of the vocabulary skips the merges (ignore_merges).
RULES = {
    "smollm": ([r"\p{N}", GPT2], False),
    "gpt-2": ([GPT2], False),
    "qwen2": ([r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"], False),
    "llama-bpe": ([r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
                   r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"], True),
    "falcon": ([r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"], False),
}

# Digits after newlines and after runs of spaces, dates, prices, code, non-Latin scripts
# (with their own digits), emoji (with joiners and modifiers), contractions, trailing space.
TEXT = (
    "Steps:\n\n1. Milk\n2. Eggs\n\n\n3. Bread\n"
    "a  3 b   42 c\t7\n  \n 12\n    5  \n"
    "On 2024-03-15 at 09:30 it cost 1,234.56 € or $99.99 (-3.5%); 1e-9, 3333333, v2.0.1\n"
    "def f(x):\n    return x**2 + 10  # square\n\tif x != 0: print(f\"{x:>8}\") \n"
    "naïve café, Cửa Việt, Москва 2023, 東京は2020年に, 서울 3번, Ελληνικά, ١٢٣ العربية, हिन्दी ४२\n"
    "emoji: 👍🏽 🇫🇷 👨‍👩‍👧 😁?!\n"
    "I'm sure you'll see they've GONE, it's WE'RE  \n\n\n   "
)


def byte_chars() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters, in which byte-level vocabularies are written."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in kept:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def split(pieces: list[str], pattern: str) -> list[str]:
    """Each piece cut into the pattern's matches and the text between them, in order."""
    out = []
    for piece in pieces:
        at = 0
        for m in regex.finditer(pattern, piece):
            out += [piece[at:m.start()], m.group()] if m.start() > at else [m.group()]
            at = m.end()
        out += [piece[at:]] if at < len(piece) else []
    return out


def field(reader, key):
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode() for i in f.data]


@functools.cache
def tables(gguf) -> tuple[str, dict[str, int], dict[tuple[str, str], int]]:
    """The file's pre-tokenizer name, its vocabulary (token to id) and its merges' ranks."""
    reader = GGUFReader(gguf)
    vocab = {t: i for i, t in enumerate(field(reader, "tokenizer.ggml.tokens"))}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(field(reader, "tokenizer.ggml.merges"))}
    return field(reader, "tokenizer.ggml.pre")[0], vocab, ranks


def reference_ids(gguf, text: str) -> list[int]:
    """``text`` tokenized by llama.cpp's rule for the file's pre-tokenizer, with a plain BPE."""
    name, vocab, ranks = tables(gguf)
    patterns, ignore_merges = RULES[name]
    chars = byte_chars()
    pieces = [text]
    for pattern in patterns:
        pieces = split(pieces, pattern)
    ids = []
    for piece in pieces:
        word = "".join(chars[b] for b in piece.encode())
        parts = [word] if ignore_merges and word in vocab else list(word)
        while len(parts) > 1:
            rank, i = min((ranks.get(pair, math.inf), i) for i, pair in enumerate(zip(parts, parts[1:])))
            if rank == math.inf:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids += [vocab[p] for p in parts]
    return ids


def test_split_keeps_every_character_in_order():
    pieces = split(split(["a  3 b\n\n12"], r"\p{N}"), GPT2)
    assert pieces == ["a", "  ", "3", " b", "\n\n", "1", "2"]
    assert "".join(split([TEXT], RULES["falcon"][0][0])) == TEXT


@pytest.mark.parametrize("name", GGUF_VOCABS)
def test_matches_the_models_own_tokenizer_on_llama_cpp_texts(name):
    tok = real_tokenizer(name)
    texts = llama_cpp_vocab_file(f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    texts = texts.split("\n__ggml_vocab_test__\n")[:-1]
    expected = llama_cpp_vocab_file(f"ggml-vocab-{name}.gguf.out").read_text().splitlines()
    assert len(texts) == len(expected) > 30
    for text, line in zip(texts, expected):
        if name == "llama-spm" and text[:1].isspace():
            continue  # the known difference: a SentencePiece vocabulary loses a leading space (gguf_tokenizer)
        assert tok.encode(text, add_special_tokens=False) == [int(i) for i in line.split()], repr(text)


@pytest.mark.parametrize("name", ["llama-bpe", "qwen2", "gpt-2", "falcon"])
def test_follows_llama_cpp_pre_tokenizer_on_a_varied_text(name):
    gguf = llama_cpp_vocab_file(f"ggml-vocab-{name}.gguf")
    assert real_tokenizer(name).encode(TEXT, add_special_tokens=False) == reference_ids(gguf, TEXT)


@pytest.mark.real
@pytest.mark.slow
def test_smollm2_splits_digits_before_the_byte_level_step():
    from support.real import smollm2, smollm2_gguf
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(smollm2())  # the saved copy that tests, demo and benchmarks load
    for text in [TEXT, *TEXT.splitlines(keepends=True)]:
        assert tok.encode(text, add_special_tokens=False) == reference_ids(gguf, text), repr(text)
    assert tok.convert_ids_to_tokens(tok.encode("\n\n1. a  3 b")) == ["ĊĊ", "1", ".", "Ġa", "ĠĠ", "3", "Ġb"]
