"""Pretrain the small model that ships with the arithmetic task, and record how good it is.

Owns the model's architecture (:func:`build_model_config`) and the recipe that produced the
shipped weights: supervised next-token training on generated problems with their reference
scratchpads, loss on the response only, seeded end to end. Training stops early, as soon as
temperature-1 sampled accuracy on a held-out check set reaches ``--target-accuracy``, so RL
starts from a model that is right only part of the time and has room to improve.

The output folder holds everything ``from_pretrained`` needs (config, safetensors weights,
tokenizer, ``generation_config.json``) plus ``pretrain_metrics.json`` and a README with the
measured accuracies. Run::

    python -m tasks.arithmetic.pretrain --out tasks/arithmetic/model
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
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


class _BatchStream:
    """An endless, seeded stream of (input_ids, attention_mask, labels) training batches.

    Sorting a pool of several batches by length before cutting it keeps the rare long
    problems together, so short sequences are not padded to the long tail's length.
    """

    POOL_BATCHES = 8

    def __init__(self, tokenizer: PreTrainedTokenizerFast, batch_size: int, rng: random.Random) -> None:
        self._tokenizer = tokenizer
        self._batch_size = batch_size
        self._rng = rng
        self._ready: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __iter__(self) -> _BatchStream:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self._ready:
            self._refill()
        return self._ready.pop()

    def _refill(self) -> None:
        examples: list[tuple[list[int], list[int]]] = []
        for _ in range(self._batch_size * self.POOL_BATCHES):
            a, b = sample_operands(self._rng)
            prompt_ids = self._tokenizer(format_prompt(a, b))["input_ids"]
            response_ids = self._tokenizer(format_response(a, b), add_special_tokens=False)["input_ids"]
            examples.append((prompt_ids, [*response_ids, self._tokenizer.eos_token_id]))
        examples.sort(key=lambda e: len(e[0]) + len(e[1]))
        batches = [
            self._collate(examples[i : i + self._batch_size])
            for i in range(0, len(examples), self._batch_size)
        ]
        self._rng.shuffle(batches)
        self._ready = batches

    def _collate(
        self, examples: Sequence[tuple[list[int], list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        width = max(len(p) + len(r) for p, r in examples)
        input_ids = torch.full((len(examples), width), self._tokenizer.pad_token_id)
        attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
        # -100 is ignored by the loss: the model is graded on the response (and <eos>) only,
        # since the operands in the prompt are random and cannot be predicted.
        labels = torch.full((len(examples), width), -100)
        for row, (prompt_ids, response_ids) in enumerate(examples):
            ids = prompt_ids + response_ids
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
            labels[row, len(prompt_ids) : len(ids)] = torch.tensor(response_ids)
        return input_ids, attention_mask, labels


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
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    # Linear warm-up, then constant: where training stops is decided by accuracy, not a schedule.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup_steps))
    check_problems = generate_problems(args.check_problems, CHECK_SEED)
    batches = _BatchStream(tokenizer, args.batch_size, random.Random(args.seed))

    started = time.perf_counter()
    check_accuracy = 0.0
    step = 0
    while step < args.max_steps and check_accuracy < args.target_accuracy:
        input_ids, attention_mask, labels = next(batches)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % args.eval_every == 0:
            check = evaluate(model, tokenizer, check_problems, do_sample=True, seed=step)
            check_accuracy = check.accuracy
            print(
                f"step {step:5d}  loss {loss.item():.4f}  sampled accuracy {check.accuracy:.3f}  "
                f"by columns {check.accuracy_by_columns}  {time.perf_counter() - started:.0f}s",
                flush=True,
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
    _save(model, tokenizer, report, Path(args.out))
    return report


def _save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, report: PretrainReport, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)  # model.safetensors, config.json, generation_config.json
    tokenizer.save_pretrained(out)
    (out / "pretrain_metrics.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    (out / "README.md").write_text(
        "# Arithmetic model\n\n"
        "A small Llama decoder with a character tokenizer, pretrained by "
        "`python -m tasks.arithmetic.pretrain` on column-scratchpad addition "
        "(see `tasks/arithmetic/problems.py`) and stopped early so RL has room to improve it.\n\n"
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
