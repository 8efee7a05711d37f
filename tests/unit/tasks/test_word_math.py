"""The word_math task: generated word problems whose reference responses the math reward scores
right, asked as chat messages, rendered by the shipped model's own template exactly as it was
pretrained on them."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest

from tandem.tasks.math_answers import boxed, math
from tandem.tasks.registry import load_task
from tandem.tasks.word_math import MAX_RESPONSE_TOKENS, MODEL_DIR, generate_problems
from tandem.tasks.word_math.problems import CHARACTERS

PROBLEMS = generate_problems(400, 5)


def test_problems_are_deterministic_per_seed() -> None:
    assert generate_problems(20, 5) == PROBLEMS[:20] and generate_problems(20, 6) != PROBLEMS[:20]


def test_answers_are_integers_fractions_and_decimals() -> None:
    answers = [p["answer"] for p in PROBLEMS]
    assert any(re.fullmatch(r"\d+", a) for a in answers)
    assert any(re.fullmatch(r"\d+/\d+", a) for a in answers)
    assert any(re.fullmatch(r"\d+\.\d+", a) for a in answers)


def test_each_reference_response_is_right_boxed_and_fits_the_budget() -> None:
    pytest.importorskip("math_verify", reason="math-verify is the math extra")
    for p in PROBLEMS:
        assert math(p["response"], p["answer"]) == 1.0 and boxed(p["response"], p["answer"]) == 1.0
        assert len(p["response"]) < MAX_RESPONSE_TOKENS
        assert set(p["question"] + p["response"]) <= set(CHARACTERS)


def test_a_fraction_answer_is_the_exact_share() -> None:
    shares = [p for p in PROBLEMS if " kids." in p["question"]]
    for p in shares:
        pies, kids = (int(n) for n in re.findall(r"\d+", p["question"]))
        assert Fraction(p["answer"]) == Fraction(pies, kids)


def test_items_are_chat_messages_and_held_out_is_the_report_set() -> None:
    task = load_task("word_math")
    item = next(iter(task.items(0)))
    assert item.messages == ({"role": "user", "content": item.prompt},) and item.answer is not None
    assert task.held_out(5) == task.held_out(5)
    assert [r.name for r in task.rewards()] == ["math", "boxed"] and task.held_out_measure.component == "math"


@pytest.mark.skipif(not (MODEL_DIR / "tokenizer.json").is_file(), reason="the shipped model is missing")
def test_the_engines_render_a_problem_as_the_model_was_pretrained_on_it() -> None:
    from tandem.engines.shared.chat import PromptEncoder
    from tandem.engines.shared.tokenizer import load_tokenizer
    from tandem.tasks.word_math.pretrain import prompt_ids

    tokenizer = load_tokenizer(MODEL_DIR)
    task = load_task("word_math")
    [item] = task.held_out(1)
    [problem] = generate_problems(1, 2_000_002)
    ids = PromptEncoder(tokenizer, MODEL_DIR)(item)
    assert ids == prompt_ids(tokenizer, problem)
    assert ids.count(tokenizer.bos_token_id) == 1 and tokenizer.unk_token_id not in ids
