"""How a task item's prompt becomes the token ids a text workload samples from and trains on.

A string prompt is tokenized as is, with the tokenizer's special tokens. A chat prompt
(``TaskItem.messages``) goes through the model's chat template with the generation prompt
appended, ``task.system_prompt`` first when the chat has no system message of its own. The
template writes whatever special tokens the model expects (a BOS included), so its text is
tokenized without adding any: that is what ``apply_chat_template`` does, and the ids are its ids.

``engines.chat_template`` (a Jinja string, or the path of a Jinja file) replaces the model's
template, or gives one to a model that has none; it becomes the tokenizer's template, so the
exported checkpoint carries it. A chat prompt for a model with no template at all is a
``ConfigError`` naming the model folder.

Invariant: an item's ids are computed once, when it is loaded; the rollout engine samples from
that list and the trainer trains on the same list (the trajectory's payload carries it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.core.config import ConfigError
from tandem.core.records import TaskItem

__all__ = ["PromptEncoder", "read_chat_template"]


def read_chat_template(value: str) -> str:
    """``engines.chat_template``'s template: the string itself when it reads as Jinja (has
    ``{{`` or ``{%``), else the text of the file it names (``ConfigError`` if there is none)."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value)
    if not path.is_file():
        raise ConfigError(f"engines.chat_template: {value!r} is neither a Jinja template nor a file")
    return path.read_text(encoding="utf-8")


class PromptEncoder:
    """``encoder(item)``: the prompt token ids of a task item, for ``model_path``'s tokenizer."""

    def __init__(
        self, tokenizer: Any, model_path: Path, *, system_prompt: str | None = None, chat_template: str | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.system_prompt = system_prompt
        if chat_template is not None:
            tokenizer.chat_template = read_chat_template(chat_template)

    @property
    def has_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def __call__(self, item: TaskItem) -> list[int]:
        if item.messages is None:
            return list(self.tokenizer(item.prompt)["input_ids"])
        return self.chat(item.messages)

    def chat(self, messages: Any) -> list[int]:
        """The ids of a conversation rendered for the model's next (assistant) turn."""
        if not self.has_template:
            raise ConfigError(
                f"engines.model_path {self.model_path}: the model's tokenizer has no chat template, and the "
                "prompts are chat messages; give engines.chat_template (a Jinja file or string) or string prompts"
            )
        messages = list(messages)
        if self.system_prompt is not None and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    def turn(self, text: str, *, closed: bool) -> list[int]:
        """The ids of a user turn ``text`` after the model's turn, then the next turn's generation
        prompt: what the template writes after an assistant message's content, less the
        end-of-turn token when the model already wrote it (``closed``)."""
        sentinel = "\x00tandem\x00"
        before = [{"role": "user", "content": "."}, {"role": "assistant", "content": sentinel}]
        prefix = self.tokenizer.apply_chat_template(before, tokenize=False)
        rendered = self.tokenizer.apply_chat_template(
            [*before, {"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        if not rendered.startswith(prefix) or sentinel not in prefix:
            raise ConfigError(
                f"engines.model_path {self.model_path}: the chat template rewrites earlier turns, so an episode's "
                "observations cannot be appended turn by turn; give engines.chat_template"
            )
        between = prefix[prefix.rindex(sentinel) + len(sentinel) :] + rendered[len(prefix) :]
        eos = self.tokenizer.eos_token
        if closed and eos and between.startswith(eos):
            between = between[len(eos) :]
        return list(self.tokenizer(between, add_special_tokens=False)["input_ids"])
