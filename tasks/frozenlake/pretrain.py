"""Pretrain the small model that ships with the FrozenLake task, and record how good it is.

Owns the model's architecture (:func:`build_model_config`) and the recipe that produced the shipped
weights: imitation of a *noisy* expert. Each training episode is played on a fresh map by the BFS
expert (:func:`tasks.frozenlake.maps.expert_action`), which with probability ``epsilon`` takes a
uniformly random action instead, so the episodes visit off-path states, detours and holes, not only
the six tiles of a perfect run. The whole multi-turn transcript is the input; the loss covers the
model's tokens only (actions and their ``<eot>``; see :mod:`tasks.frozenlake.transcript`), and of
those only the expert's own turns: the random turns stay in the transcript as context but are
masked, as environment tokens are. (Trained on, uniform noise only slows learning: measured here,
a model fitting the random turns too sat at its blind prior, mostly "down", for over 200 steps;
with them masked it starts reading the lake after about 85.) Training stops early, as soon as
temperature-1 success on a check set of maps reaches ``--target-success``: RL starts from a model
that succeeds only part of the time.

Maps: training episodes use ``TRAIN_SEEDS`` in order, skipping any map whose layout is one of the
check or report maps (a 4×4 lake has few layouts, and different seeds repeat them), so the reported
success is on maps never trained on. The check set (early stopping) is seeds 2,000,000 onwards; the
report set is the first ``REPORT_MAPS`` of ``HELD_OUT_SEEDS``, played with sampling seed
``REPORT_SAMPLING_SEED``, which the tests replay.

The output folder holds everything ``from_pretrained`` needs (config, safetensors weights,
tokenizer, ``generation_config.json``) plus ``pretrain_metrics.json`` and a README. One torch
thread, a few minutes. Run::

    python -m tasks.frozenlake.pretrain --out tasks/frozenlake/model
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tandem.tasks.frozenlake import MODEL_DIR
from tandem.tasks.frozenlake.environment import FrozenLakeEnvironment
from tandem.tasks.frozenlake.maps import ACTIONS, HELD_OUT_SEEDS, TRAIN_SEEDS, LakeMap, expert_action, generate_map
from tandem.tasks.frozenlake.play import PlayReport, play, summarize
from tandem.tasks.frozenlake.tokenizer import EOT, MODEL_MAX_LENGTH, build_tokenizer
from tandem.tasks.frozenlake.transcript import TURN_TOKENS, encode_episode

CHECK_SEEDS = range(2_000_000, 2_000_128)
REPORT_MAPS = 200
REPORT_SAMPLING_SEED = 0
# Where the shipped model's temperature-1 success must lie: low enough that RL has room, high
# enough that a group of samples sees successes to learn from.
SUCCESS_BAND = (0.2, 0.5)


def build_model_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """A ~1.05 M-parameter Llama decoder (the arithmetic model's shape): trains in minutes on CPU."""
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
        eos_token_id=tokenizer.convert_tokens_to_ids(EOT),
        pad_token_id=tokenizer.pad_token_id,
    )


def build_generation_config(tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    """Defaults for ``generate``: one turn, stopping at ``<eot>``."""
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOT),
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=TURN_TOKENS,
    )


@dataclass(slots=True, frozen=True)
class ExpertEpisode:
    """One noisy-expert episode: what it saw, what it did, and which turns were random."""

    observations: list[str]
    actions: list[str]
    explored: list[bool]  # True where the action was random rather than the expert's


def noisy_expert_episode(seed: int, epsilon: float, rng: random.Random) -> ExpertEpisode:
    """One episode of the expert that acts uniformly at random with probability ``epsilon``."""
    environment = FrozenLakeEnvironment()
    observation = environment.reset(seed)
    episode = ExpertEpisode([], [], [])
    while True:
        explore = rng.random() < epsilon
        action = rng.choice(ACTIONS) if explore else expert_action(environment.lake_map, environment.position)
        episode.observations.append(observation)
        episode.actions.append(action)
        episode.explored.append(explore)
        result = environment.step(action)
        if result.terminated or result.truncated:
            return episode
        observation = result.observation


