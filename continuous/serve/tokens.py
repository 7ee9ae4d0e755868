"""``/tokenize`` and ``/detokenize``, in vLLM's shapes (llama.cpp's server's ``content`` too).

A prompt's tokens are those a completion request of it counts in ``usage.prompt_tokens``;
messages' tokens are those of their chat prompt, as a chat request counts them.
"""

from __future__ import annotations

from fastapi import FastAPI

from .calls import RequestError, Served
from .wire import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse

__all__ = ["add_token_routes"]


def add_token_routes(app: FastAPI, served: Served) -> None:
    """Serve ``POST /tokenize`` and ``POST /detokenize`` on ``app``."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        served.check_model(body.model)
        if body.messages is not None:
            ids = served.encode(served.chat_prompt([m.template_dict() for m in body.messages]))
        else:
            ids = served.encode(body.prompt if body.prompt is not None else body.content, body.add_special_tokens)
        strs = served.model.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=served.model.max_length, tokens=ids, token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        served.check_model(body.model)
        vocab = len(served.model.tokenizer)
        wrong = [t for t in body.tokens if not 0 <= t < vocab]
        if wrong:
            raise RequestError(f"token ids must be in [0, {vocab}): got {wrong[:5]}", param="tokens")
        text = served.model.tokenizer.decode(body.tokens)
        return DetokenizeResponse(prompt=text, content=text)

