"""Pretrain what ships with the digits task, the classifier (reward) and the generator (policy), and record how good they are.

Owns the recipe that produced ``tasks/digits/model``, seeded end to end, on one torch thread:

1. the digit classifier, cross-entropy on the ``train`` split; its accuracy on ``heldout`` is
   reported;
2. the generator, with the rectified-flow loss of SD3 (Esser et al. 2024, "Scaling Rectified
   Flow Transformers for High-Resolution Image Synthesis"): ``x_t = (1 - t) x_0 + t ε`` with
   ``t`` logit-normal, regress the velocity ``ε - x_0``; the prompt is dropped to the empty
   one with probability ``--label-dropout`` so classifier-free guidance works.

Training stops early, at the first check where the classifier recognises the prompted digit
(argmax = digit) in at least ``--target-recognition`` of the samples drawn at the task's
settings (``--sample-steps`` Euler ODE steps with guidance ``--guidance-scale``) on a check
set of noise seeds, so RL starts from a generator that is right part of the time. The rate
is then measured again on a separate report set of seeds (what the tests recompute).

The output folder holds the ``save_pretrained`` folders ``transformer/``, ``scheduler/`` and
``prompt_encoder/``, the classifier (``classifier/config.json`` and ``model.safetensors``),
``pretrain_metrics.json`` and a README. Run::

    python -m tasks.digits.pretrain --out tasks/digits/model
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tandem.tasks.digits import MODEL_DIR, NUM_DIGITS, UNCONDITIONAL_INDEX
from tandem.tasks.digits.data import HELDOUT_FRACTION, SPLIT_SEED, load_split
from tandem.tasks.digits.models import (
    ClassifierConfig,
    DigitClassifier,
    DigitGenerator,
    DigitPromptEncoder,
    build_scheduler,
    build_transformer,
    save_classifier,
)
from tandem.tasks.digits.sampling import sample_images

# Noise-seed ranges of the check set (the stop rule) and the report set (the recorded rate),
# kept apart so the recorded rate is not the one the stop rule selected on.
CHECK_SEED, REPORT_SEED = 1_000_000, 2_000_000


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_classifier(args: argparse.Namespace) -> tuple[DigitClassifier, float]:
    """The classifier after ``--classifier-epochs`` of AdamW on ``train``, and its held-out accuracy."""
    _seed_everything(args.seed)
    images, labels = (torch.from_numpy(a) for a in load_split("train"))
    images = images[:, None]
    classifier = DigitClassifier(ClassifierConfig())
    optimizer = torch.optim.AdamW(classifier.parameters(), lr=args.classifier_lr, weight_decay=1e-2)
    for _ in range(args.classifier_epochs):
        for batch in torch.randperm(len(labels)).split(args.batch_size):
            loss = F.cross_entropy(classifier(images[batch]), labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    classifier.eval()
    heldout_images, heldout_labels = load_split("heldout")
    with torch.no_grad():
        predictions = classifier(torch.from_numpy(heldout_images)[:, None]).argmax(-1).numpy()
    return classifier, float((predictions == heldout_labels).mean())


@dataclass(frozen=True, slots=True)
class Recognition:
    """How often the classifier sees the prompted digit in generated samples, and its mean probability (the reward)."""

    recognition_rate: float
    mean_reward: float
    rate_by_digit: dict[int, float]
    samples: int


def evaluation_set(first_seed: int, per_digit: int) -> tuple[list[int], list[int]]:
    """``(digits, seeds)``: each digit ``per_digit`` times, image ``i`` with noise seed ``first_seed + i``."""
    digits = [d for d in range(NUM_DIGITS) for _ in range(per_digit)]
    return digits, [first_seed + i for i in range(len(digits))]


@torch.no_grad()
def measure_recognition(
    generator: DigitGenerator,
    classifier: DigitClassifier,
    first_seed: int,
    per_digit: int,
    num_steps: int,
    guidance_scale: float,
) -> Recognition:
    """Sample the evaluation set at the given settings (Euler ODE) and score it with the classifier."""
    digits, seeds = evaluation_set(first_seed, per_digit)
    images = sample_images(generator, digits, seeds, num_steps, guidance_scale).clamp(-1.0, 1.0)
    probs = torch.softmax(classifier(images), dim=-1)
    target = torch.tensor(digits)
    hits = (probs.argmax(-1) == target).float()
    return Recognition(
        recognition_rate=round(hits.mean().item(), 4),
        mean_reward=round(probs[torch.arange(len(digits)), target].mean().item(), 4),
        rate_by_digit={d: round(hits[target == d].mean().item(), 3) for d in range(NUM_DIGITS)},
        samples=len(digits),
    )


def train_generator(
    args: argparse.Namespace, classifier: DigitClassifier
) -> tuple[DigitGenerator, int, list[dict[str, float]]]:
    """Rectified-flow training until the check set's recognition rate reaches the target; the generator, steps, history."""
    _seed_everything(args.seed)
    generator = DigitGenerator(build_transformer(), DigitPromptEncoder(), build_scheduler())
    images, labels = (torch.from_numpy(a) for a in load_split("train"))
    images = images[:, None]
    params = [*generator.transformer.parameters(), *generator.prompt_encoder.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    history: list[dict[str, float]] = []
    step, losses = 0, []
    while step < args.max_steps:
        step += 1
        generator.transformer.train()
        batch = torch.randint(len(labels), (args.batch_size,))
        x0 = images[batch]
        noise = torch.randn_like(x0)
        t = torch.sigmoid(torch.randn(args.batch_size))  # SD3's logit-normal(0, 1) time density
        xt = (1.0 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
        prompts = torch.where(torch.rand(args.batch_size) < args.label_dropout, UNCONDITIONAL_INDEX, labels[batch])
        tokens, pooled = generator.prompt_encoder(prompts)
        velocity = generator.transformer(
            hidden_states=xt, encoder_hidden_states=tokens, pooled_projections=pooled, timestep=t * 1000
        ).sample
        loss = F.mse_loss(velocity, noise - x0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % args.check_every == 0:
            generator.transformer.eval()
            check = measure_recognition(
                generator, classifier, CHECK_SEED, args.check_per_digit, args.sample_steps, args.guidance_scale
            )
            history.append(
                {"step": step, "loss": round(float(np.mean(losses)), 4), "check_recognition_rate": check.recognition_rate}
            )
            print(f"step {step}: loss {np.mean(losses):.4f} check recognition {check.recognition_rate:.3f}", flush=True)
            losses = []
            if check.recognition_rate >= args.target_recognition:
                break
    generator.transformer.eval()
    return generator, step, history


def _write_readme(out: Path, metrics: dict) -> None:
    report, generator = metrics["report"], metrics["generator"]
    settings = metrics["sampling"]
    lines = [
        "# Digits model",
        "",
        "What the digits task ships, produced by `python -m tasks.digits.pretrain` on scikit-learn's 8×8 digits "
        "(train split only): a class-conditional flow-matching generator (diffusers `SD3Transformer2DModel`, "
        "`transformer/`; `FlowMatchEulerDiscreteScheduler`, `scheduler/`; a learned prompt table, `prompt_encoder/`; "
        "`model_index.json` naming them in diffusers' pipeline layout, which the diffusion engines load) "
        "stopped early so RL has room to improve it, and the digit classifier that is the task's reward "
        "(`classifier/`).",
        "",
        f"- classifier: held-out accuracy {metrics['classifier']['heldout_accuracy']:.3f} "
        f"on {metrics['classifier']['heldout_images']} images",
        f"- generator: {generator['parameters']:,} parameters (+ {generator['prompt_encoder_parameters']:,} "
        f"in the prompt encoder), {generator['steps']} steps",
        f"- sampling settings: {settings['num_steps']} steps, guidance scale {settings['guidance_scale']}, "
        "Euler ODE sampler, images in [-1, 1]",
        f"- recognition rate (classifier argmax = prompted digit) on {report['samples']} report samples "
        f"(noise seeds {metrics['report_set']['first_seed']} on, never seen by the stop rule): "
        f"{report['recognition_rate']:.3f}, mean reward (probability of the prompted digit) {report['mean_reward']:.3f}",
        f"- wall time: {metrics['seconds']['total']:.0f} s on {metrics['threads']} torch thread",
        "",
        "Full numbers: `pretrain_metrics.json`.",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=MODEL_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--classifier-epochs", type=int, default=30)
    parser.add_argument("--classifier-lr", type=float, default=3e-3)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--label-dropout", type=float, default=0.1)
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--check-every", type=int, default=10)
    parser.add_argument("--check-per-digit", type=int, default=20)
    parser.add_argument("--report-per-digit", type=int, default=20)
    parser.add_argument("--sample-steps", type=int, default=10)
    parser.add_argument("--guidance-scale", type=float, default=1.5)
    parser.add_argument("--target-recognition", type=float, default=0.4)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    started = time.perf_counter()
    classifier, heldout_accuracy = train_classifier(args)
    classifier_seconds = time.perf_counter() - started
    print(f"classifier held-out accuracy {heldout_accuracy:.4f} ({classifier_seconds:.1f} s)", flush=True)
    generator, steps, history = train_generator(args, classifier)
    generator_seconds = time.perf_counter() - started - classifier_seconds

    report = {"first_seed": REPORT_SEED, "per_digit": args.report_per_digit}
    settings = {"num_steps": args.sample_steps, "guidance_scale": args.guidance_scale, "sampler": "euler_ode"}
    recognition = measure_recognition(
        generator, classifier, REPORT_SEED, args.report_per_digit, args.sample_steps, args.guidance_scale
    )
    print(f"report recognition rate {recognition.recognition_rate:.3f}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    generator.save(args.out)
    save_classifier(classifier, args.out / "classifier")
    metrics = {
        "classifier": {
            "heldout_accuracy": round(heldout_accuracy, 4),
            "heldout_images": len(load_split("heldout")[1]),
            "split": {"heldout_fraction": HELDOUT_FRACTION, "split_seed": SPLIT_SEED},
            "parameters": sum(p.numel() for p in classifier.parameters()),
        },
        "generator": {
            "parameters": sum(p.numel() for p in generator.transformer.parameters()),
            "prompt_encoder_parameters": sum(p.numel() for p in generator.prompt_encoder.parameters()),
            "steps": steps,
            "stopped_early": steps < args.max_steps,
            "history": history,
        },
        "sampling": settings,
        "report_set": report,
        "report": asdict(recognition),
        "check_set": {"first_seed": CHECK_SEED, "per_digit": args.check_per_digit},
        "seconds": {
            "classifier": round(classifier_seconds, 1),
            "generator": round(generator_seconds, 1),
            "total": round(time.perf_counter() - started, 1),
        },
        "threads": args.threads,
        "seed": args.seed,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    (args.out / "pretrain_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    _write_readme(args.out, metrics)
    print(f"wrote {args.out} in {metrics['seconds']['total']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
