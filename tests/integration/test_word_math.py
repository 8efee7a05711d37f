"""The word_math job end to end on its shipped chat model: chat prompts rendered by the model's
template, the math and boxed rewards in the reward pool, held-out exact answers reported by name.
(How much it learns is measured by ``tandem run word_math``, not here: a few steps show no trend.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tandem.core.config import load_config
from tandem.engines.shared.tokenizer import load_tokenizer
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.builders import build_components
from tandem.tasks.word_math import MODEL_DIR
from tests.integration.test_torch_flow import Recording

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL_DIR / "tokenizer.json").is_file(), reason="the shipped model is missing"),
]


def test_the_word_math_job_trains_on_chat_prompts_and_reports_exact_answers(tmp_path: Path) -> None:
    pytest.importorskip("math_verify", reason="math-verify is the math extra")
    cfg = load_config("word_math", [
        "run.max_steps=4", f"run.output_dir={tmp_path}", "run.name=short", "observability.metrics_port=null",
        "validation.every_versions=4", "validation.prompts=16", "train.prompts_per_step=4",
    ])
    components = build_components(cfg)
    recorder = Recording(components.trainer)
    try:
        result = asyncio.run(AsyncTrainingFlow(cfg, components).run())
    finally:
        components.close()
    assert result.total_steps == 4 and result.ledger["balanced"]
    tokenizer = load_tokenizer(MODEL_DIR)
    for t in (t for batch in recorder.batches for t in batch):
        text = tokenizer.decode(t.payload.prompt_ids, skip_special_tokens=False)
        assert text.startswith("<bos><|im_start|>user\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert set(t.rewards) == {"math", "boxed"}
    assert [v.measure for v in result.validations][:1] == ["exact_answer"]
    summary = json.loads((tmp_path / "short" / "summary.json").read_text())
    assert "exact_answer" in summary["validation"][0]
