"""The command line of ``tandem serve`` (imports nothing heavy: ``tandem --help`` lists it)."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_arguments"]


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
