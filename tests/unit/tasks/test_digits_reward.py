"""The digits rewards: in [0, 1], high for a real digit and low for noise, strict about their inputs; the prompt format."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tandem.tasks.digits import format_prompt, parse_prompt
from tandem.tasks.digits.data import load_split
from tandem.tasks.digits.reward import REWARDS, ink, ink_reward, ocr, ocr_reward


@pytest.fixture(scope="module")
def heldout() -> tuple[np.ndarray, np.ndarray]:
    return load_split("heldout")


def test_ocr_reward_is_a_probability_high_for_real_digits_and_low_for_noise(heldout: tuple[np.ndarray, np.ndarray]) -> None:
    images, labels = heldout
    real = ocr_reward(images[:100], labels[:100])
    noise = ocr_reward(np.random.default_rng(0).uniform(-1, 1, size=(100, 8, 8)), labels[:100])
    for scores in (real, noise):
        assert scores.shape == (100,) and np.all((scores >= 0) & (scores <= 1))
    assert real.mean() > 0.9
    assert real.mean() > noise.mean() + 0.5
    assert np.mean(real > noise) > 0.9


def test_ocr_reward_scores_the_prompted_digit_not_any_digit(heldout: tuple[np.ndarray, np.ndarray]) -> None:
    images, labels = heldout
    wrong = (labels[:100] + 1) % 10
    assert ocr_reward(images[:100], wrong).mean() < 0.1


def test_ocr_reward_accepts_channel_first_images_and_clips_out_of_range_pixels(heldout: tuple[np.ndarray, np.ndarray]) -> None:
    images, labels = heldout
    np.testing.assert_allclose(ocr_reward(images[:5, None], labels[:5]), ocr_reward(images[:5], labels[:5]))
    saturated = np.where(images[:5] > 0, 50.0, -50.0)
    np.testing.assert_allclose(ocr_reward(saturated, labels[:5]), ocr_reward(np.sign(saturated), labels[:5]))


def test_ink_reward_measures_the_inked_share_of_the_canvas() -> None:
    blank, full = -np.ones((1, 8, 8)), np.ones((1, 8, 8))
    half = np.concatenate([-np.ones((1, 4, 8)), np.ones((1, 4, 8))], axis=1)
    np.testing.assert_allclose(ink_reward(np.concatenate([blank, half, full]), [0, 0, 0]), [0.0, 0.5, 1.0])


@pytest.mark.parametrize("reward", sorted(REWARDS))
def test_rewards_refuse_mismatched_inputs(reward: str) -> None:
    fn = REWARDS[reward]
    with pytest.raises(ValueError, match="one digit per image"):
        fn(np.zeros((2, 8, 8)), [1])
    with pytest.raises(ValueError, match="images must be"):
        fn(np.zeros((2, 16, 16)), [1, 2])
    with pytest.raises(ValueError, match="digits must be"):
        fn(np.zeros((1, 8, 8)), [10])


def test_prompts_round_trip_and_other_text_is_refused() -> None:
    assert [parse_prompt(format_prompt(d)) for d in range(10)] == list(range(10))
    assert format_prompt(3) == "draw the digit 3"
    for text in ("draw the digit 10", "draw a cat", "draw the digit"):
        with pytest.raises(ValueError):
            parse_prompt(text)
    with pytest.raises(ValueError):
        format_prompt(10)


def test_the_task_package_imports_without_torch() -> None:
    code = "import sys, tasks.digits; assert 'torch' not in sys.modules and 'sklearn' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[3])


def test_the_numpy_judge_is_the_torch_classifier(heldout: tuple[np.ndarray, np.ndarray]) -> None:
    # The reward computes the shipped classifier's forward in numpy (so reward workers need no torch).
    import torch

    from tandem.tasks.digits.models import load_classifier

    images, labels = heldout
    noise = np.random.default_rng(1).uniform(-1, 1, size=(50, 8, 8)).astype(np.float32)
    for batch, digits in ((images[:200], labels[:200]), (noise, labels[:50])):
        with torch.no_grad():
            probs = torch.softmax(load_classifier()(torch.from_numpy(batch)[:, None]).double(), dim=-1).numpy()
        np.testing.assert_allclose(ocr_reward(batch, digits), probs[np.arange(len(digits)), digits], atol=1e-5)


def test_per_sample_forms_score_one_image_against_the_answer_text(heldout: tuple[np.ndarray, np.ndarray]) -> None:
    images, labels = heldout
    assert ocr(images[0][None], str(labels[0])) == pytest.approx(float(ocr_reward(images[:1], labels[:1])[0]))
    assert ink(images[0], "0") == pytest.approx(float(ink_reward(images[:1], [0])[0]))
    for answer in (None, "seven", "12"):
        with pytest.raises(ValueError):
            ocr(images[0], answer)


def test_the_reward_module_imports_without_torch() -> None:
    code = "import sys, tasks.digits.reward; assert 'torch' not in sys.modules and 'diffusers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[3])
