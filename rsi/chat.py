"""Chat mode: an episode's messages as the text a model's chat template makes of them.

One renderer for everyone who needs that text: the ``hf`` backend (what the model reads), the auditor (the
prompt tokens it recounts) and the trainer (the assistant turns the loss sees). An assistant turn goes to the
template as the text the model wrote (a tool call included, in the model's own syntax), so the template writes
back exactly what was generated and the calls are not written twice.

Tool calls in the ``hf`` backend are read from that text in the Hermes format most open chat models share
(Qwen2.5, Hermes, SmolLM2-1.7B): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from rsi.errors import UserError
from rsi.models import Message, ToolCall

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages in the chat-template format: role and content (assistant turns as written), tool call ids."""
    out = []
    for m in messages:
        item: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        out.append(item)
    return out


def require_template(tokenizer: Any, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{where}: the model's tokenizer has no chat template, so a chat-mode harness cannot "
                        "drive it; use prompt.mode = 'completion', or a model saved with a chat template")


def render(tokenizer: Any, messages: Sequence[Message], tools: Sequence[dict[str, Any]] = (),
           generation_prompt: bool = True) -> str:
    """The template's text of ``messages`` (with the assistant's turn opened when ``generation_prompt``)."""
    require_template(tokenizer, getattr(tokenizer, "name_or_path", "model"))
    return tokenizer.apply_chat_template(template_messages(messages), tools=list(tools) or None,
                                         add_generation_prompt=generation_prompt, tokenize=False)


def segments(tokenizer: Any, messages: Sequence[Message], tools: Sequence[dict[str, Any]] = ()) -> list[tuple[str, bool]]:
    """The episode as (text, trained) pieces: what the template writes before each assistant turn (not
    trained) and the turn's text (trained; the trainer appends the EOS that ends it). Joined, with each trained
    piece followed by EOS, they are the template's text of the episode up to its last turn's end.
    Raises UserError when the template does not write an episode as a prefix of its continuation."""
    eos, out, done = tokenizer.eos_token, [], ""
    for i, m in enumerate(messages):
        if m.role != "assistant":
            continue
        before = render(tokenizer, messages[:i], tools)
        through = render(tokenizer, messages[: i + 1], tools, generation_prompt=False)
        if not before.startswith(done) or not through.startswith(before + m.content + eos):
            raise UserError(f"the chat template of {tokenizer.name_or_path} does not write a conversation as the "
                            f"prefix of its continuation (turn {i} ends other than with its text and "
                            f"{eos!r}); its replies cannot be trained turn by turn")
        out += [(before[len(done):], False), (m.content, True)]
        done = before + m.content + eos
    return out


def parse_tool_calls(text: str) -> tuple[ToolCall, ...]:
    """The Hermes-format calls in a reply, in order; a block that is not a JSON object with a string ``name`` is
    no call (the reply then reads as text, and the auditor judges it)."""
    calls = []
    for block in _HERMES_CALL.findall(text):
        try:
            data = json.loads(block)
        except ValueError:
            continue
        if isinstance(data, dict) and isinstance(data.get("name"), str):
            arguments = data.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    continue
            if isinstance(arguments, dict):
                calls.append(ToolCall(id=f"call_{len(calls)}", name=data["name"], arguments=arguments))
    return tuple(calls)
