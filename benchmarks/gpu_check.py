"""The GPU check: every ``gpu`` test, then tandem's figures at a realistic size, in one command.

Why one prepared command: a GPU is lent now and then, for minutes, so everything worth knowing
on one runs in a single go (about 8 minutes on an H100) and is cheap to rerun. In order:

1. every ``gpu``-marked test (``pytest -m gpu`` over the test files that have one), with each
   test's outcome and, for a skip, its reason;
2. ``text`` (``gpu/text.py``): Qwen2.5-0.5B-shaped, bfloat16: the embedded rollout engine's decode
   tokens/s at 64 and 256 sequences against ``model.generate``; the default job's schedule, sync
   against k = 1, both engines on the one GPU; the weight sync of that run (seconds, GB/s, stall);
3. ``images`` (``gpu/images.py``): Flow-GRPO on an SD3-family transformer of a few hundred
   million parameters: rollout images/s, train-step time, colocated sync against one step off;
4. ``trainer_groups`` (``gpu/trainer_groups.py``): plain torch's train step (tokens/s and model
   FLOPs utilisation against the card's bf16 peak), FSDP2 on one GPU against it, megatron-core's
   engine on CUDA (its DDP and distributed optimizer).

Every model is built from config with random weights (no download). A part that cannot run on
the host (a library missing) is reported as skipped with the reason; a part that fails is
reported with its error and the others still run. The JSON is rewritten after each part, so a
run cut short keeps what it measured: ``benchmarks/results/gpu_check.json`` by default.

The GPU host has torch, transformers, peft and accelerate but none of tandem's other
dependencies, and no network: ``make gpu-wheels`` downloads the small wheels it needs into
``.whl/`` (pydantic, structlog, tenacity, diffusers, megatron-core, pytest-asyncio, ...), and the
command there installs them into a folder of its own first (see ``make gpu-wheels``).

    python benchmarks/gpu_check.py [--tiny] [--out PATH] [--parts text images trainer_groups] [--no-tests]

``--tiny`` runs every part on CPU at toy shapes for a few steps (no tests, JSON only to
``--out``): the test suite runs it, so the check does not rot between GPUs.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import importlib.metadata
import json
import logging
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from gpu.common import Scale

# torch, transformers and gpu.common (which imports torch) are imported in the functions that use
# them: the runs' reward workers are spawned, and a spawned child re-imports this script, which
# with them at the top cost each of the tiny mode's four runs about 4 s of CPU for nothing.

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "gpu_check.json"
PARTS = ("text", "images", "trainer_groups")
TESTS_TIMEOUT_S = 240
LIBRARIES = ("torch", "transformers", "diffusers", "megatron-core", "peft", "accelerate", "pydantic", "numpy")


def gpu_test_files() -> list[str]:
    """The test files with a ``gpu`` mark (only these are collected: the others import what the
    GPU host lacks, such as vLLM and Ray)."""
    mark = re.compile(r"pytest\.mark\.gpu\b")
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if mark.search(p.read_text()))


def run_gpu_tests() -> dict[str, Any]:
    """``pytest -m gpu`` in a child process; every test's outcome from its JUnit report."""
    files = gpu_test_files()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *files]
        started = time.perf_counter()
        try:
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            tail = (exc.stdout or b"")[-3000:]
            return {"status": "error", "error": f"timed out after {TESTS_TIMEOUT_S} s", "output_tail": str(tail)}
        seconds = time.perf_counter() - started
        tests = junit_outcomes(report) if report.is_file() else []
    counts = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "skipped", "error")}
    status = "ok" if done.returncode == 0 else "failed"
    return {"status": status, "wall_s": seconds, "returncode": done.returncode, "files": files, **counts,
            "tests": tests, "output_tail": done.stdout[-4000:] + done.stderr[-2000:]}  # fmt: skip


def junit_outcomes(report: Path) -> list[dict[str, str]]:
    out = []
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "failed" if tag == "failure" else tag
                message = (node.get("message") or node.text or "")[:600]
                break
        out.append({"test": name, "outcome": outcome, "message": message})
    return out


