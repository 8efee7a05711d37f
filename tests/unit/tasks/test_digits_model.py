"""The shipped digits models: load the ordinary way, are small, and are as good as their recorded metrics say."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

from tandem.tasks.digits import (
    CLASSIFIER_DIR,
    MODEL_DIR,
    PRETRAIN_METRICS_PATH,
    PROMPT_ENCODER_DIR,
    SCHEDULER_DIR,
    TRANSFORMER_DIR,
    UNCONDITIONAL_INDEX,
)
from tandem.tasks.digits.data import load_split
from tandem.tasks.digits.models import DigitClassifier, DigitGenerator, load_classifier, load_generator
from tandem.tasks.digits.pretrain import REPORT_SEED, measure_recognition
from tandem.tasks.digits.sampling import sample_images


@pytest.fixture(scope="module")
def metrics() -> dict:
    return json.loads(PRETRAIN_METRICS_PATH.read_text())


@pytest.fixture(scope="module")
def generator() -> DigitGenerator:
    return load_generator()


@pytest.fixture(scope="module")
def classifier() -> DigitClassifier:
    return load_classifier()


def test_ships_loadable_folders_of_a_few_megabytes() -> None:
    assert (TRANSFORMER_DIR / "config.json").is_file()
    assert (SCHEDULER_DIR / "scheduler_config.json").is_file()
    assert (PROMPT_ENCODER_DIR / "config.json").is_file()
    assert (CLASSIFIER_DIR / "config.json").is_file() and (CLASSIFIER_DIR / "model.safetensors").is_file()
    assert (MODEL_DIR / "README.md").is_file()
    total = sum(f.stat().st_size for f in MODEL_DIR.rglob("*") if f.is_file())
    assert total < 5 * 2**20


def test_generator_is_a_diffusers_sd3_transformer_of_about_a_million_parameters(generator: DigitGenerator) -> None:
    assert isinstance(generator.transformer, SD3Transformer2DModel)
    assert isinstance(generator.scheduler, FlowMatchEulerDiscreteScheduler)
    assert 500_000 <= sum(p.numel() for p in generator.transformer.parameters()) <= 2_000_000
    # Loadable by the diffusers class alone, as an engine that knows nothing of this task would.
    assert isinstance(SD3Transformer2DModel.from_pretrained(TRANSFORMER_DIR, low_cpu_mem_usage=False), SD3Transformer2DModel)


def test_prompt_encoder_gives_sd3_shaped_conditioning_with_an_unconditional_row(generator: DigitGenerator) -> None:
    tokens, pooled = generator.prompt_encoder(torch.tensor([3, UNCONDITIONAL_INDEX]))
    config = generator.transformer.config
    assert tokens.shape == (2, generator.prompt_encoder.config.sequence_length, config.joint_attention_dim)
    assert pooled.shape == (2, config.pooled_projection_dim)
    assert not torch.equal(tokens[0], tokens[1])


def test_classifier_heldout_accuracy_is_as_recorded_and_high(classifier: DigitClassifier, metrics: dict) -> None:
    images, labels = load_split("heldout")
    with torch.no_grad():
        predictions = classifier(torch.from_numpy(images)[:, None]).argmax(-1).numpy()
    accuracy = float((predictions == labels).mean())
    assert accuracy == pytest.approx(metrics["classifier"]["heldout_accuracy"], abs=1e-3)
    assert accuracy > 0.9


def test_sampling_is_deterministic_per_seed_and_independent_of_the_batch(generator: DigitGenerator) -> None:
    pair = sample_images(generator, [3, 7], [11, 12], num_steps=4, guidance_scale=1.5)
    alone = sample_images(generator, [7], [12], num_steps=4, guidance_scale=1.5)
    torch.testing.assert_close(pair[1:], alone, rtol=1e-5, atol=1e-5)
    assert pair.shape == (2, 1, 8, 8) and not torch.allclose(pair[:1], pair[1:])


def test_recognition_rate_at_the_recorded_settings_leaves_room_for_rl(
    generator: DigitGenerator, classifier: DigitClassifier, metrics: dict
) -> None:
    # The recorded report set (200 prompts and noise seeds never used by the stop rule), Euler ODE sampler.
    settings, report = metrics["sampling"], metrics["report_set"]
    assert report["first_seed"] == REPORT_SEED
    recognition = measure_recognition(
        generator, classifier, report["first_seed"], report["per_digit"], settings["num_steps"], settings["guidance_scale"]
    )
    assert 0.3 <= recognition.recognition_rate <= 0.6
    assert recognition.recognition_rate == pytest.approx(metrics["report"]["recognition_rate"], abs=0.03)
