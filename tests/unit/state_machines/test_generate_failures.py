"""The generate role's failures: concurrent engine calls that fail together surface as one
error naming the cause, not as a group of them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from tandem.core.protocols import RolloutRequest
from tandem.core.records import Trajectory
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.builders import build_components
from tandem.state_machines.base import StageError
from tests.conftest import make_config


def test_calls_failing_together_stop_the_flow_with_the_first_calls_error() -> None:
    cfg = make_config(flow={"micro_batch_size": 1})
    components = build_components(cfg)
    started: list[int] = []

    async def rollout(requests: Sequence[RolloutRequest]) -> AsyncIterator[Trajectory]:
        started.append(len(requests))
        await asyncio.sleep(0.05)  # every call is in flight when the engine goes
        raise RuntimeError("rollout actor 'rollout-0' died")
        yield  # an async generator, as engines are

    components.workflow.rollout = rollout  # type: ignore[method-assign]
    with pytest.raises(StageError) as info:
        asyncio.run(AsyncTrainingFlow(cfg, components).run())
    assert len(started) > 1  # several calls failed at once
    assert info.value.stage == "generate" and "rollout actor 'rollout-0' died" in str(info.value)
    assert "ExceptionGroup" not in str(info.value)
