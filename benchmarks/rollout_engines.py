"""Rollout engines on CPU: decode throughput (tokens/s) of tandem's embedded engine, vLLM and ``model.generate``.

Why: the embedded engine (``engines.text.rollout``) is a few hundred lines of Python around a
transformers model; this measures what that costs or saves against the two other ways to sample
on CPU, at equal work: transformers' own ``model.generate`` on one static batch (the floor any
engine must beat) and vLLM in process (``engines.vllm``, its CPU build, compiled by default;
``--eager`` for eager mode).

Every engine samples the same shape of work: ``--batch`` sequences at once, each a random prompt
of ``--prompt-tokens`` tokens followed by exactly ``--new-tokens`` sampled tokens (temperature 1,
no top-k/top-p), float32, ``--threads`` cores. The models are saved with no end-of-sequence id, so
no engine stops early: the shipped 1M-parameter arithmetic model (``1m``, copied without its eos)
and a ~44M-parameter Llama with random weights and a 32k vocabulary (``30m``). Each engine runs
alone (one after another, each closed before the next starts): one warm-up round, then
``--repeat`` timed rounds, tokens/s = batch * new tokens / seconds of the round; prompts differ
per round (vLLM's prefix cache never hits). Start-up time (model load, vLLM's compile) is
reported apart and is not in tokens/s. Prints a table and writes
``benchmarks/results/rollout_engines.json``.

    python benchmarks/rollout_engines.py [--batch 64] [--prompt-tokens 16] [--new-tokens 128]
        [--threads 2] [--repeat 3] [--models 1m 30m] [--engines generate embedded vllm] [--eager]

``--tiny`` is a smoke run (batch 4, 8 new tokens, one round, one thread, the 1M model) that writes only to
``--out`` (nothing when it is not given); a unit test runs it so the script keeps working.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import importlib.util
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
import transformers
from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).parent / "results" / "rollout_engines.json"
ARITHMETIC_MODEL = Path(__file__).resolve().parent.parent / "tasks" / "arithmetic" / "model"
ENGINES = ("generate", "embedded", "vllm")  # the order they run in
MODELS = ("1m", "30m")
FIRST_PROMPT_ID = 4  # prompts draw ordinary tokens: both models' special tokens are ids 0-3

Sampler = Callable[[list[list[int]], int], int]  # (prompts, round) -> new tokens generated


# ----------------------------------------------------------------------------- models


def _without_eos(folder: Path) -> None:
    """Null ``eos_token_id`` in the model's config and generation config: nothing stops early."""
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.is_file():
            data = json.loads(path.read_text())
            data["eos_token_id"] = None  # not removed: LlamaConfig's default would bring back id 2
            path.write_text(json.dumps(data, indent=2))


def arithmetic_model(folder: Path) -> Path:
    """The shipped 1M-parameter model and its tokenizer, copied to ``folder`` without an eos."""
    shutil.copytree(ARITHMETIC_MODEL, folder)
    _without_eos(folder)
    return folder


def random_llama(folder: Path, vocab_size: int = 32_000) -> Path:
    """A Llama of ~44M parameters (8 layers of width 512, tied 32k embedding), random weights, no
    eos, and a word-level tokenizer over its whole vocabulary (``<pad>``, ``<bos>``, ``<eos>``,
    ``<unk>``, then ``w4`` ... ``w31999``) that transformers and vLLM both load."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials)} | {f"w{i}": i for i in range(len(specials), vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>").save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8, head_dim=64,  # vLLM's CPU attention: a multiple of 32
        max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    _without_eos(folder)
    return folder


def build_model(name: str, root: Path) -> Path:
    """Model ``name`` saved under ``root``, checked to have no eos id."""
    from tandem.engines.vllm.engine import eos_token_ids

    path = arithmetic_model(root / name) if name == "1m" else random_llama(root / name)
    if eos_token_ids(path):
        raise RuntimeError(f"{path} still has an eos id: samples could stop early")
    return path


def model_facts(path: Path) -> tuple[int, int, int]:
    """(parameters, vocabulary size, max positions) of the model at ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    return params, config.vocab_size, config.max_position_embeddings


def round_prompts(round_index: int, batch: int, length: int, vocab_size: int) -> list[list[int]]:
    """``batch`` random prompts of ``length`` ordinary tokens, different every round."""
    rng = np.random.default_rng(round_index)
    return rng.integers(FIRST_PROMPT_ID, vocab_size, size=(batch, length)).tolist()


