"""The shipped checkpoint's tokenizer loads exactly as trained: every character survives."""

from __future__ import annotations

import pytest

from tandem.engines.shared.tokenizer import load_tokenizer
from tandem.tasks.arithmetic import MODEL_DIR, format_prompt
from tandem.tasks.arithmetic.tokenizer import build_tokenizer

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "tokenizer.json").is_file(), reason="the shipped model is missing")


def test_loaded_tokenizer_encodes_like_the_one_the_model_was_trained_with() -> None:
    text = format_prompt(4589, 123) + "9+3+0=12\n=4712"
    assert load_tokenizer(MODEL_DIR)(text)["input_ids"] == build_tokenizer()(text)["input_ids"]

