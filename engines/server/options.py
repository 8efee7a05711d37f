"""The command line of ``tandem serve`` (imports nothing heavy: ``tandem --help`` lists it)."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["ADMIN_KEY_ENV", "API_KEY_ENV", "add_arguments"]

API_KEY_ENV = "TANDEM_API_KEY"  # as vLLM reads VLLM_API_KEY
ADMIN_KEY_ENV = "TANDEM_ADMIN_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``tandem serve``'s options; ``--model-path``, ``--host`` and ``--port`` as sglang's launch_server names them."""
    parser.add_argument("--model-path", required=True, help="a local Hugging Face checkpoint folder (model + tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; binding elsewhere is explicit)")
    parser.add_argument("--port", type=int, default=30000, help="port to bind (0: any free port; the log says which)")
    parser.add_argument("--name", default="tandem", help="this server's name in weight-sync reports and logs")
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1...")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=1, help="CPU threads the decode thread computes with")
    parser.add_argument("--max-batch-size", type=int, default=64, help="sequences decoded at once")
    parser.add_argument("--resume-policy", default="recompute", choices=["recompute", "keep_cache"],
                        help="in-flight sequences at a weight update: re-encode the prefix, or keep the old cache")
    parser.add_argument("--consume-bucket-mb", type=float, default=64.0, help="pieces weights are loaded in (MiB)")
    parser.add_argument("--weight-timeout-s", type=float, default=600.0, help="distributed weight-group timeout")
    parser.add_argument("--port-file", type=Path, default=None, help="write the bound port here once serving")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer <key>' on every route but /health (default: ${API_KEY_ENV}; "
                             "the variable keeps the key out of the process list)")
    parser.add_argument("--admin-api-key", default=None,
                        help=f"a separate key for the routes that change weights or steer others' requests "
                             f"(weight updates, pause, continue, abort, flush) (default: ${ADMIN_KEY_ENV})")
    parser.add_argument("--allow-unauthenticated", action="store_true",
                        help="serve a non-loopback --host without --api-key (refused otherwise)")
    parser.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body (MiB); larger ones get 413")
    parser.add_argument("--max-top-logprobs", type=int, default=20, help="most top log-probs one OpenAI request may ask for")
    parser.add_argument("--max-running-requests", type=int, default=4096,
                        help="generation requests held at once (queued, paused or running); more get 429")
    parser.add_argument("--max-queued-tokens", type=int, default=1 << 23,
                        help="prompt plus max_new_tokens of every request held at once; more get 429")
    parser.add_argument("--weight-dir", type=Path, action="append", default=None,
                        help="a folder /update_weights_from_disk may load from, with what is under it (repeat; "
                             "default: the model's own folder)")
    parser.add_argument("--weight-group-address", action="append", default=None,
                        help="an address /init_weights_update_group may rendezvous at (repeat; default: loopback)")
    parser.add_argument("--lora-rank", type=int, default=None,
                        help="serve a LoRA adapter of this rank over the base (the trainer's engines.lora.rank); "
                             "weight updates then carry the adapter only")
    parser.add_argument("--lora-alpha", type=float, default=16.0, help="the adapter's alpha (engines.lora.alpha)")
    parser.add_argument("--lora-target-modules", nargs="+", default=None,
                        help="layers that get an adapter (engines.lora.target_modules; default: the architecture's)")
    parser.add_argument("--connect-timeout-s", type=float, default=5.0,
                        help="how long joining a weight group waits for its rendezvous to answer (torch retries once)")

