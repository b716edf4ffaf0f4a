"""The generation backend interface: batched completions (text prompts) or chat replies (message lists, through
the model's chat template, with tools), k samples per prompt, seeded, per-adapter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from rsi.models import Message, ToolCall


class SamplingParams(BaseModel):
    """Decoding settings of one request; temperature 0 means greedy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_new_tokens: int = Field(ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, description="samples per prompt")
    seed: int = 0
    stop: tuple[str, ...] = ()


class Completion(BaseModel):
    """One sampled continuation of one prompt (special tokens removed from ``text``); from ``chat``, the
    assistant message: its text and the tool calls it makes."""

    model_config = ConfigDict(frozen=True)

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    prompt_tokens: int
    completion_tokens: int
    finish_reason: Literal["stop", "length"]
    generate_s: float = 0.0


@runtime_checkable
class GenerationBackend(Protocol):
    """What the executor and the evaluator need from an engine."""

    def generate(
        self, prompts: Sequence[str], params: SamplingParams, adapter: str | None = None
    ) -> list[list[Completion]]:
        """For each prompt, ``params.n`` completions. ``adapter`` is a LoRA directory (None: the base).

        Same prompts, params and adapter give the same completions on the same machine."""
        ...

    def chat(
        self, conversations: Sequence[Sequence[Message]], tools: Sequence[dict], params: SamplingParams,
        adapter: str | None = None,
    ) -> list[list[Completion]]:
        """For each conversation, ``params.n`` assistant replies: the messages go through the model's chat
        template with ``tools`` (OpenAI format); a reply's ``tool_calls`` are the calls it makes."""
        ...

    def close(self) -> None: ...
