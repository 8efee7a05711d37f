"""Fine-tune the arithmetic model into the calculator task's agent, one that sometimes calls the tool.

Owns the recipe of the shipped calculator model. The arithmetic model writes the whole
scratchpad in one turn and never ends a turn on a column's ``=``, so it would never call the
calculator and RL would have nothing to reinforce. This script starts from its weights (same
tokenizer, same characters) and imitates an expert that works column by column and hands each
column to the calculator with probability ``--tool-probability``: the turn ends on the column's
``=`` (then ``<eos>``), the tool's answer ``NN\\n`` follows and the next turn carries on; otherwise
the expert writes the column's sum itself in the same turn. The last turn is the ``=answer`` line.
The loss covers the model's tokens only (each turn and its ``<eos>``); the prompt and the tool's
answers are masked, as RL masks environment tokens. The transcripts are built with the same
tokenization as the environment manager: the prompt with ``<bos>``, later pieces without.

Because the tool's sums are always right and the model's own often are not (the arithmetic
model's sampled accuracy is 0.30, 0.06 on four columns), a policy that calls the tool more
solves more: the room RL has. Training runs ``--steps`` steps and reports, over the report
problems (the first ``REPORT_PROBLEMS`` of the task's held-out seeds, sampled at temperature 1 with
``REPORT_SAMPLING_SEED``), the accuracy and the tool calls per episode. One torch thread, minutes::

    python -m tasks.calculator.pretrain --out tasks/calculator/model
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from tandem.tasks.arithmetic import MODEL_DIR as ARITHMETIC_MODEL_DIR
from tandem.tasks.arithmetic.problems import format_prompt, format_response, sample_operands
from tandem.tasks.arithmetic.tokenizer import build_tokenizer
from tandem.tasks.calculator.play import CalculatorReport, play
from tandem.tasks.calculator.task import HELD_OUT_SEEDS, MODEL_DIR

REPORT_PROBLEMS = 200
REPORT_SAMPLING_SEED = 0


@dataclass(slots=True, frozen=True)
class ExpertEpisode:
    """An expert's turns (text without ``<eos>``) and the tool's answers between them."""

    prompt: str
    turns: list[str]
    tool_answers: list[str]  # one fewer than turns: the last turn is the final answer


def expert_episode(a: int, b: int, tool_probability: float, rng: random.Random) -> ExpertEpisode:
    """The reference scratchpad of ``a + b`` cut into turns, each column called with ``tool_probability``."""
    *columns, final = format_response(a, b).splitlines()
    turns: list[str] = []
    answers: list[str] = []
    current = ""
    for line in columns:
        call, column_sum = line.split("=")
        if rng.random() < tool_probability:
            turns.append(current + call + "=")
            answers.append(column_sum + "\n")
            current = ""
        else:
            current += line + "\n"
    turns.append(current + final)
    return ExpertEpisode(format_prompt(a, b), turns, answers)


def encode_episode(tokenizer: PreTrainedTokenizerFast, episode: ExpertEpisode) -> tuple[list[int], list[int]]:
    """Ids and loss mask of an episode, built piece by piece as the environment manager builds it."""
    ids = list(tokenizer(episode.prompt)["input_ids"])
    mask = [0] * len(ids)
    for i, turn in enumerate(episode.turns):
        turn_ids = [*tokenizer(turn, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        ids += turn_ids
        mask += [1] * len(turn_ids)
        if i < len(episode.tool_answers):
            answer_ids = tokenizer(episode.tool_answers[i], add_special_tokens=False)["input_ids"]
            ids += answer_ids
            mask += [0] * len(answer_ids)
    return ids, mask


def batch(
    tokenizer: PreTrainedTokenizerFast, size: int, tool_probability: float, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``size`` expert episodes, right-padded: (input_ids, attention_mask, labels with -100 off the loss)."""
    examples = [encode_episode(tokenizer, expert_episode(*sample_operands(rng), tool_probability, rng)) for _ in range(size)]
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((size, width), tokenizer.pad_token_id)
    attention_mask = torch.zeros((size, width), dtype=torch.long)
    labels = torch.full((size, width), -100)
    for row, (ids, mask) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), -100)
    return input_ids, attention_mask, labels


