"""``python -m continuous.serve MODEL``: serve a model with OpenAI's API.

MODEL is a transformers model (a folder or a hub name), a ``.gguf`` file (run by
llama.cpp), or, with ``--initial-peers``, a model folder whose blocks a swarm serves.
The arguments are read before torch, transformers and FastAPI are imported, so that
``--help`` and mistakes answer at once.
"""

from __future__ import annotations

import argparse
import json

#: The dtypes a model may be loaded in (``auto``: the checkpoint's own).
DTYPES = ("auto", "float32", "bfloat16", "float16")

#: Options of one backend only, by the backend (``transformers``, ``llamacpp``, ``remote``).
ONLY = {"dtype": "transformers", "device": "transformers", "compile": "transformers", "max_rows": "transformers",
        "max_kv": "transformers", "n_ctx": "llamacpp", "max_length": "remote", "max_batch": "remote"}


def _size(text: str) -> str | int | None:
    """``--prefix-cache``: bytes, or a size the library reads (``2GB``); ``0`` or ``off`` turns it off."""
    text = text.strip()
    if text.lower() in ("0", "off", "none"):
        return None
    return int(text) if text.isdigit() else text


def _compile(text: str) -> str | dict:
    """``--compile``: a ``torch.compile`` mode, or inductor's options as a JSON object."""
    if not text.lstrip().startswith("{"):
        return text
    try:
        options = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"inductor's options are not JSON: {exc}") from None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError("inductor's options are a JSON object")
    return options


def backend(args: argparse.Namespace) -> str:
    """Which backend serves the model: ``llamacpp`` (a GGUF file), ``remote`` (a swarm) or ``transformers``."""
    if args.model.lower().endswith(".gguf"):
        return "llamacpp"
    return "remote" if args.initial_peers else "transformers"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The server's arguments; exits with a usage message on a mistake."""
    parser = argparse.ArgumentParser(prog="python -m continuous.serve", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a transformers model (a local folder or a hub name), a .gguf file "
                                      "(llama.cpp), or with --initial-peers the model's folder (tokenizer and head)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="the name requests give as 'model' (default: MODEL as given)")
    parser.add_argument("--prefix-cache", type=_size, default="2GB",
                        help="bytes of recent states kept to skip re-sent prefixes (default 2GB; 0 turns it off; "
                             "transformers models: the other backends keep none)")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="most requests running or waiting at once; more get 429 (default 64)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="dtype to load the model in")
    parser.add_argument("--device", default=None, help="torch device (default: the library's choice)")
    parser.add_argument("--compile", nargs="?", type=_compile, const=True, default=None, metavar="MODE|JSON",
                        help="compile decode steps with torch.compile: alone, the default mode; or a mode "
                             "('max-autotune'); or inductor's options as JSON ('{\"freezing\": true}')")
    parser.add_argument("--max-rows", type=int, default=None,
                        help="most rows (prompts x samples) decoding at once; calls past it wait for room")
    parser.add_argument("--max-kv", type=_size, default=None, metavar="BYTES",
                        help="most KV-cache bytes the running calls may reserve (e.g. 4GB); calls past it wait")
    parser.add_argument("--n-ctx", type=int, default=None,
                        help="a GGUF model's KV cells, shared by every live state (default 4096)")
    parser.add_argument("--initial-peers", nargs="+", default=None, metavar="MULTIADDR",
                        help="serve through a swarm: the multiaddresses of some of its peers (its servers print them)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="with --initial-peers: positions a swarm session holds (default 1024)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="with --initial-peers: rows a swarm session holds (default 8)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template, for a tokenizer that has none or to replace its own")
    parser.add_argument("--think", nargs="?", type=int, const=True, default=None, metavar="BUDGET",
                        help="answers think first, in the markers of the model's chat template or tokenizer, "
                             "within BUDGET tokens if given; chat answers give the thinking as reasoning_content")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads: torch's (default: one per core), or llama.cpp's for a GGUF model "
                             "(default: half the cores)")
    parser.add_argument("--api-key", default=None,
                        help="requests must carry 'Authorization: Bearer API_KEY' (/health stays open)")
    parser.add_argument("--api-key-file", default=None, metavar="FILE",
                        help="like --api-key, the key read from FILE (kept out of the process list)")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    args = parser.parse_args(argv)
    _check(parser, args)
    return args


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what the arguments cannot mean together (exits with a usage message)."""
    if args.max_queue < 1:
        parser.error("--max-queue must be at least 1")
    for name in ("threads", "n_ctx", "max_length", "max_batch", "max_rows"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.initial_peers and args.model.lower().endswith(".gguf"):
        parser.error("--initial-peers serves a model folder through a swarm, not a .gguf file")
    served_by = backend(args)
    for name, only in ONLY.items():
        if getattr(args, name) is not None and only != served_by:
            parser.error(f"--{name.replace('_', '-')} is for {_BACKENDS[only]}, not {_BACKENDS[served_by]}")
    from .auth import read_key

    try:
        args.api_key = read_key(args.api_key, args.api_key_file)
    except (OSError, ValueError) as exc:
        parser.error(f"--api-key: {exc}")


_BACKENDS = {"transformers": "a transformers model", "llamacpp": "a .gguf file",
             "remote": "a swarm (--initial-peers)"}


def load(args: argparse.Namespace):
    """The model the arguments name, on its backend, with their chat template."""
    from continuous import models

    served_by = backend(args)
    if served_by == "llamacpp":
        options = {"n_ctx": args.n_ctx, "n_threads": args.threads}
        model = models.llamacpp(args.model, **{k: v for k, v in options.items() if v is not None})
    else:
        import torch

        if args.threads is not None:
            torch.set_num_threads(args.threads)
        if served_by == "remote":
            options = {"max_length": args.max_length, "max_batch": args.max_batch}
            model = models.remote(args.model, initial_peers=args.initial_peers,
                                  **{k: v for k, v in options.items() if v is not None})
        else:
            options = {"device": args.device, "dtype": args.dtype, "prefix_cache": args.prefix_cache,
                       "compile": args.compile, "max_rows": args.max_rows, "max_kv": args.max_kv}
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
