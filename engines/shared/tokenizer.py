"""Loading a checkpoint's tokenizer exactly as its ``tokenizer.json`` defines it, and comparing two.

transformers 5's ``AutoTokenizer`` picks a class from the model type and lets that class
replace the normalizer and pre-tokenizer: for any ``qwen2`` checkpoint it installs Qwen's
byte-level regex, which silently drops characters outside Qwen's vocabulary (a qwen2-shaped
build of our character tokenizer lost every newline, so prompts no longer matched training
and reward fell to zero). A checkpoint that ships ``tokenizer.json`` is loaded from that file
as is, whatever its model type.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = ["load_tokenizer", "vocabulary_difference"]


def load_tokenizer(model_path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a local checkpoint: its ``tokenizer.json`` verbatim when present."""
    if (Path(model_path) / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(model_path))
    return AutoTokenizer.from_pretrained(str(model_path))


def vocabulary_difference(ours: PreTrainedTokenizerBase, theirs: PreTrainedTokenizerBase) -> str | None:
    """None when both tokenizers map every token to the same id, else their first difference in
    words: two models' log-probs of one token id are comparable only then."""
    mine, other = ours.get_vocab(), theirs.get_vocab()
    if mine == other:
        return None
    if len(mine) != len(other):
        return f"{len(mine)} tokens against {len(other)}"
    token = next(t for t in sorted(mine) if other.get(t) != mine[t])
    return f"token {token!r} is id {mine[token]} against {other.get(token, 'absent')}"
