"""The text a pair's model reads and is trained on.

Completion mode (the built-in model): the model reads the transcript as one text, the prompt messages' contents
then each assistant turn followed by the tokenizer's EOS and each tool message's content. That is also the text
a trained episode is cut from (``segments``): the assistant turns and their EOS are what the loss sees.

Chat mode (``prompt.mode = "chat"``, a Hugging Face base with a chat template): the model's chat template writes
the text of the messages and the harness's tools (``rsi.chat``); training cuts the same template's text
(``ChatFormat.segments``): the loss sees the assistant turns and the EOS that ends each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import takewhile
from typing import Any

from rsi.hcp import Harness
from rsi.models import Message

EOS_TEXT = "<eos>"  # the built-in tokenizer's end of sequence; a Hugging Face model's is its tokenizer's eos_token



def segments(messages: Sequence[Message], eos: str = EOS_TEXT) -> list[tuple[str, bool]]:
    """The transcript as (text, trained) pieces: the prompt and tool messages as the model read them (not
    trained), each assistant turn with its EOS (trained). Joined, they are the model's input text."""
    out: list[tuple[str, bool]] = []
    for m in messages:
        if m.role == "assistant":
            out.append((m.content + eos, True))
        else:
            out.append((m.content, False))
    return out


def transcript(messages: Sequence[Message], eos: str = EOS_TEXT) -> str:
    return "".join(text for text, _ in segments(messages, eos))


def training_parts(messages: Sequence[Message], chat: ChatFormat | None = None) -> tuple[str, str, tuple[tuple[str, bool], ...]]:
    """What a trajectory's messages teach: (prompt text, completion, turns). One reply: the completion, no
    turns. An episode: its turns after the prompt as (text, trained) pieces without EOS (the trainer appends
    its tokenizer's EOS to each trained piece), and as completion their text joined (what makes two episodes
    of one task different). ``chat``: a chat-mode harness's format; the prompt and the text between turns are
    then what the model's chat template writes."""
    prompt = list(takewhile(lambda m: m.role in ("system", "user"), messages))
    rest = messages[len(prompt):]
    if chat is not None:
        pieces = chat.segments(messages)
        text, turns = pieces[0][0], tuple(pieces[1:])
    else:
        text, turns = "".join(m.content for m in prompt), tuple(segments(rest, eos=""))
    if len(rest) == 1 and rest[0].role == "assistant" and not rest[0].tool_calls:
        return text, rest[0].content, ()
    return text, "".join(t for t, _ in turns), turns


def chat_format(harness: Harness) -> ChatFormat | None:
    """The chat format of a chat-mode harness (its base's tokenizer, loaded once), None in completion mode."""
    if not harness.chat:
        return None
    from rsi.tokens import token_counter

    return ChatFormat(token_counter(harness.document.model.base, harness.folder).tokenizer, tuple(harness.chat_tools))


def model_input(harness: Harness, task_payload: dict[str, Any]) -> str:
    """The text the model reads for a task's first turn: the chat template's (chat mode) or the prompt's."""
    chat = chat_format(harness)
    if chat is None:
        return harness.prompt(task_payload)
    messages = [Message(role=role, content=content) for role, content in harness.prompt_messages(task_payload)]
    return chat.render(messages)


@dataclass(frozen=True)
class ChatFormat:
    """A chat-mode harness's text of an episode: its base model's tokenizer (chat template) and its tools."""

    tokenizer: Any
    tools: tuple[dict[str, Any], ...] = ()

    def segments(self, messages: Sequence[Message]) -> list[tuple[str, bool]]:
        from rsi.chat import segments

        return segments(self.tokenizer, messages, self.tools)

    def render(self, messages: Sequence[Message]) -> str:
        from rsi.chat import render

        return render(self.tokenizer, messages, self.tools)
