"""The one FAKE model of the tests: a generation backend whose replies a test scripts.

It tests the logic around a model (episodes, plans, evaluation, scoring, batching), never a capability: what a
real model does is tested on the tiny built-in base and real LoRA adapters. Token counts are those the hf backend
reports for the built-in tokenizer: one per character, BOS before the prompt, EOS after the reply.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rsi.backends.base import Completion, SamplingParams
from rsi.models import Message

Reply = Callable[[Any, int], "str | Completion"]  # (prompt text or chat conversation, sample index) -> the reply


class FakeModel:
    """FAKE backend: each prompt's ``k``-th sample is ``reply(prompt, k)`` (a chat conversation's too); a reply
    given as text stops with EOS, a ``Completion`` is returned as it is. It records every batch it is sent
    (``prompts``: the prompts or conversations of each call, in order)."""

    def __init__(self, reply: Reply):
        self.reply = reply
        self.prompts: list[list[Any]] = []
        self.tools: list[list[dict[str, Any]]] = []

    @property
    def calls(self) -> int:
        return len(self.prompts)

    def generate(self, prompts: Sequence[str], params: SamplingParams, adapter: str | None = None
                 ) -> list[list[Completion]]:
        self.prompts.append(list(prompts))
        return [[self._completion(self.reply(p, k), 1 + len(p)) for k in range(params.n)] for p in prompts]

    def chat(self, conversations: Sequence[Sequence[Message]], tools: Sequence[dict[str, Any]],
             params: SamplingParams, adapter: str | None = None) -> list[list[Completion]]:
        self.prompts.append([list(c) for c in conversations])
        self.tools.append(list(tools))
        return [[self._completion(self.reply(list(c), k), 1 + sum(len(m.content) for m in c)) for k in range(params.n)]
                for c in conversations]

    @staticmethod
    def _completion(reply: str | Completion, prompt_tokens: int) -> Completion:
        if isinstance(reply, Completion):
            return reply
        return Completion(text=reply, prompt_tokens=prompt_tokens, completion_tokens=len(reply) + 1,
                          finish_reason="stop")

    def close(self) -> None:
        pass


def operands(prompt: str) -> tuple[int, int]:
    """The operands of a reverse-padded addition prompt ``A+B=`` (least significant digit first)."""
    left, right = prompt.removesuffix("=").split("+")
    return int(left[::-1]), int(right[::-1])


def adder(wrong: Callable[[int, int], bool] = lambda a, b: False) -> Reply:
    """Replies A + B to a reverse-padded ``A+B=`` prompt, in its format (one digit wider than an operand), and
    A + B + 1 where ``wrong(a, b)``."""

    def reply(prompt: str, k: int) -> str:
        a, b = operands(prompt)
        return str(a + b + wrong(a, b))[::-1].ljust(len(prompt.split("+")[0]) + 1, "0")

    return reply


def voters(right: int) -> Reply:
    """Replies A + B to a reverse-padded ``A+B=`` prompt in samples 0 to ``right - 1``, A + B + 1 in the rest."""
    return lambda prompt, k: adder(lambda a, b: k >= right)(prompt, k)
