"""Every backend behind ``python -m continuous.serve``, end to end through the ``openai`` client:
a GGUF file (llama.cpp), a swarm (``--initial-peers``) and compiled steps (``--compile``).

Each answer equals the library's greedy answer on the same weights with transformers.
Every process started here is stopped by its id.
"""

from __future__ import annotations

import pytest
from support.models import build_llama, build_model_dir, cache_dir, real_tokenizer
from support.serving import NAME, TEMPLATE, in_process, save_chat_model, start, stop

from continuous import chat, continuous, generate, models
from continuous.serve import build_app
from continuous.serve.__main__ import load, parse_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = "User: Tell me about Alice.\nAssistant:"
MESSAGES = [{"role": "user", "content": "Tell me about Alice."}]


def greedy(model, prompt: str, max_tokens: int = 12) -> str:
    return continuous(generate.text(model))(prompt, max_tokens=max_tokens, temperature=0).value


def ask(client, max_tokens: int = 12) -> tuple[str, str, str]:
    """A completion, a chat answer and the same completion streamed."""
    text = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    chatted = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=max_tokens, temperature=0)
    streamed = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                         stream=True)
    return text.choices[0].text, chatted.choices[0].message.content, "".join(
        c.text for chunk in streamed for c in chunk.choices)


def reference(folder) -> tuple[str, str]:
    """The library's greedy completion and chat answer on the folder's weights, in float32."""
    local = models.transformers(str(folder), dtype="float32")
    local.tokenizer.chat_template = TEMPLATE
    return greedy(local, PROMPT), greedy(local, chat.prompt(local, MESSAGES))


def test_a_gguf_file_is_served_through_llama_cpp(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install continuous[llamacpp]")
    from support.llamacpp import f32_gguf

    folder = cache_dir() / "llamacpp-tiny-gpt2"  # GPT-2's vocabulary: llama.cpp's converter knows it
    if not (folder / "config.json").exists():
        tokenizer = real_tokenizer("gpt-2")
        build_llama(tokenizer, "tiny", seed=0, max_position_embeddings=512).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    (tmp_path / "template.jinja").write_text(TEMPLATE)
    server = start(f32_gguf(folder), tmp_path / "server.log", "--n-ctx", "1024", "--threads", "1",
                   "--chat-template", str(tmp_path / "template.jinja"))
    try:
        text, chatted, streamed = ask(server.client())
        assert server.health()["stats"]["forward_calls"] > 0
    finally:
        stop(server.pid)
    expected_text, expected_chat = reference(folder)
    assert text == streamed == expected_text
    assert chatted == expected_chat


def test_a_swarm_is_served_with_initial_peers(tmp_path):
    from continuous.demo.swarm import Swarm

    folder = save_chat_model(tmp_path / "tiny")
    with Swarm(folder, tmp_path, cache_bytes=50_000_000, max_length=512) as swarm:
        swarm.start("0:2")
        server = start(folder, tmp_path / "server.log", "--initial-peers", *swarm.maddrs, "--max-length", "256",
                       "--max-batch", "4")
        try:
            answers = ask(server.client())
        finally:
            stop(server.pid)
    expected_text, expected_chat = reference(folder)
    assert answers == (expected_text, expected_chat, expected_text)


def test_compile_passes_inductor_options_to_the_model(chat_model_dir):
    args = parse_args([str(chat_model_dir), "--dtype", "float32", "--compile", '{"freezing": true}'])
    model = load(args)
    assert model.compiled is not None and model._inductor == {"freezing": True}
    with in_process(build_app(model, name=NAME)) as client:
        text, chatted, streamed = ask(client)
    # The library's calls on the same compiled model; the completion is eager's too.
    assert text == streamed == greedy(model, PROMPT) == reference(chat_model_dir)[0]
    assert chatted == greedy(model, chat.prompt(model, MESSAGES))
