"""Token counters: how many tokens a text is for a harness's base model, counted by the auditor itself.

The auditor never trusts a trajectory's self-reported token counts; it recounts the recorded text with
the base model's tokenizer. ``"builtin"`` (the character-level tokenizer of ``rsi.basemodel``) is counted
in pure Python, without torch or transformers; a model directory loads its tokenizer lazily.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from rsi.errors import UserError

# The built-in tokenizer's special tokens are matched as whole tokens even inside text (as Hugging Face
# "added tokens" are); none is a prefix of another and they cannot overlap, so counting matches is exact.
_BUILTIN_SPECIAL = re.compile("<pad>|<eos>|<bos>|<unk>")


@dataclass(frozen=True)
class TokenCounter:
    """Counts tokens of one tokenizer. ``text`` counts a text alone (as a completion is counted);
    ``prompt`` counts it as a prompt, with the special tokens the tokenizer adds (e.g. ``<bos>``)."""

    name: str
    text: Callable[[str], int]
    prompt: Callable[[str], int]


def builtin_text_tokens(text: str) -> int:
    """Tokens of ``text`` under the built-in tokenizer: one per character (unknown ones are one ``<unk>``),
    except that a special-token string such as ``<eos>`` in the text is one token."""
    specials = _BUILTIN_SPECIAL.findall(text)
    return len(text) - sum(len(s) - 1 for s in specials)


BUILTIN = TokenCounter("builtin", text=builtin_text_tokens, prompt=lambda text: 1 + builtin_text_tokens(text))


@cache
def _hf_counter(model_dir: Path) -> TokenCounter:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)

    def count(text: str, special: bool) -> int:
        return len(tokenizer(text, add_special_tokens=special)["input_ids"])

    return TokenCounter(str(model_dir), text=lambda t: count(t, False), prompt=lambda t: count(t, True))


def token_counter(base: str, root: Path | None = None) -> TokenCounter:
    """The counter for a harness's ``model.base``: ``"builtin"`` or a Hugging Face model directory
    (a relative one is taken relative to ``root``, the harness's directory, when given)."""
    if base == "builtin":
        return BUILTIN
    path = Path(base).expanduser()
    if not path.is_absolute() and root is not None:
        path = root / path
    if not path.is_dir():
        raise UserError(f"model.base {base!r}: no such model directory {path}; "
                        "pass 'builtin' or a saved model directory")
    return _hf_counter(path.resolve())
