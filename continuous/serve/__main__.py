"""``python -m continuous.serve MODEL``: serve a model with OpenAI's API.

The arguments are read before torch, transformers and FastAPI are imported, so that
``--help`` and mistakes answer at once.
"""

from __future__ import annotations

import argparse

#: The dtypes a model may be loaded in (``auto``: the checkpoint's own).
DTYPES = ("auto", "float32", "bfloat16", "float16")


def _size(text: str) -> str | int | None:
    """``--prefix-cache``: bytes, or a size the library reads (``2GB``); ``0`` or ``off`` turns it off."""
    text = text.strip()
    if text.lower() in ("0", "off", "none"):
        return None
    return int(text) if text.isdigit() else text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The server's arguments; exits with a usage message on a mistake."""
    parser = argparse.ArgumentParser(prog="python -m continuous.serve", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a local model folder or a hub name (a causal LM and its tokenizer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="the name requests give as 'model' (default: MODEL as given)")
    parser.add_argument("--prefix-cache", type=_size, default="2GB",
                        help="bytes of recent states kept to skip re-sent prefixes (default 2GB; 0 turns it off)")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="most requests running or waiting at once; more get 429 (default 64)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="dtype to load the model in")
    parser.add_argument("--device", default=None, help="torch device (default: the library's choice)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template, for a tokenizer that has none or to replace its own")
    parser.add_argument("--think", nargs="?", type=int, const=True, default=None, metavar="BUDGET",
                        help="answers think first, in the markers of the model's chat template or tokenizer, "
                             "within BUDGET tokens if given; chat answers give the thinking as reasoning_content")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's CPU threads (default: torch's choice, one per core)")
    parser.add_argument("--api-key", default=None,
                        help="requests must carry 'Authorization: Bearer API_KEY' (/health stays open)")
    parser.add_argument("--api-key-file", default=None, metavar="FILE",
                        help="like --api-key, the key read from FILE (kept out of the process list)")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    args = parser.parse_args(argv)
    if args.max_queue < 1:
        parser.error("--max-queue must be at least 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")
    from .auth import read_key

    try:
        args.api_key = read_key(args.api_key, args.api_key_file)
    except (OSError, ValueError) as exc:
        parser.error(f"--api-key: {exc}")
    return args


def load(args: argparse.Namespace):
    """The model the arguments name, with their chat template and prefix cache."""
    import torch

    from continuous import models

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    options = {"device": args.device, "dtype": args.dtype, "prefix_cache": args.prefix_cache}
    model = models.transformers(args.model, **{k: v for k, v in options.items() if v is not None})
    if args.chat_template is not None:
        with open(args.chat_template, encoding="utf-8") as f:
            model.tokenizer.chat_template = f.read()
    return model


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import uvicorn

    from continuous.serve.app import build_app

    app = build_app(load(args), name=args.served_model_name or args.model, max_queue=args.max_queue,
                    think=args.think, api_key=args.api_key)
    # Streams still open at shutdown are cut after a few seconds rather than awaited.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