# ----------------------------------------------------------------------------- engines


@contextmanager
def hf_generate(
    path: Path, batch: int, new_tokens: int, threads: int, *, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> Iterator[Sampler]:
    """transformers' ``model.generate`` on the whole batch at once (equal-length prompts: no padding)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()

    def sample(prompts: list[list[int]], round_index: int) -> int:
        input_ids = torch.tensor(prompts, device=device)
        torch.manual_seed(round_index)
        with torch.no_grad():
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True, temperature=1.0,
                top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
            )  # fmt: skip
        return out.shape[0] * (out.shape[1] - input_ids.shape[1])

    yield sample


def _async_sampler(engine: Any, new_tokens: int) -> Sampler:
    """A ``Sampler`` over an engine with the ``RolloutEngine.generate`` API."""
    from tandem.core.protocols import GenerationRequest, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)

    async def drain(prompts: list[list[int]], round_index: int) -> int:
        requests = [GenerationRequest(i, 0, prompt, params, seed=round_index) for i, prompt in enumerate(prompts)]
        return sum([t.num_actions async for t in engine.generate(requests)])

    return lambda prompts, round_index: asyncio.run(drain(prompts, round_index))


@contextmanager
def embedded(
    path: Path, batch: int, new_tokens: int, threads: int, *, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> Iterator[Sampler]:
    """tandem's embedded engine (``engines.text.rollout``): its decode thread, ``threads`` cores."""
    from tandem.engines.text.rollout import HFRolloutEngine

    engine = HFRolloutEngine(str(path), max_batch_size=batch, num_threads=threads, device=device, dtype=dtype)
    try:
        yield _async_sampler(engine, new_tokens)
    finally:
        engine.close()


def vllm_engine(eager: bool) -> Callable[[Path, int, int, int], Any]:
    @contextmanager
    def vllm(path: Path, batch: int, new_tokens: int, threads: int) -> Iterator[Sampler]:
        """vLLM in process (``engines.vllm``): its engine core process bound to ``threads`` cores."""
        from tandem.engines.vllm.build import generation_cpus
        from tandem.engines.vllm.engine import VllmRolloutEngine, VllmSettings

        engine = VllmRolloutEngine(
            path, max_batch_size=batch, enforce_eager=eager,
            settings=VllmSettings(kv_cache_gib=1, cpus=generation_cpus(threads)),
        )  # fmt: skip
        try:
            yield _async_sampler(engine, new_tokens)
        finally:
            engine.close()

    return vllm


# ----------------------------------------------------------------------------- measuring


def measure(
    engine: Callable[[Path, int, int, int], Any], path: Path, vocab_size: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Start the engine, one warm-up round, ``args.repeat`` timed rounds; tokens/s of each."""
    expected = args.batch * args.new_tokens
    started = time.perf_counter()
    with engine(path, args.batch, args.new_tokens, args.threads) as sample:
        startup_s = time.perf_counter() - started
        rates = []
        for round_index in range(args.repeat + 1):  # round 0 warms up
            prompts = round_prompts(round_index, args.batch, args.prompt_tokens, vocab_size)
            t0 = time.perf_counter()
            tokens = sample(prompts, round_index)
            seconds = time.perf_counter() - t0
            if tokens != expected:
                name = getattr(engine, "__name__", getattr(getattr(engine, "func", None), "__name__", "engine"))
                raise RuntimeError(f"{name} generated {tokens} tokens, not {expected}: the work differs")
            if round_index:
                rates.append(tokens / seconds)
    return {
        "tokens_per_s_median": statistics.median(rates), "tokens_per_s_min": min(rates),
        "tokens_per_s_max": max(rates), "runs": rates, "startup_s": startup_s,
    }  # fmt: skip


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def claim(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """One sentence: each engine's median tokens/s against ``model.generate``'s, per model."""
    parts = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = {r["engine"]: r for r in rows if r["model"] == model}
        base = mine.get("generate")
        figures = [
            f"{name} {r['tokens_per_s_median']:,.0f} tok/s"
            + (f" ({r['tokens_per_s_median'] / base['tokens_per_s_median']:.2f}x generate)" if base and r is not base else "")
            for name, r in mine.items()
        ]
        parts.append(f"{model} ({mine[next(iter(mine))]['params'] / 1e6:.1f}M params): " + ", ".join(figures))
    vllm_mode = f", vLLM {'eager' if args.eager else 'compiled'}" if "vllm" in args.engines else ""
    return (
        f"Decode throughput on {_threads(args.threads)}, batch {args.batch}, {args.prompt_tokens}-token prompts, "
        f"{args.new_tokens} new tokens, float32{vllm_mode}, median of {args.repeat}: " + "; ".join(parts) + "."
    )


def _threads(n: int) -> str:
    return f"{n} CPU thread{'s' if n > 1 else ''}"


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    vllm_label = f"vllm ({'eager' if args.eager else 'compiled'})"
    table = Table(
        title=f"Decode tokens/s: batch {args.batch}, {args.prompt_tokens}+{args.new_tokens} tokens, "
        f"{_threads(args.threads)}, median of {args.repeat}"
    )
    for col in ("model", "params", "engine", "tokens/s", "min–max", "vs generate", "start-up s"):
        table.add_column(col, justify="left" if col in ("model", "engine") else "right", no_wrap=col == "engine")
    for r in rows:
        base = next((b for b in rows if b["model"] == r["model"] and b["engine"] == "generate"), None)
        ratio = f"{r['tokens_per_s_median'] / base['tokens_per_s_median']:.2f}x" if base else "–"
        table.add_row(
            r["model"], f"{r['params'] / 1e6:.1f}M", vllm_label if r["engine"] == "vllm" else r["engine"],
            f"{r['tokens_per_s_median']:,.0f}", f"{r['tokens_per_s_min']:,.0f}–{r['tokens_per_s_max']:,.0f}",
            ratio, f"{r['startup_s']:.1f}",
        )  # fmt: skip
    Console().print(table)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="sequences sampled at once")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="tokens in every prompt")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens sampled per sequence (exactly)")
    parser.add_argument("--threads", type=int, default=2, help="CPU cores each engine computes on")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds per engine and model (after one warm-up)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--eager", action="store_true", help="vLLM in eager mode (default: compiled, as a run uses it)")
    parser.add_argument("--tiny", action="store_true", help="smoke run: batch 4, 8 new tokens, 1 round, 1 thread, the 1m model")
    parser.add_argument("--out", type=Path, help=f"where the JSON goes (default {RESULTS}; with --tiny, nowhere)")
    args = parser.parse_args()
    if args.tiny:
        # One thread: a smoke run's numbers mean nothing, and two threads on a busy 2-core machine
        # stall on each other (measured: model.generate 50x slower while another process ran).
        args.batch, args.new_tokens, args.repeat, args.threads, args.models = 4, 8, 1, 1, ["1m"]
    if min(args.batch, args.prompt_tokens, args.new_tokens, args.threads, args.repeat) < 1:
        parser.error("--batch, --prompt-tokens, --new-tokens, --threads and --repeat must be >= 1")
    if "vllm" in args.engines and importlib.util.find_spec("vllm") is None:
        parser.error("vLLM is not installed (`make install` installs its CPU build); leave it out of --engines")
    return args


def main() -> None:
    args = parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    runners = {"generate": hf_generate, "embedded": embedded, "vllm": vllm_engine(args.eager)}
    rows = []
    with tempfile.TemporaryDirectory(prefix="rollout_engines_") as tmp:
        for model in args.models:
            path = build_model(model, Path(tmp))
            params, vocab_size, positions = model_facts(path)
            print(f"model {model}: {params:,} parameters, vocabulary {vocab_size:,}, {positions} positions")
            if args.prompt_tokens + args.new_tokens > positions:
                raise SystemExit(f"{model}: {args.prompt_tokens} + {args.new_tokens} tokens exceed its {positions} positions")
            for name in (e for e in ENGINES if e in args.engines):
                row = {"model": model, "params": params, "engine": name} | measure(runners[name], path, vocab_size, args)
                print(f"  {name}: {row['tokens_per_s_median']:,.0f} tokens/s (start-up {row['startup_s']:.1f} s)")
                rows.append(row)
                gc.collect()  # the engine's model goes before the next one loads
    print_table(rows, args)
    out = args.out or (None if args.tiny else RESULTS)
    if out is None:
        return
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    if "vllm" in args.engines:
        import vllm

        versions["vllm"] = vllm.__version__
    result = {
        "claim": claim(rows, args),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "cores_used": args.threads, **versions},
        "settings": {
            "batch": args.batch,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "threads": args.threads,
            "repeat": args.repeat,
            "eager": args.eager,
            "dtype": "float32",
            "sampling": "temperature 1, no top-k/top-p, no eos (exactly new_tokens per sequence)",
        },
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
