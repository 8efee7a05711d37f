"""Pretrain the small model that ships with the arithmetic task, and record how good it is.

Owns the model's architecture (:func:`build_model_config`) and the recipe that produced the
shipped weights: supervised next-token training on generated problems with their reference
scratchpads, loss on the response only, seeded end to end. Training stops early, as soon as
temperature-1 sampled accuracy on a held-out check set reaches ``--target-accuracy``, so RL
starts from a model that is right only part of the time and has room to improve.

The output folder holds everything ``from_pretrained`` needs (config, safetensors weights,
tokenizer, ``generation_config.json``) plus ``pretrain_metrics.json`` and a README with the
measured accuracies and the command that produced it. The shipped model and the stronger teacher
that ``configs/distill_arithmetic.yaml`` distills into it come from the same recipe, stopped at
different accuracies::

    python -m tasks.arithmetic.pretrain --out tasks/arithmetic/model
    python -m tasks.arithmetic.pretrain --out tasks/arithmetic/teacher --threads 1 --target-accuracy 0.8
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tandem.tasks.arithmetic import MAX_RESPONSE_TOKENS, MODEL_DIR
from tandem.tasks.arithmetic.problems import (
    CHECK_SEED,
    REPORT_SEED,
    Problem,
    format_prompt,
    format_response,
    generate_problems,
    sample_operands,
)
from tandem.tasks.arithmetic.tokenizer import MODEL_MAX_LENGTH, build_tokenizer
from tandem.tasks.arithmetic.verifier import verify
from tandem.tasks.pretraining import BatchStream, Example, train_until

REPORT_PROBLEMS = 200


def build_model_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """A ~1.05 M-parameter Llama decoder sized for CPU: trains in minutes, samples fast."""
    # Llama rather than Qwen2: for a "qwen2" config, AutoTokenizer ignores the saved
    # tokenizer class and rebuilds Qwen2's byte-level tokenizer, which drops our newlines.
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=MODEL_MAX_LENGTH,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_generation_config(tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    """Defaults for ``generate``: stop at <eos>, with room for the longest reference response."""
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=MAX_RESPONSE_TOKENS,
    )


def _sample(tokenizer: PreTrainedTokenizerFast) -> Callable[[random.Random], Example]:
    """Draws one training example: a problem's prompt and its reference scratchpad, then <eos>."""

    def sample(rng: random.Random) -> Example:
        a, b = sample_operands(rng)
        prompt_ids = tokenizer(format_prompt(a, b))["input_ids"]
        response_ids = tokenizer(format_response(a, b), add_special_tokens=False)["input_ids"]
        return prompt_ids, [*response_ids, tokenizer.eos_token_id]

    return sample


@dataclass(slots=True, frozen=True)
class Accuracy:
    """How often one response per problem is correct, overall and by number of columns."""

    accuracy: float
    accuracy_by_columns: dict[int, float]
    problems_by_columns: dict[int, int]
    mean_response_tokens: float
    max_response_tokens: int


@torch.no_grad()
def evaluate(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    problems: Sequence[Problem],
    do_sample: bool,
    seed: int = 0,
    batch_size: int = 100,
) -> Accuracy:
    """Score one response per problem, greedy or sampled at temperature 1.0 (no top-k/top-p)."""
    model.eval()
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if do_sample else {"do_sample": False}
    rewards: list[float] = []
    lengths: list[int] = []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        inputs = tokenizer([p["prompt"] for p in chunk], return_tensors="pt", padding=True)
        output = model.generate(**inputs, max_new_tokens=MAX_RESPONSE_TOKENS, **sampling)
        for problem, row in zip(chunk, output[:, inputs["input_ids"].shape[1] :], strict=True):
            rewards.append(verify(tokenizer.decode(row, skip_special_tokens=True), problem["answer"]))
            lengths.append(int((row != tokenizer.pad_token_id).sum()))
    model.train()
    by_columns: dict[int, list[float]] = defaultdict(list)
    for problem, reward in zip(problems, rewards, strict=True):
        operands = problem["prompt"].removesuffix("=\n").split("+")
        by_columns[max(len(x) for x in operands)].append(reward)
    return Accuracy(
        accuracy=statistics.fmean(rewards),
        accuracy_by_columns={k: round(statistics.fmean(v), 3) for k, v in sorted(by_columns.items())},
        problems_by_columns={k: len(v) for k, v in sorted(by_columns.items())},
        mean_response_tokens=round(statistics.fmean(lengths), 1),
        max_response_tokens=max(lengths),
    )


