"""The ``tandem`` command: ``tandem run CONFIG [dotted.key=value ...] [--set dotted.key=value ...] [--no-progress]``.

Options and overrides come in any order: ``tandem run default --no-progress run.max_steps=3`` and
``tandem run default run.max_steps=3 --no-progress`` are the same run, and ``--set key=value`` is
the same as a bare ``key=value``. Since options and overrides are parsed apart, their relative
order is lost, so a key given twice is refused rather than resolved by position.

It owns the process edge of a run: finding the config (a path, or the name of a file in the
repo's ``configs/`` folder), turning config errors into one message and exit code 2 before
anything starts, setting up logging, the progress bar (fed by the flow's ``on_step`` listener)
and the one-line summary. Exit codes: 0 done, 1 a stage failed (its error names the stage and
prompts), 2 an invalid config or command line, 130 Ctrl-C. Everything else is the flow's.

Each command imports what it runs when it runs: at its top this module imports only what parses
the command line. ``tandem --help`` needs no more, and a reward worker imports this module again
(a ``spawn`` child re-imports its parent's main module, here the ``tandem`` script): measured on
2 cores, the flow's imports cost each worker 0.7 CPU-s at its start.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

from tandem.core.paths import CONFIGS_DIR
from tandem.engines.server.options import add_arguments as add_serve_arguments

if TYPE_CHECKING:
    from rich.progress import Progress

    from tandem.core.config import TandemConfig
    from tandem.core.history import StepRecord
    from tandem.pipeline.flow import FlowResult

__all__ = ["main", "summary_line"]

EXIT_CONFIG_ERROR = 2
EXIT_INTERRUPTED = 130  # the shell's convention for SIGINT


def shipped_configs() -> dict[str, str]:
    """Name -> first line of the file's leading ``#`` comment, for every YAML in ``configs/``."""
    out: dict[str, str] = {}
    for path in sorted(CONFIGS_DIR.glob("*.yaml")):
        first = path.read_text().splitlines()[:1]
        out[path.stem] = first[0].lstrip("#").strip() if first and first[0].startswith("#") else ""
    return out


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``tandem`` parser and its ``run`` subparser (which ``main`` parses intermixed)."""
    listing = "\n".join(f"  {name:<16} {desc}" for name, desc in shipped_configs().items())
    epilog = f"shipped configs (in {CONFIGS_DIR}):\n{listing or '  (none)'}"
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="tandem", description="Asynchronous RL post-training engine.", epilog=epilog, formatter_class=fmt
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser("run", help="run a training job", description="Run a training job.",
                              epilog=epilog, formatter_class=fmt)
    run.add_argument("config", metavar="CONFIG", help="a YAML path, or the name of a shipped config")
    run.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                     help="dotted overrides applied after the file, e.g. run.max_steps=5 staleness.max_staleness=0")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="set_overrides",
                     help="an override, the same as a bare KEY=VALUE (repeatable)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar (logs and summary only)")
    config = commands.add_parser("config", help="show a resolved config", description="Show a config as a run would use it.")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_commands.add_parser("show", help="print the resolved config, each field with its one-line doc",
                                      description="Print CONFIG after its overrides and every default, as YAML with "
                                      "each field's one-line doc; errors as `tandem run` reports them.")
    show.add_argument("config", metavar="CONFIG", help="a YAML path, or the name of a shipped config")
    show.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, as for `tandem run`")
    serve = commands.add_parser("serve", help="serve a model's rollout engine behind sglang's HTTP API",
                                description="The rollout engine in a process of its own, speaking sglang's native "
                                "HTTP API (and OpenAI's /v1 completions) until SIGTERM or Ctrl-C.")
    add_serve_arguments(serve)
    return parser, run


def _parse(argv: list[str]) -> argparse.Namespace:
    """Parse the command line; ``run``'s options and overrides may come in any order.

    argparse stops filling a ``*`` positional at the first option, so ``run`` is parsed with
    ``parse_intermixed_args`` (which the top-level parser cannot use: it has subcommands).
    """
    parser, run = _parsers()
    if argv[:1] != ["run"]:
        return parser.parse_args(argv)
    args = run.parse_intermixed_args(argv[1:])
    args.command = "run"
    args.overrides = [*args.overrides, *args.set_overrides]
    keys = [item.partition("=")[0].strip() for item in args.overrides]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        run.error(f"override given more than once: {', '.join(twice)}")
    return args


class _ProgressListener:
    """Feeds the bar from each trained step: reward, mean staleness so far, samples/s so far."""

    def __init__(self, progress: Progress, total: int, start_s: float) -> None:
        self._progress = progress
        self._task = progress.add_task("train", total=total, stats="")
        self._start_s = start_s  # event-loop time, the clock step records are stamped with
        self._samples = 0
        self._groups = 0
        self._staleness = 0

    def __call__(self, record: StepRecord) -> None:
        self._samples += record.samples
        self._groups += len(record.staleness)
        self._staleness += sum(record.staleness)
        elapsed = record.time_s - self._start_s
        stats = (
            f"reward {record.reward_mean:.3f}  staleness {self._staleness / max(self._groups, 1):.2f}  "
            f"{self._samples / elapsed if elapsed > 0 else 0.0:.1f} samples/s"
        )
        self._progress.update(self._task, completed=record.step + 1, stats=stats)


@contextmanager
def _progress_bar(config: TandemConfig) -> Iterator[Progress]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tandem.pipeline.logs import configure_logging

    progress = Progress(
        TextColumn("step"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[stats]}"),
        console=Console(stderr=True),
    )
    with progress:
        # Logging is configured inside the bar: the PrintLogger binds sys.stderr when configured,
        # and here that is rich's proxy, so log lines print above the bar instead of through it.
        configure_logging(config.observability.log_format, config.observability.log_level)
        yield progress


def summary_line(result: FlowResult) -> str:
    """steps, wall time, samples/s, reward at start -> end, staleness counts, ledger (with drops
    per stage and degradations, if any), the task's held-out measure first -> last, by its name
    (if validated), run folder.

    Start and end are the mean reward of the first and last tenth of the steps: one step's
    batch is too small (its prompts' difficulty varies) to say whether the policy improved.
    """
    reward = (
        f"{result.reward_first:.3f} -> {result.reward_last:.3f} (means of the first and last tenth of the steps)"
        if result.reward_first is not None and result.reward_last is not None
        else "n/a"
    )
    staleness = ", ".join(f"{k}: {n}" for k, n in result.staleness_counts.items()) or "none"
    by_stage = ", ".join(f"{stage}: {n}" for stage, n in result.ledger["dropped_by_stage"].items())
    degradations = sum(m.degraded for m in result.mode_changes)
    validations = result.validations
    held_out = (
        f"held-out {validations[0].measure.replace('_', ' ')} {validations[0].score:.3f} (v{validations[0].version}) -> "
        f"{validations[-1].score:.3f} (v{validations[-1].version}), "
        if validations
        else ""
    )
    return (
        f"done: {result.total_steps} steps in {result.wall_s:.2f}s, {result.samples_per_s:.1f} samples/s, "
        f"reward {reward}, staleness {{{staleness}}}, "
        f"ledger trained {result.ledger['trained']} dropped {result.ledger['dropped']}"
        f"{f' ({by_stage})' if by_stage else ''}, "
        f"{f'degraded to synchronous {degradations}x, ' if degradations else ''}{held_out}"
        f"run folder {result.run_dir if result.run_dir is not None else '(not written)'}"
    )


async def _run(config: TandemConfig, progress: Progress | None) -> FlowResult:
    from tandem.pipeline.flow import AsyncTrainingFlow

    listener: _ProgressListener | None = None
    if progress is not None:
        listener = _ProgressListener(progress, config.run.max_steps, asyncio.get_running_loop().time())
    return await AsyncTrainingFlow(config, on_step=listener).run()


def main(argv: list[str] | None = None) -> int:
    # Custom stages are named as module:Class; as with `python -m`, modules in the working
    # directory are importable (a console script does not put it on sys.path by itself).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        args = _parse(sys.argv[1:] if argv is None else argv)
    except SystemExit as exit_:  # --help, or argparse's own usage error (code 2)
        return int(exit_.code or 0)
    if args.command == "serve":
        return _serve(args)
    if args.command == "config":
        return _show_config(args)
    return _train(args)


def _serve(args: argparse.Namespace) -> int:
    from tandem.engines.server.app import run as serve
    from tandem.pipeline.logs import configure_logging

    configure_logging("console", "info")
    return serve(args)


def _show_config(args: argparse.Namespace) -> int:
    from tandem.core.config import ConfigError, load_config
    from tandem.pipeline.config_show import render_config

    try:
        print(render_config(load_config(args.config, args.overrides)), end="")
    except ConfigError as err:
        print(f"tandem: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    return 0


def _train(args: argparse.Namespace) -> int:
    from tandem.core.config import ConfigError, load_config
    from tandem.pipeline.logs import configure_logging
    from tandem.state_machines.base import StageError

    # The bar is on by default from the command line; the user's own override still wins,
    # and --no-progress wins over both.
    overrides = ["observability.progress=true", *args.overrides]
    if args.no_progress:
        overrides.append("observability.progress=false")
    try:
        config = load_config(args.config, overrides)
    except ConfigError as err:
        print(f"tandem: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    bar = _progress_bar(config) if config.observability.progress else nullcontext(None)
    try:
        with bar as progress:
            if progress is None:
                configure_logging(config.observability.log_format, config.observability.log_level)
            result = asyncio.run(_run(config, progress))
    except KeyboardInterrupt:
        # asyncio.run has cancelled the flow, which closed its engines and wrote its trace.
        print("tandem: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ConfigError as err:  # found while building engines or data: nothing has run
        print(f"tandem: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except StageError as err:
        print(f"tandem: run failed: {err}", file=sys.stderr)
        return 1
    print(summary_line(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
