"""Pretrain the small chat model that ships with the word_math task, and record how good it is.

Owns the model (a ~0.45 M-parameter Llama decoder), its character tokenizer
(``tasks.char_tokenizer``, with ChatML markers as special tokens) and its chat template, and the
recipe that produced the shipped weights: the shared loop of ``tasks.pretraining`` on generated
problems rendered through that template, loss on the reference response only, stopped as soon as
temperature-1 sampled accuracy on a check set reaches ``--target-accuracy`` so RL has room to
improve it. The output folder holds what ``from_pretrained`` needs plus ``pretrain_metrics.json``.
Run::

    python -m tandem.tasks.word_math.pretrain --out tasks/word_math/model
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tandem.tasks.char_tokenizer import char_tokenizer
from tandem.tasks.math_answers import math
from tandem.tasks.pretraining import BatchStream, Example, train_until
from tandem.tasks.word_math.problems import (
    CHARACTERS,
    CHECK_SEED,
    REPORT_SEED,
    Problem,
    generate_problems,
    messages,
    sample_problem,
)
from tandem.tasks.word_math.task import MAX_RESPONSE_TOKENS, MODEL_DIR

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# ChatML, with the <bos> the model was trained after written by the template itself.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MODEL_MAX_LENGTH = 256  # a rendered prompt (under 100 characters) plus a response, with room for a system prompt
REPORT_PROBLEMS = 200


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The task's character tokenizer; its end of turn (``<|im_end|>``) is the model's stop token."""
    return char_tokenizer(
        CHARACTERS, eos=IM_END, extra_special=(IM_START,), model_max_length=MODEL_MAX_LENGTH, chat_template=CHAT_TEMPLATE
    )


def build_model_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=96, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=MODEL_MAX_LENGTH, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def prompt_ids(tokenizer: PreTrainedTokenizerFast, problem: Problem) -> list[int]:
    """The problem's chat through the template, as the engines render it (``engines.shared.chat``)."""
    return list(tokenizer.apply_chat_template(list(messages(problem)), add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def _sample(tokenizer: PreTrainedTokenizerFast) -> Callable[[random.Random], Example]:
    def sample(rng: random.Random) -> Example:
        problem = sample_problem(rng)
        response = tokenizer(problem["response"], add_special_tokens=False)["input_ids"]
        return prompt_ids(tokenizer, problem), [*response, tokenizer.eos_token_id]

    return sample


@torch.no_grad()
def evaluate(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: Sequence[Problem], do_sample: bool, seed: int = 0
) -> float:
    """The share of problems whose one response (greedy, or sampled at temperature 1) ``math`` scores right."""
    model.eval()
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if do_sample else {"do_sample": False}
    inputs = tokenizer.pad({"input_ids": [prompt_ids(tokenizer, p) for p in problems]}, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=MAX_RESPONSE_TOKENS, **sampling)
    responses = [tokenizer.decode(row, skip_special_tokens=True) for row in output[:, inputs["input_ids"].shape[1] :]]
    model.train()
    return statistics.fmean(math(r, p["answer"]) for r, p in zip(responses, problems, strict=True))


def pretrain(args: argparse.Namespace) -> dict[str, float | int]:
    """Train until the check set's sampled accuracy reaches the target, save, and report."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    model = LlamaForCausalLM(build_model_config(tokenizer))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=MAX_RESPONSE_TOKENS,
    )
    check_problems = generate_problems(args.check_problems, CHECK_SEED)
    batches = BatchStream(_sample(tokenizer), tokenizer.pad_token_id, args.batch_size, random.Random(args.seed))

    def check(step: int) -> tuple[float, str]:
        accuracy = evaluate(model, tokenizer, check_problems, do_sample=True, seed=step)
        return accuracy, f"sampled accuracy {accuracy:.3f}"

    started = time.perf_counter()
    steps = train_until(model, batches, check, lr=args.lr, warmup_steps=args.warmup_steps, max_steps=args.max_steps,
                        eval_every=args.eval_every, target=args.target_accuracy)
    report_problems = generate_problems(REPORT_PROBLEMS, REPORT_SEED)
    report = {
        "steps": steps, "train_seconds": round(time.perf_counter() - started, 1), "threads": args.threads,
        "parameters": model.num_parameters(), "report_problems": REPORT_PROBLEMS, "report_seed": REPORT_SEED,
        "greedy_accuracy": evaluate(model, tokenizer, report_problems, do_sample=False),
        "sampled_accuracy_temperature_1": evaluate(model, tokenizer, report_problems, do_sample=True, seed=args.seed),
        **{k: v for k, v in vars(args).items() if k != "out"},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)  # the chat template with it
    (out / "pretrain_metrics.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=MODEL_DIR, help="folder to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights and the training stream")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--max-steps", type=int, default=3000, help="hard stop if the target is never reached")
    parser.add_argument("--eval-every", type=int, default=25, help="steps between early-stopping checks")
    parser.add_argument("--check-problems", type=int, default=64, help="size of the early-stopping check set")
    parser.add_argument("--target-accuracy", type=float, default=0.3, help="stop once sampled (T=1) check accuracy reaches this")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    report = pretrain(_parse_args(argv))
    print(f"{report['steps']} steps in {report['train_seconds']} s; over {report['report_problems']} problems: greedy accuracy "
          f"{report['greedy_accuracy']:.3f}, sampled (T=1) accuracy {report['sampled_accuracy_temperature_1']:.3f}")


if __name__ == "__main__":
    main()