@dataclass(slots=True, frozen=True)
class PretrainReport:
    """What a pretraining run did and how good its model is (written as pretrain_metrics.json)."""

    steps: int
    train_seconds: float
    threads: int
    parameters: int
    report_problems: int
    report_seed: int
    greedy: Accuracy
    sampled_temperature_1: Accuracy
    args: dict[str, float | int]


def pretrain(args: argparse.Namespace) -> PretrainReport:
    """Train until the check set's sampled accuracy reaches the target, save, and report."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    model = LlamaForCausalLM(build_model_config(tokenizer))
    model.generation_config = build_generation_config(tokenizer)
    check_problems = generate_problems(args.check_problems, CHECK_SEED)
    batches = BatchStream(_sample(tokenizer), tokenizer.pad_token_id, args.batch_size, random.Random(args.seed))

    def check(step: int) -> tuple[float, str]:
        result = evaluate(model, tokenizer, check_problems, do_sample=True, seed=step)
        return result.accuracy, f"sampled accuracy {result.accuracy:.3f}  by columns {result.accuracy_by_columns}"

    started = time.perf_counter()
    step = train_until(
        model, batches, check, lr=args.lr, warmup_steps=args.warmup_steps, max_steps=args.max_steps,
        eval_every=args.eval_every, target=args.target_accuracy,
    )
    train_seconds = time.perf_counter() - started

    report_problems = generate_problems(REPORT_PROBLEMS, REPORT_SEED)
    report = PretrainReport(
        steps=step,
        train_seconds=round(train_seconds, 1),
        threads=args.threads,
        parameters=model.num_parameters(),
        report_problems=REPORT_PROBLEMS,
        report_seed=REPORT_SEED,
        greedy=evaluate(model, tokenizer, report_problems, do_sample=False),
        sampled_temperature_1=evaluate(model, tokenizer, report_problems, do_sample=True, seed=args.seed),
        args={k: v for k, v in vars(args).items() if k != "out"},
    )
    _save(model, tokenizer, report, Path(args.out), _command(args))
    return report


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces a run: the script and the arguments that differ from its defaults."""
    defaults = vars(_parse_args([]))
    changed = [f"--{name.replace('_', '-')} {value}" for name, value in vars(args).items() if value != defaults[name]]
    return " ".join(["python -m tasks.arithmetic.pretrain", *changed])


def _save(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, report: PretrainReport, out: Path, command: str
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)  # model.safetensors, config.json, generation_config.json
    tokenizer.save_pretrained(out)
    (out / "pretrain_metrics.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    (out / "README.md").write_text(_readme(report, command))


def _readme(report: PretrainReport, command: str) -> str:
    """What a model folder says about itself: how it was made, and how good it is."""
    return (
        "# Arithmetic model\n\n"
        f"A small Llama decoder with a character tokenizer, pretrained by `{command}` on column-scratchpad "
        "addition (see `tasks/arithmetic/problems.py`), stopping once its sampled (temperature 1) accuracy on "
        f"{report.args['check_problems']} check problems reached {report.args['target_accuracy']} "
        f"(or after {report.args['max_steps']} steps).\n\n"
        f"- parameters: {report.parameters:,}\n"
        f"- training: {report.steps} steps, {report.train_seconds} s on {report.threads} CPU threads "
        "(wall time on a shared machine)\n"
        f"- accuracy over {report.report_problems} problems (seed {report.report_seed}): "
        f"greedy {report.greedy.accuracy:.3f}, sampled at temperature 1.0 {report.sampled_temperature_1.accuracy:.3f}\n"
        f"- greedy accuracy by number of columns: {report.greedy.accuracy_by_columns}\n"
        f"- sampled accuracy by number of columns: {report.sampled_temperature_1.accuracy_by_columns}\n"
        f"- problems by number of columns: {report.greedy.problems_by_columns}\n\n"
        "Full numbers: `pretrain_metrics.json`.\n"
    )


def _parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=MODEL_DIR, help="folder to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights and the training stream")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--max-steps", type=int, default=3000, help="hard stop if the target is never reached")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between early-stopping checks")
    parser.add_argument("--check-problems", type=int, default=128, help="size of the early-stopping check set")
    parser.add_argument(
        "--target-accuracy", type=float, default=0.25, help="stop once sampled (T=1) check accuracy reaches this"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    report = pretrain(_parse_args(argv))
    print(
        f"{report.steps} steps in {report.train_seconds} s; over {report.report_problems} problems: "
        f"greedy accuracy {report.greedy.accuracy:.3f}, "
        f"sampled (T=1) accuracy {report.sampled_temperature_1.accuracy:.3f}"
    )


if __name__ == "__main__":
    main()
