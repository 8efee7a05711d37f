"""On-policy distillation's teacher in the torch bundle: it scores at the sampling temperature
(``log_softmax(logits / T)``, computed by hand here), and a teacher whose tokenizer is not the
student's is refused before any engine starts, naming ``teacher.model_path``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.core.config import ConfigError, TandemConfig, validate_config
from tandem.core.records import FinishReason, token_trajectory
from tandem.engines.shared.tokenizer import load_tokenizer
from tandem.engines.text.build import teacher_engine, teacher_path
from tandem.engines.trainers.torch_train import TEACHER_STATE_FILE

STAGES = ["dataloader", "generate", "rollout", "teacher_logp", "reward", "train"]


def distill_config(
    student: Path, teacher: Path | None, temperature: float = 1.0, threads: int | None = 1, **sections: object
) -> TandemConfig:
    return validate_config({
        **sections,
        "task": {"name": "arithmetic"},
        "engines": {"type": "torch", "model_path": str(student)},
        "flow": {"stages": STAGES},
        "rollout": {"temperature": temperature},
        "algorithm": {"proximal": "current"},
        "teacher": {"model_path": None if teacher is None else str(teacher), "threads": threads},
    })


async def test_the_teacher_scores_at_the_sampling_temperature(model_dir: Path, v1_model_dir: Path, tmp_path: Path) -> None:
    config = distill_config(model_dir, v1_model_dir, temperature=0.7)
    engine = teacher_engine(config, teacher_path(config, load_tokenizer(model_dir)), num_threads=1)
    try:
        prompt, response = [2, 3, 12], [5, 9, 14, 4]
        sample = token_trajectory(0, 0, prompt, response, [0.0] * 4, [0] * 4, FinishReason.LENGTH)
        (scored,) = await engine.logprobs([sample])
        # By hand: the teacher's logits at the positions that predict each response token, divided
        # by the temperature, log-softmaxed, read at the token.
        model = AutoModelForCausalLM.from_pretrained(v1_model_dir).eval()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits / 0.7, dim=-1)[torch.arange(4), torch.tensor(response)]
        assert scored == pytest.approx(expected.tolist(), abs=1e-5)
        at_one = torch.log_softmax(logits, dim=-1)[torch.arange(4), torch.tensor(response)]
        assert max(abs(a - b) for a, b in zip(scored, at_one.tolist())) > 0.05  # the temperature is not ignored
        assert engine.version == 0  # fixed: the teacher never trains
        await engine.save_state(tmp_path)  # in a checkpoint beside the reference's, under its own name
        assert (tmp_path / TEACHER_STATE_FILE).is_file() and TEACHER_STATE_FILE != "reference.pt"
    finally:
        engine.close()


@pytest.mark.parametrize(("threads", "budget"), [(None, 2), (1, 1)])
def test_the_teacher_computes_on_a_thread_budget_of_its_own(
    model_dir: Path, v1_model_dir: Path, threads: int | None, budget: int
) -> None:
    # teacher.threads, else the budget the builder gives it (the trainer's, as the reference gets).
    engine = teacher_engine(distill_config(model_dir, v1_model_dir, threads=threads), v1_model_dir, num_threads=2)
    try:
        assert engine._executor.submit(torch.get_num_threads).result() == budget
    finally:
        engine.close()


def edited_copy(source: Path, target: Path, file: str, edit: object) -> Path:
    shutil.copytree(source, target)
    data = json.loads((target / file).read_text())
    edit(data)  # type: ignore[operator]
    (target / file).write_text(json.dumps(data))
    return target


def swap_two_tokens(tokenizer: dict) -> None:
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]


def add_a_token(tokenizer: dict) -> None:
    tokenizer["model"]["vocab"]["f"] = len(tokenizer["model"]["vocab"])


def shrink_the_embedding(config: dict) -> None:
    config["vocab_size"] = 10


@pytest.mark.parametrize(
    ("file", "edit", "refusal"),
    [
        ("tokenizer.json", swap_two_tokens, r"its tokenizer is not the student's \(token 'a' is id \d+ against \d+\)"),
        ("tokenizer.json", add_a_token, r"its tokenizer is not the student's \(20 tokens against 21\)"),
        ("config.json", shrink_the_embedding, r"the model's vocab_size is 10 but the tokenizer has 20 tokens"),
    ],
    ids=["same size, other ids", "another size", "no embedding for some ids"],
)
def test_a_teacher_with_another_vocabulary_is_refused(
    model_dir: Path, v1_model_dir: Path, tmp_path: Path, file: str, edit: object, refusal: str
) -> None:
    teacher = edited_copy(v1_model_dir, tmp_path / "teacher", file, edit)
    with pytest.raises(ConfigError, match=rf"teacher\.model_path {teacher}: {refusal}"):
        teacher_path(distill_config(model_dir, teacher), load_tokenizer(model_dir))


def test_a_missing_teacher_is_named(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"teacher\.model_path: no model \(config\.json\) at"):
        teacher_path(distill_config(model_dir, tmp_path / "nowhere"), load_tokenizer(model_dir))
    with pytest.raises(ConfigError, match=r"teacher\.model_path: engines\.type=torch needs the teacher's checkpoint folder"):
        distill_config(model_dir, None)


def test_a_teacher_runs_in_this_process_only(model_dir: Path, v1_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"teacher: the teacher's engine runs in this process \(cluster\.backend=local\)"):
        distill_config(model_dir, v1_model_dir, cluster={"backend": "ray"})