def training_seeds(excluded_maps: set[LakeMap]) -> Iterator[int]:
    """``TRAIN_SEEDS`` in order, minus the seeds whose map is an evaluation map."""
    return (seed for seed in TRAIN_SEEDS if generate_map(seed) not in excluded_maps)


class _BatchStream:
    """An endless, seeded stream of (input_ids, attention_mask, labels) batches of episodes.

    Sorting a pool of several batches by length before cutting it keeps short episodes (an early
    hole) apart from long ones, so little is spent on padding.
    """

    POOL_BATCHES = 8

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        batch_size: int,
        epsilon: float,
        seeds: Iterator[int],
        rng: random.Random,
    ) -> None:
        self._tokenizer = tokenizer
        self._batch_size = batch_size
        self._epsilon = epsilon
        self._seeds = seeds
        self._rng = rng
        self._ready: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __iter__(self) -> _BatchStream:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self._ready:
            self._refill()
        return self._ready.pop()

    def _refill(self) -> None:
        examples = []
        for _ in range(self._batch_size * self.POOL_BATCHES):
            episode = noisy_expert_episode(next(self._seeds), self._epsilon, self._rng)
            trained = [not explored for explored in episode.explored]
            examples.append(encode_episode(self._tokenizer, episode.observations, episode.actions, trained))
        examples.sort(key=lambda e: len(e.input_ids))
        batches = [self._collate(examples[i : i + self._batch_size]) for i in range(0, len(examples), self._batch_size)]
        self._rng.shuffle(batches)
        self._ready = batches

    def _collate(self, examples: Sequence) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        width = max(len(e.input_ids) for e in examples)
        input_ids = torch.full((len(examples), width), self._tokenizer.pad_token_id)
        attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
        labels = torch.full((len(examples), width), -100)  # -100: no loss (environment tokens, padding)
        for row, episode in enumerate(examples):
            ids = torch.tensor(episode.input_ids)
            input_ids[row, : len(ids)] = ids
            attention_mask[row, : len(ids)] = 1
            labels[row, : len(ids)] = torch.where(torch.tensor(episode.loss_mask, dtype=torch.bool), ids, -100)
        return input_ids, attention_mask, labels


@dataclass(slots=True, frozen=True)
class PretrainReport:
    """What a pretraining run did and how good its model is (written as pretrain_metrics.json)."""

    steps: int
    train_episodes: int
    train_seconds: float
    threads: int
    parameters: int
    report_maps: int
    report_seeds: str
    report_sampling_seed: int
    sampled_temperature_1: PlayReport
    greedy: PlayReport
    right_or_down_at_random: float  # the blind baseline on the same maps
    success_band: tuple[float, float]
    args: dict[str, float | int]


def right_or_down_baseline(seeds: Sequence[int]) -> float:
    """Success of moving right or down at random, blind to the map: what reading the map must beat."""
    rng = random.Random(0)
    environment = FrozenLakeEnvironment()
    wins = 0.0
    for seed in seeds:
        environment.reset(seed)
        while True:
            result = environment.step(rng.choice("RD"))
            if result.terminated or result.truncated:
                wins += result.reward
                break
    return wins / len(seeds)