@dataclass(slots=True, frozen=True)
class FineTuneReport:
    """What a fine-tuning run did and how its model plays (written as pretrain_metrics.json)."""

    steps: int
    train_seconds: float
    threads: int
    report_problems: int
    report_seeds: str
    report_sampling_seed: int
    sampled_temperature_1: CalculatorReport
    arithmetic_model_sampled: CalculatorReport  # the starting point, on the same problems
    args: dict[str, float | int | str]


def fine_tune(args: argparse.Namespace) -> FineTuneReport:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()  # the arithmetic model's: fixed ids, the same characters
    model = AutoModelForCausalLM.from_pretrained(ARITHMETIC_MODEL_DIR)
    report_seeds = list(HELD_OUT_SEEDS[:REPORT_PROBLEMS])
    before = play(model, tokenizer, report_seeds, sampling_seed=REPORT_SAMPLING_SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    rng = random.Random(args.seed)
    model.train()
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        input_ids, attention_mask, labels = batch(tokenizer, args.batch_size, args.tool_probability, rng)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.eval_every == 0:
            check = play(model, tokenizer, list(HELD_OUT_SEEDS[-128:]), sampling_seed=step)
            print(f"step {step:4d}  loss {loss.item():.4f}  sampled accuracy {check.accuracy:.3f}  "
                  f"tool calls/episode {check.tool_calls_per_episode:.2f}  {time.perf_counter() - started:.0f}s", flush=True)
    train_seconds = time.perf_counter() - started
    report = FineTuneReport(
        steps=args.steps,
        train_seconds=round(train_seconds, 1),
        threads=args.threads,
        report_problems=REPORT_PROBLEMS,
        report_seeds=f"HELD_OUT_SEEDS[:{REPORT_PROBLEMS}] = {report_seeds[0]}..{report_seeds[-1]}",
        report_sampling_seed=REPORT_SAMPLING_SEED,
        sampled_temperature_1=play(model, tokenizer, report_seeds, sampling_seed=REPORT_SAMPLING_SEED),
        arithmetic_model_sampled=before,
        args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"},
    )
    _save(model, tokenizer, report, Path(args.out))
    return report


def _save(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, report: FineTuneReport, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "pretrain_metrics.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    after, before = report.sampled_temperature_1, report.arithmetic_model_sampled
    (out / "README.md").write_text(
        "# Calculator model\n\n"
        "The arithmetic task's model (`tasks/arithmetic/model`), fine-tuned by `python -m tasks.calculator.pretrain` "
        "to call the calculator tool: it imitated an expert that hands each column to the tool with probability "
        f"{report.args['tool_probability']} (ending its turn on the column's `=`) and writes the others itself; loss on "
        "the model's turns only. The transcript format is in `tasks/calculator/environment.py`.\n\n"
        f"- training: {report.steps} steps of {report.args['batch_size']} episodes, {report.train_seconds} s on "
        f"{report.threads} CPU thread(s) (wall time on a shared machine)\n"
        f"- over {report.report_problems} held-out problems ({report.report_seeds}), sampled at temperature 1.0: "
        f"accuracy {after.accuracy:.3f} with {after.tool_calls_per_episode:.2f} tool calls per episode "
        f"({after.episodes_with_tool_calls:.2f} of episodes call it at least once); the arithmetic model it started from: "
        f"{before.accuracy:.3f}, {before.tool_calls_per_episode:.2f} tool calls per episode\n"
        f"- malformed turns per episode {after.malformed_turns_per_episode:.3f}, unanswered episodes {after.unanswered:.3f}\n\n"
        "Full numbers: `pretrain_metrics.json`.\n"
    )


def _parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=MODEL_DIR, help="folder to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="seeds the problems and the expert's tool choices")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--batch-size", type=int, default=32, help="episodes per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=25, help="steps between progress checks")
    parser.add_argument("--tool-probability", type=float, default=0.5, help="probability the expert calls the tool for a column")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    report = fine_tune(_parse_args(argv))
    after, before = report.sampled_temperature_1, report.arithmetic_model_sampled
    print(f"{report.steps} steps in {report.train_seconds} s; over {report.report_problems} held-out problems, sampled: "
          f"accuracy {after.accuracy:.3f} ({after.tool_calls_per_episode:.2f} tool calls/episode), "
          f"from {before.accuracy:.3f} ({before.tool_calls_per_episode:.2f})")


if __name__ == "__main__":
    main()
