"""Token counters: how many tokens a text is for a harness's base model, counted by the auditor itself.

The auditor never trusts a trajectory's self-reported token counts; it recounts the recorded text with
the base model's tokenizer. ``"builtin"`` (the character-level tokenizer of ``rsi.basemodel``) is counted
in pure Python, without torch or transformers; a model directory loads its tokenizer lazily.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from rsi.errors import UserError
from rsi.models import Message

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
    tokenizer: Any = None  # the Hugging Face tokenizer (None for the built-in one)

    def chat_prompt(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] = ()) -> int:
        """Tokens of ``messages`` in chat mode: the chat template's text with the assistant's turn opened,
        tokenized as the ``hf`` backend sends it (the template writes its own special tokens)."""
        from rsi.chat import render

        if self.tokenizer is None:
            raise UserError("chat mode needs a Hugging Face base with a chat template; the built-in model has none")
        return len(self.tokenizer(render(self.tokenizer, messages, tools), add_special_tokens=False)["input_ids"])


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

    return TokenCounter(str(model_dir), text=lambda t: count(t, False), prompt=lambda t: count(t, True),
                        tokenizer=tokenizer)


def token_counter(base: str, root: Path | None = None) -> TokenCounter:
    """The counter for a harness's ``model.base``: ``"builtin"``, or any base ``rsi.bases`` resolves (a relative
    path is taken relative to ``root``, the harness's directory, when given)."""
    from rsi.bases import model_dir

    if base == "builtin":
        return BUILTIN
    path = Path(base).expanduser()
    path = path if path.is_absolute() or root is None else root / path
    if path.is_dir():  # a tokenizer alone is enough to count
        return _hf_counter(path.resolve())
    return _hf_counter(model_dir(base, root or Path.cwd()))
