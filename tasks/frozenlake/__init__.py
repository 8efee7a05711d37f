"""FrozenLake: a multi-turn environment task with a small model shipped for it.

The public face of the task, so other code never hard-codes paths or formats: the task plugin
(``make_task``, found by ``task.name: frozenlake``, options ``slippery``, ``size``, ``max_turns``;
reward ``tasks.frozenlake.reward:reached_goal``), the environment
(gymnasium's FrozenLake behind ``core.environment``'s protocol, text grid in, one action letter
out), the maps per seed and the seed ranges, the BFS expert, the transcript format the model is
trained on (which the environment manager reproduces token for token), and ``MODEL_DIR``, the
folder of the shipped model (load it with ``AutoModelForCausalLM.from_pretrained(MODEL_DIR)`` and
``AutoTokenizer.from_pretrained(MODEL_DIR)``).

Importing this package pulls in gymnasium and numpy but neither torch nor transformers; the
tokenizer, transcript encoding, evaluation and pretraining modules import them.
"""

from __future__ import annotations

from pathlib import Path

from tandem.tasks.frozenlake.environment import MAX_TURNS, FrozenLakeEnvironment, parse_action, render
from tandem.tasks.frozenlake.maps import (
    ACTIONS,
    FROZEN_PROBABILITY,
    HELD_OUT_SEEDS,
    MAP_SIZE,
    TRAIN_SEEDS,
    expert_action,
    generate_map,
    shortest_path,
)

MODEL_DIR: Path = Path(__file__).resolve().parent / "model"

from tandem.tasks.frozenlake.task import HELD_OUT_MAPS, FrozenLakeTask, make_task  # noqa: E402  (needs MODEL_DIR)

__all__ = [
    "ACTIONS",
    "FROZEN_PROBABILITY",
    "HELD_OUT_MAPS",
    "HELD_OUT_SEEDS",
    "MAP_SIZE",
    "MAX_TURNS",
    "MODEL_DIR",
    "TRAIN_SEEDS",
    "FrozenLakeEnvironment",
    "FrozenLakeTask",
    "expert_action",
    "generate_map",
    "make_task",
    "parse_action",
    "render",
    "shortest_path",
]
