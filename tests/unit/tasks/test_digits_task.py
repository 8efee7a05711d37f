"""The digits task as a plugin: a seeded, resumable stream of prompts, a fixed held-out set, its rewards and model."""

from __future__ import annotations

import itertools

import pytest

from tandem.core.task import Task
from tandem.tasks.digits import MODEL_DIR, make_task, parse_prompt
from tandem.tasks.registry import load_task


def test_it_is_an_image_task_found_by_name_with_its_options() -> None:
    task = load_task("digits", {"judge_cost_s": 0.5, "ink_weight": -0.2, "judge": "inline"})
    assert isinstance(task, Task) and task.name == "digits" and task.kind == "image" and task.model_path == MODEL_DIR
    assert (MODEL_DIR / "model_index.json").is_file()  # a generator folder the diffusion engines load
    ocr, ink = task.rewards()
    assert (ocr.name, ocr.fn, ocr.weight, ocr.runner) == ("ocr", "tandem.tasks.digits.reward:ocr", 1.0, "inline")
    assert (ink.name, ink.fn, ink.weight) == ("ink", "tandem.tasks.digits.reward:ink", -0.2)
    assert [f.name for f in make_task().rewards()] == ["ocr"]  # ink only when weighted


def test_items_are_a_seeded_stream_of_uniform_digits_resumable_at_any_position() -> None:
    task = make_task(judge_cost_s=0.25)
    first = list(itertools.islice(task.items(seed=3), 3000))
    assert first == list(itertools.islice(task.items(seed=3), 3000))
    assert first != list(itertools.islice(task.items(seed=4), 3000))
    assert list(itertools.islice(task.items(seed=3, start=1500), 1500)) == first[1500:]  # across a block boundary
    digits = [parse_prompt(item.prompt) for item in first]
    assert [item.answer for item in first] == [str(d) for d in digits]
    assert all(200 <= digits.count(d) <= 400 for d in range(10))
    assert all(item.meta == {"judge_cost_s": 0.25} for item in first)


def test_the_held_out_set_cycles_the_digits_and_is_the_same_each_time() -> None:
    task = make_task()
    held_out = task.held_out(25)
    assert [parse_prompt(item.prompt) for item in held_out] == [i % 10 for i in range(25)]
    assert held_out == task.held_out(25)


@pytest.mark.parametrize(("options", "message"), [({"judge_cost_s": -1.0}, "judge_cost_s"), ({"judge": "served"}, "judge")])
def test_bad_options_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_task(**options)
