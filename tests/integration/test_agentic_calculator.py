"""The calculator job (tool use, CPU): the shipped model calls the one-column calculator and only
its own turns are trained."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tandem.core.config import load_config
from tandem.engines.shared.tokenizer import load_tokenizer
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.builders import build_components
from tandem.tasks.calculator import MODEL_DIR, TOOL_ERROR, parse_turn
from tests.integration.test_torch_flow import Recording

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="the shipped calculator model is missing"),
]


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The maximal runs of masked-out tokens, in order."""
    runs: list[list[int]] = []
    for i, (token, trained) in enumerate(zip(ids, mask, strict=True)):
        if not trained:
            if i == 0 or mask[i - 1]:
                runs.append([])
            runs[-1].append(token)
    return runs


def test_the_calculator_job_calls_the_tool_and_trains_only_the_models_turns(tmp_path: Any) -> None:
    cfg = load_config("configs/agentic_calculator.yaml", [
        "run.max_steps=2", "train.prompts_per_step=4", "rollout.samples_per_prompt=4", f"run.output_dir={tmp_path}",
        "engines.generation_threads=1", "engines.train_threads=1",
        "validation.every_versions=null", "observability.metrics_port=null", "observability.trace=false",
    ])
    components = build_components(cfg)
    recorder = Recording(components.trainer)
    try:
        result = asyncio.run(AsyncTrainingFlow(cfg, components).run())
    finally:
        components.close()
    assert result.ledger["balanced"] and result.ledger["trained"] == 8
    tokenizer = load_tokenizer(str(MODEL_DIR))
    # The model's vocabulary has no "?": it reads the tool's error answer as <unk> and a newline.
    error_answer = tokenizer.decode(tokenizer(TOOL_ERROR, add_special_tokens=False)["input_ids"])
    episodes = [t for batch in recorder.batches for t in batch]
    with_tool = [e for e in episodes if len(e.payload.actions) > 1]
    assert with_tool, "no episode called the calculator"
    for episode in with_tool:
        payload = episode.payload
        kinds = [parse_turn(action)[0] for action in payload.actions]
        assert set(kinds[:-1]) <= {"tool_call", "malformed"}, payload.actions  # only a final answer ends it
        # What is masked out is exactly the tool's answers, one per turn that went on: "NN\n" or the error.
        answers = [tokenizer.decode(run) for run in masked_runs(payload.response_ids, episode.loss_mask)]
        assert len(answers) == len(payload.actions) - 1
        for kind, answer in zip(kinds, answers, strict=False):
            tool_answer = len(answer) == 3 and answer[:2].isdigit() and answer.endswith("\n")
            assert answer == error_answer if kind == "malformed" else tool_answer, answer
    assert result.steps[-1].rollout_metrics["env_tool_calls"] > 0
