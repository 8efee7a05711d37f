"""The generate role's failures: concurrent engine calls that fail together surface as one
error naming the cause, not as a group of them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from engines.fake import build_fake_components
from core.protocols import GenerationRequest
from pipeline import AsyncTrainingFlow
from core.records import Sample
from state_machines.base import StageError
from tests.conftest import make_config


def test_calls_failing_together_stop_the_flow_with_the_first_calls_error() -> None:
    cfg = make_config(flow={"micro_batch_size": 1})
    components = build_fake_components(cfg)
    started: list[int] = []

    async def generate(requests: Sequence[GenerationRequest]) -> AsyncIterator[Sample]:
        started.append(len(requests))
        await asyncio.sleep(0.05)  # every call is in flight when the engine goes
        raise RuntimeError("rollout actor 'rollout-0' died")
        yield  # an async generator, as engines are

    components.rollout.generate = generate  # type: ignore[method-assign]
    with pytest.raises(StageError) as info:
        asyncio.run(AsyncTrainingFlow(cfg, components).run())
    assert len(started) > 1  # several calls failed at once
    assert info.value.stage == "generate" and "rollout actor 'rollout-0' died" in str(info.value)
    assert "ExceptionGroup" not in str(info.value)