def pretrain(args: argparse.Namespace) -> PretrainReport:
    """Train until the check maps' sampled success reaches the target, save, and report."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    model = LlamaForCausalLM(build_model_config(tokenizer))
    model.generation_config = build_generation_config(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    # Linear warm-up, then constant: where training stops is decided by success, not a schedule.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup_steps))
    report_seeds = list(HELD_OUT_SEEDS[:REPORT_MAPS])
    excluded = {generate_map(seed) for seed in [*CHECK_SEEDS, *report_seeds]}
    batches = _BatchStream(tokenizer, args.batch_size, args.epsilon, training_seeds(excluded), random.Random(args.seed))

    started = time.perf_counter()
    check_success = 0.0
    step = 0
    while step < args.max_steps and check_success < args.target_success:
        input_ids, attention_mask, labels = next(batches)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % args.eval_every == 0:
            check = summarize(play(model, tokenizer, CHECK_SEEDS, sampling_seed=step))
            check_success = check.success
            print(
                f"step {step:4d}  loss {loss.item():.4f}  sampled success {check.success:.3f}  "
                f"holes {check.holes:.2f}  turn limits {check.turn_limits:.2f}  "
                f"malformed/episode {check.malformed_actions_per_episode:.2f}  {time.perf_counter() - started:.0f}s",
                flush=True,
            )
    train_seconds = time.perf_counter() - started

    report = PretrainReport(
        steps=step,
        train_episodes=step * args.batch_size,
        train_seconds=round(train_seconds, 1),
        threads=args.threads,
        parameters=model.num_parameters(),
        report_maps=REPORT_MAPS,
        report_seeds=f"HELD_OUT_SEEDS[:{REPORT_MAPS}] = {report_seeds[0]}..{report_seeds[-1]}",
        report_sampling_seed=REPORT_SAMPLING_SEED,
        sampled_temperature_1=summarize(play(model, tokenizer, report_seeds, sampling_seed=REPORT_SAMPLING_SEED)),
        greedy=summarize(play(model, tokenizer, report_seeds, do_sample=False)),
        right_or_down_at_random=right_or_down_baseline(report_seeds),
        success_band=SUCCESS_BAND,
        args={k: v for k, v in vars(args).items() if k != "out"},
    )
    _save(model, tokenizer, report, Path(args.out))
    return report


def _save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, report: PretrainReport, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)  # model.safetensors, config.json, generation_config.json
    tokenizer.save_pretrained(out)
    (out / "pretrain_metrics.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    sampled, greedy = report.sampled_temperature_1, report.greedy
    (out / "README.md").write_text(
        "# FrozenLake model\n\n"
        "A small Llama decoder with a character tokenizer, pretrained by `python -m tasks.frozenlake.pretrain` "
        f"on noisy BFS-expert episodes (random action with probability {report.args['epsilon']}) on random 4×4 "
        "lakes, loss on the expert's own action tokens only, and stopped early so RL has room to improve it. "
        "The transcript format is in `tasks/frozenlake/transcript.py`.\n\n"
        f"- parameters: {report.parameters:,}\n"
        f"- training: {report.steps} steps, {report.train_episodes} episodes, {report.train_seconds} s on "
        f"{report.threads} CPU thread(s) (wall time on a shared machine)\n"
        f"- success over {report.report_maps} held-out maps ({report.report_seeds}), never trained on: "
        f"sampled at temperature 1.0 {sampled.success:.3f}, greedy {greedy.success:.3f}; "
        f"moving right or down at random {report.right_or_down_at_random:.3f}, the BFS expert 1.0\n"
        f"- sampled episodes: {sampled.mean_turns} turns on average, {sampled.holes:.2f} end in a hole, "
        f"{sampled.turn_limits:.2f} at the turn limit, {sampled.malformed_actions_per_episode:.2f} malformed actions each\n"
        f"- the tests replay the sampled run (sampling seed {report.report_sampling_seed}) and require its success "
        f"to lie in {list(report.success_band)}\n\n"
        "Full numbers: `pretrain_metrics.json`.\n"
    )


def _parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=MODEL_DIR, help="folder to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights, the expert's noise and batch order")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--batch-size", type=int, default=16, help="episodes per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--epsilon", type=float, default=0.2, help="probability the expert acts at random")
    parser.add_argument("--max-steps", type=int, default=1000, help="hard stop if the target is never reached")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between early-stopping checks")
    parser.add_argument("--target-success", type=float, default=0.3, help="stop once sampled (T=1) check success reaches this")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    report = pretrain(_parse_args(argv))
    print(
        f"{report.steps} steps in {report.train_seconds} s; over {report.report_maps} held-out maps: "
        f"sampled (T=1) success {report.sampled_temperature_1.success:.3f}, greedy {report.greedy.success:.3f}, "
        f"right-or-down baseline {report.right_or_down_at_random:.3f}"
    )


if __name__ == "__main__":
    main()