def run_part(name: str, scale: Scale) -> dict[str, Any]:
    """One part's figures, or why it was skipped, or its error; with its wall time and peak memory."""
    import torch
    from gpu.common import Skipped

    if scale.on_cuda:
        torch.cuda.reset_peak_memory_stats(scale.device)
    started = time.perf_counter()
    try:
        figures = importlib.import_module(f"gpu.{name}").run(scale)
        result: dict[str, Any] = {"status": "ok", **figures}
    except Skipped as exc:
        result = {"status": "skipped", "reason": str(exc)}
    except Exception as exc:  # one part's failure is reported, the others still run
        result = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
    result["wall_s"] = time.perf_counter() - started
    if scale.on_cuda:
        result["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated(scale.device) / 2**30
    gc.collect()
    if scale.on_cuda:
        torch.cuda.empty_cache()
    return result


def versions() -> dict[str, str | None]:
    import torch

    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    found["cuda"] = torch.version.cuda
    return found


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("TANDEM_COMMIT")


def print_summary(doc: dict[str, Any]) -> None:
    console = Console(width=160)
    table = Table(title=f"GPU check on {doc['device']} ({doc['date']})")
    for col in ("part", "status", "wall s", "figures"):
        table.add_column(col, justify="left")
    tests = doc.get("tests")
    if tests:
        summary = ", ".join(f"{tests.get(k, 0)} {k}" for k in ("passed", "failed", "skipped", "error"))
        table.add_row("gpu tests", tests["status"], f"{tests.get('wall_s', 0):.0f}", summary)
    for name, part in doc["parts"].items():
        table.add_row(name, part["status"], f"{part['wall_s']:.0f}", headline(name, part))
    console.print(table)


def headline(name: str, part: dict[str, Any]) -> str:
    """The part's key figures in one line (the JSON has them all)."""
    if part["status"] == "skipped":
        return part["reason"]
    if part["status"] == "error":
        return part["error"][:150]
    keys = {
        "text": ("k1_over_sync",),
        "images": ("rollout_images_per_s", "train_step_s", "k1_over_sync"),
        "trainer_groups": ("plain_tokens_per_s", "plain_mfu", "fsdp2_over_plain", "megatron_tokens_per_s"),
    }[name]
    parts = [f"{k} {part[k]:.3g}" for k in keys if isinstance(part.get(k), int | float)]
    if name == "text":
        parts += [f"{r['engine']}@{r['batch']} {r['tokens_per_s_median']:,.0f} tok/s" for r in part.get("decode", [])]
        sync = part.get("weight_sync", {})
        if sync.get("total_s") is not None:
            parts.append(f"sync {sync['total_s']:.3f} s, {sync['gb_per_s']:.2f} GB/s, stall {sync['stall_s'] * 1e3:.1f} ms")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="every part on CPU at toy shapes (the test suite's smoke run)")
    parser.add_argument("--out", type=Path, help=f"where the JSON goes (default {RESULTS}; with --tiny, nowhere)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--no-tests", action="store_true", help="leave out the gpu-marked tests")
    args = parser.parse_args()
    import torch
    import transformers
    from gpu.common import Scale, bf16_peak_flops

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: `--tiny` runs the check on CPU at toy shapes")
    device = torch.device("cpu" if args.tiny else "cuda")
    out = args.out or (None if args.tiny else RESULTS)
    _, card = bf16_peak_flops(device)
    doc: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "device": card,
        "tiny": args.tiny, "commit": commit(), "versions": versions(), "cpu_cores": os.cpu_count(), "parts": {},
    }  # fmt: skip

    def save() -> None:
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(doc, indent=2, default=str))

    started = time.perf_counter()
    if not args.tiny and not args.no_tests:
        doc["tests"] = run_gpu_tests()
        print(f"gpu tests: {doc['tests']['status']} ({time.perf_counter() - started:.0f} s)", flush=True)
        save()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        scale = Scale(device=device, tiny=args.tiny, workdir=Path(tmp))
        for name in args.parts:
            doc["parts"][name] = run_part(name, scale)
            print(f"{name}: {doc['parts'][name]['status']} ({doc['parts'][name]['wall_s']:.0f} s)", flush=True)
            save()
    doc["wall_s"] = time.perf_counter() - started
    save()
    print_summary(doc)
    if out is not None:
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
