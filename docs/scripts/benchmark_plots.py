"""Regenerate the benchmark plots of the documentation from ``benchmarks/results/*.json``.

``python docs/scripts/benchmark_plots.py`` writes ``docs/img/benchmarks/<claim>.png``, one per
results file this script knows (one file per claim); the Benchmarks page shows them. Run it after a
benchmark rewrites its results file, and commit both.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
OUT = REPO / "docs" / "img" / "benchmarks"


def _load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _grouped_bars(ax: Axes, groups: list[str], series: dict[str, dict[str, list[float]]], ylabel: str) -> None:
    """Bars at the median of each (group, series) with every run as a dot: the spread is the point."""
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        medians = [statistics.median(values[g]) if values.get(g) else 0.0 for g in groups]
        ax.bar(xs, medians, width * 0.9, label=label, alpha=0.75)
        for x, g in zip(xs, groups, strict=True):
            ax.plot([x] * len(values.get(g, [])), values.get(g, []), "k.", markersize=4)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    if len(series) > 1:
        ax.legend()


def _by_mode(rows: list[dict[str, Any]], value: str, label: Callable[[dict[str, Any]], str]) -> tuple[list[str], dict]:
    modes: list[str] = []
    series: dict[str, dict[str, list[float]]] = {}
    for row in rows:
        if row["mode"] not in modes:
            modes.append(row["mode"])
        series.setdefault(label(row), {}).setdefault(row["mode"], []).append(row[value])
    return modes, series


def _e2e(name: str, title: str, field: str | None) -> Callable[[Axes], None]:
    """The end-to-end family: samples/s per mode, one bar series per value of ``field``."""

    def plot(ax: Axes) -> None:
        rows = _load(name)["rows"]
        modes, series = _by_mode(rows, "samples_per_s", lambda r: str(r[field]) if field else "samples/s")
        _grouped_bars(ax, modes, series, "samples/s (dots: each run)")
        ax.set_title(title)

    return plot


def _agentic(ax: Axes) -> None:
    modes, series = _by_mode(_load("agentic")["rows"], "episodes_per_s", lambda r: "episodes/s")
    _grouped_bars(ax, modes, series, "episodes/s")
    ax.set_title("FrozenLake episodes/s, same episode budget (2-core CPU)")


def _flow_grpo(ax: Axes) -> None:
    rows = _load("flow_grpo")["rows"]
    labels = [f"{r['mode']}\n{'async' if r['with_reward'] else 'no'} reward, {r['judge']}" for r in rows]
    ax.bar(range(len(rows)), [r["samples_per_s"] for r in rows], alpha=0.75)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("images/s")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title("Flow-GRPO on digits: images/s per schedule (2-core CPU)")


def _learning_quality(ax: Axes) -> None:
    """Each row's held-out accuracy minus the baseline's, paired by seed, with its 95 % interval."""
    doc = _load("learning_quality")
    rows = [r for r in doc["rows"] if r["row"] != doc["baseline"]]
    ys = range(len(rows))
    ax.errorbar(
        [r["heldout_delta_vs_baseline"] for r in rows],
        ys,
        xerr=[r["heldout_delta_vs_baseline_ci95"] for r in rows],
        fmt="o",
        capsize=3,
    )
    ax.axvline(0, color="grey", linestyle="--", linewidth=1)
    ax.set_yticks(ys, [r["row"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"held-out accuracy minus {doc['baseline']}'s, paired by seed (95 % interval)")
    ax.grid(axis="x", alpha=0.3)
    settings = doc["settings"]
    ax.set_title(f"Learning quality: {settings['samples']} samples per run, {len(settings['seeds'])} seeds")


def _param_sync(ax: Axes) -> None:
    rows = [r for r in _load("param_sync")["rows"] if "transport" in r]
    sizes = sorted({r["size_mb"] for r in rows})
    series: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        series.setdefault(f"{r['transport']} ({r['rollout']})", {})[f"{r['size_mb']} MiB"] = [
            100 * f for f in r["fraction_of_best_memcpy_runs"]
        ]
    _grouped_bars(ax, [f"{s} MiB" for s in sizes], series, "% of memcpy (dots: each run)")
    ax.axhline(50, color="grey", linestyle="--", linewidth=1)
    ax.set_title("Weight sync throughput against memcpy of the same size (2-core CPU)")


def _param_sync_ray(ax: Axes) -> None:
    rows = _load("param_sync_ray")["rows"]
    series: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        series.setdefault(r["transport"], {})[f"{r['size_mb']} MiB"] = [r["gb_per_s"]]
    _grouped_bars(ax, sorted({f"{r['size_mb']} MiB" for r in rows}, key=lambda s: int(s.split()[0])), series, "GB/s")
    ax.set_title("Weight sync between Ray actors")


def _overlap(ax: Axes) -> None:
    rows = _load("overlap")["rows"]
    ax.bar([r["mode"] for r in rows], [r["efficiency"] for r in rows], alpha=0.75)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("efficiency (ideal / achieved step time)")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title("Simulated 512-slot cluster, long-tailed generation, 200 steps")


def _engine_overhead(ax: Axes) -> None:
    spread = _load("engine_overhead")["spread"]
    _grouped_bars(
        ax,
        ["micro-batch 1", "micro-batch 32"],
        {"samples/s": {"micro-batch 1": spread["batch1"]["all"], "micro-batch 32": spread["batch32"]["all"]}},
        "samples/s through the flow (dots: each run)",
    )
    ax.axhline(50_000, color="grey", linestyle="--", linewidth=1)
    ax.set_title("The flow's own cost: zero-cost stages, all eight roles, one core")


def _soak(ax: Axes) -> None:
    memory = _load("soak")["memory"]
    readings = memory["readings"]
    steps = [r["step"] for r in readings]
    for key, label in (("traced", "traced Python heap"), ("rss", "RSS")):
        base = readings[0][key]
        ax.plot(steps, [100 * (r[key] - base) / base for r in readings], marker=".", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("% growth since the first reading")
    ax.legend()
    ax.grid(alpha=0.3)
    ax.set_title("10,000 steps with faults in every role: memory")


def _rollout_engines(ax: Axes) -> None:
    rows = _load("rollout_engines")["rows"]
    series: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        series.setdefault(r["engine"], {})[r["model"]] = r["runs"] if r.get("runs") else [r["tokens_per_s_median"]]
    _grouped_bars(ax, list(dict.fromkeys(r["model"] for r in rows)), series, "tokens/s (dots: each run)")
    ax.set_yscale("log")
    ax.set_title("Decode throughput on 2 CPU threads, batch 64")


def _train_scaling(ax: Axes) -> None:
    rows = _load("train_scaling")["rows"]
    labels = [f"{r['engine']}\n{r['ranks']} rank{'s' if r['ranks'] > 1 else ''}" for r in rows]
    ax.bar(range(len(rows)), [r["tokens_per_s"] for r in rows], alpha=0.75)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("train-step tokens/s")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title("Trainer groups on a 2-core CPU (3.5M-parameter Llama)")


PLOTS: dict[str, Callable[[Axes], None]] = {
    "overlap": _overlap,
    "engine_overhead": _engine_overhead,
    "soak": _soak,
    "e2e_server": _e2e("e2e_server", "Default job: in process vs a tandem serve process, 3 runs (2-core CPU)", "rollout"),
    "e2e": _e2e("e2e", "Default job, pi_prox from the train step vs recomputed (2-core CPU)", None),
    "e2e_h100": _e2e("e2e_h100", "Default job on one H100", None),
    "e2e_ray": _e2e("e2e_ray", "Default job on Ray actors vs in process (2-core CPU)", "backend"),
    "e2e_vllm": _e2e("e2e_vllm", "Default job on vLLM (CPU build) vs the embedded engine, 2 runs", "rollout"),
    "e2e_server_agent": _e2e("e2e_server_agent", "An OpenAI-client agent vs the native server path, 3 runs", "rollout"),
    "agentic": _agentic,
    "flow_grpo": _flow_grpo,
    "learning_quality": _learning_quality,
    "param_sync": _param_sync,
    "param_sync_ray": _param_sync_ray,
    "rollout_engines": _rollout_engines,
    "train_scaling": _train_scaling,
}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, plot in PLOTS.items():
        fig, ax = plt.subplots(figsize=(9, 4.5))
        plot(ax)
        fig.tight_layout()
        fig.savefig(OUT / f"{name}.png", dpi=100)
        plt.close(fig)
        print(OUT / f"{name}.png")


if __name__ == "__main__":
    main()
