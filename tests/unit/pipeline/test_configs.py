"""The shipped configs load and run, and the Grafana dashboard queries only series the flow exports."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import tandem.pipeline.metrics
from tandem.core.config import ConfigError, load_config
from tandem.core.paths import CONFIGS_DIR
from tandem.pipeline import AsyncTrainingFlow
from tests.conftest import make_config, run_virtual

CONFIGS = sorted(CONFIGS_DIR.glob("*.yaml"))
DASHBOARD = CONFIGS_DIR / "grafana" / "tandem.json"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_loads_and_opens_with_a_description(path: Path) -> None:
    load_config(path)
    assert path.read_text().startswith("# "), f"{path.name} must open with a '# description' line"


@pytest.mark.parametrize("path", [p for p in CONFIGS if load_config(p).engines.type == "fake"], ids=lambda p: p.stem)
def test_every_simulated_config_runs_a_few_steps(path: Path) -> None:
    config = load_config(path, ["run.max_steps=3", "observability.write_run_dir=false"])
    result = run_virtual(AsyncTrainingFlow(config).run())
    assert len(result.steps) == 3
    assert result.ledger["balanced"] and result.ledger["trained"] == 3 * config.train.prompts_per_step
    assert max(result.staleness_counts) <= config.staleness.k


def test_the_simulated_configs_differ_only_where_their_names_say() -> None:
    sync, k1, colocated = (load_config(CONFIGS_DIR / f"{n}.yaml") for n in ("sim_sync", "sim_k1", "sim_colocated"))
    assert (sync.staleness.k, k1.staleness.k) == (0, 1)
    assert not k1.flow.colocate and ["generate", "logp", "train"] in colocated.flow.colocate
    assert k1.engines.generation_latency.type == "lognormal"
    assert sync.engines == k1.engines == colocated.engines


def test_the_default_job_takes_pi_prox_from_the_train_step_and_naive_ppo_over_it_says_what_to_reset() -> None:
    default = load_config(CONFIGS_DIR / "default.yaml")
    assert default.algorithm.decoupled and default.algorithm.proximal == "current"
    assert "logp" not in default.flow.stages  # the forward pass `current` makes redundant
    refusal = r"algorithm\.proximal=current applies to decoupled PPO only.*algorithm\.proximal=recompute"
    with pytest.raises(ConfigError, match=refusal):
        load_config(CONFIGS_DIR / "default.yaml", ["algorithm.decoupled=false"])
    naive = load_config(CONFIGS_DIR / "default.yaml", ["algorithm.decoupled=false", "algorithm.proximal=recompute"])
    assert not naive.algorithm.decoupled


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def exported_series() -> set[str]:
    """Sample names a short fake run serves on its metrics endpoint."""
    config = make_config(
        observability={"metrics_port": 0},
        engines={"train_step_latency": {"type": "constant", "mean_s": 0.05}, "generation_latency": {"mean_s": 0.02}},
    )

    async def scrape() -> str:
        stepped = asyncio.Event()  # per-step series (reward, workload metrics) exist once a step landed
        flow = AsyncTrainingFlow(config, on_step=lambda _: stepped.set())
        task = asyncio.ensure_future(flow.run())
        await stepped.wait()
        assert flow.metrics_port is not None
        url = f"http://127.0.0.1:{flow.metrics_port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        await task
        return body

    body = asyncio.run(scrape())
    return {s.name for family in text_string_to_metric_families(body) for s in family.samples}


def test_the_dashboard_queries_only_series_the_flow_exports() -> None:
    used = {name for expr in dashboard_exprs() for name in re.findall(r"\btandem_[a-z_]+", expr)}
    exported = exported_series()
    assert used and used <= exported, f"not exported: {sorted(used - exported)}"


def test_the_dashboard_has_a_panel_for_every_documented_series() -> None:
    assert tandem.pipeline.metrics.__doc__ is not None
    series = tandem.pipeline.metrics.__doc__.split("Series", 1)[1]
    # Every ``name{labels}`` after "Series", less the ``tandem_`` prefix the docstring states.
    documented = {f"tandem_{name}" for name in re.findall(r"``([a-z_]+)", series) if name != "tandem_"}
    used = {name for expr in dashboard_exprs() for name in re.findall(r"\btandem_[a-z_]+", expr)}
    missing = {d for d in documented if not any(u == d or u.startswith(f"{d}_") for u in used)}
    assert len(documented) >= 15 and not missing, f"no panel for {sorted(missing)}"


def test_the_dashboard_is_an_importable_grafana_model() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 39
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
