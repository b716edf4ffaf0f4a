"""Episodes: a model-harness pair acting on a task over several turns, with tool calls on the family's environment.

An episode starts with the harness's prompt messages. Each turn the model writes an assistant message; a turn
that is a tool call (in the harness's ``[tool_calls] syntax``) is run on the episode's environment
(``rsi.substrate``) and answered by a tool message (the harness's ``prompt.tool_template``); a turn that is not
a call is the final reply and ends the episode, as does a reply cut by length or the harness's step limit.
A harness without tools makes one-step episodes: the prompt and one reply.

Many episodes advance together: each turn, the next turn of every live episode is one backend batch. The first
turn is the same call the single-turn rollout always made (``params.n`` samples per task), so a one-step
episode's trajectory is what it was; later turns continue each sample from its own transcript (the backend
seeds a row from its text, so a sample's path is a function of its own history).

Completion mode (the built-in model): the model reads the transcript as one text, the prompt messages' contents
then each assistant turn followed by the tokenizer's EOS and each tool message's content. That is also the text
a trained episode is cut from (``segments``): the assistant turns and their EOS are what the loss sees.

Chat mode (``prompt.mode = "chat"``, a Hugging Face base with a chat template): the backend's ``chat`` gets the
messages and the harness's tools, the model's chat template writes the text (``rsi.chat``), and a turn's tool
calls are the ones the backend read in the model's own format. Training cuts the same template's text
(``ChatFormat.segments``): the loss sees the assistant turns and the EOS that ends each.
"""

from __future__ import annotations

import json
import random
import re
from itertools import takewhile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from rsi.audit import parse_reply
from rsi.backends.base import Completion, GenerationBackend, SamplingParams
from rsi.errors import UserError
from rsi.hcp import Harness
from rsi.models import Message, Task, Timings, TokenCounts, ToolCall, ToolRecord, Trajectory
from rsi.substrate import Session, result_text
from rsi.tasks import TaskFamily, get_family

EOS_TEXT = "<eos>"  # the built-in tokenizer's end of sequence; a Hugging Face model's is its tokenizer's eos_token
_PYTHON_CALL = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\((.*)\)$", re.DOTALL)


# ---- tool-call syntax --------------------------------------------------------------------------------


def render_call(harness: Harness, name: str, arguments: dict[str, Any]) -> str:
    """A call as the model writes it (``python`` syntax): ``name(v1,v2)``, values in schema property order."""
    order = _properties(harness, name)
    extra = sorted(set(arguments) - set(order))
    if extra:
        raise UserError(f"tool {name!r}: arguments {extra} are not properties of its schema")
    values = [json.dumps(arguments[key], separators=(",", ":")) for key in order if key in arguments]
    return f"{name}({','.join(values)})"


def parse_call(harness: Harness, text: str) -> tuple[str, dict[str, Any]] | None:
    """The call an assistant turn writes, or None when the turn is not a call (a final reply). A call to a tool
    the harness does not expose is still a call (the environment answers it with an error and the auditor fails
    it), so a model cannot end an episode by misspelling a tool."""
    m = _PYTHON_CALL.match(text.strip())
    if m is None:
        return None
    name, inner = m.groups()
    try:
        values = json.loads(f"[{inner}]")
    except ValueError:
        return None
    order = _properties(harness, name) if name in harness.tool_schemas else []
    if len(values) > len(order):  # positional values beyond the schema's properties: kept, so the schema fails
        return name, {**dict(zip(order, values)), **{f"_{i}": v for i, v in enumerate(values[len(order):])}}
    return name, dict(zip(order, values))


def _properties(harness: Harness, name: str) -> list[str]:
    schema = harness.tool_schemas.get(name)
    if schema is None:
        raise UserError(f"{harness.path}: no tool {name!r} (tools: {sorted(harness.tool_schemas)})")
    return list(schema.get("properties") or {})


# ---- transcripts ---------------------------------------------------------------------------------------


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


# ---- running episodes ----------------------------------------------------------------------------------


@dataclass
class _Episode:
    task: Task
    sample: int
    messages: list[Message]
    session: Session | None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    generate_s: float = 0.0
    tools_s: float = 0.0
    finish: str = "stop"
    done: bool = False
    steps: int = 0


def run_episodes(tasks: Sequence[Task], harness: Harness, backend: GenerationBackend, pair_id: str,
                 params: SamplingParams, adapter: str | None = None, family: TaskFamily | None = None,
                 eos: str = EOS_TEXT) -> list[Trajectory]:
    """``params.n`` episodes per task under the harness, advanced together; one trajectory each, in task then
    sample order. Seeded: the same tasks, params and adapter give the same trajectories and ids."""
    doc = harness.document
    if doc.tools and family is None:
        family = get_family(doc.family)
    episodes: list[_Episode] = []
    rendered = [harness.prompt_messages(t.payload) for t in tasks]
    for task, messages in zip(tasks, rendered, strict=True):
        prompt = [Message(role=role, content=content) for role, content in messages]
        for k in range(params.n):
            session = Session(family.environment, task.payload, harness.tool_schemas) if doc.tools else None
            episodes.append(_Episode(task, k, list(prompt), session))
    if not episodes:
        return []

    def step(conversations: list[list[Message]], p: SamplingParams) -> list[list[Completion]]:
        if harness.chat:  # the messages themselves, through the model's chat template
            return backend.chat(conversations, harness.chat_tools, p, adapter=adapter)
        return backend.generate([transcript(m, eos) for m in conversations], p, adapter=adapter)

    first = step([episodes[i * params.n].messages for i in range(len(tasks))], params)  # each task's prompt, n samples
    for episode, completion in zip(episodes, [c for samples in first for c in samples], strict=True):
        episode.prompt_tokens = completion.prompt_tokens
        _take_turn(episode, completion, harness)
    one = params.model_copy(update={"n": 1})
    while live := [e for e in episodes if not e.done]:
        outputs = step([e.messages for e in live], one)
        for episode, samples in zip(live, outputs, strict=True):
            _take_turn(episode, samples[0], harness)
    return [_trajectory(e, harness, pair_id, params.seed) for e in episodes]


def _take_turn(episode: _Episode, completion: Completion, harness: Harness) -> None:
    """Record one assistant turn; run its call, if it makes one, and answer it."""
    doc = harness.document
    episode.steps += 1
    episode.completion_tokens += completion.completion_tokens
    episode.generate_s += completion.generate_s
    episode.finish = completion.finish_reason
    calls = _calls(harness, completion) if doc.tools and completion.finish_reason == "stop" else []
    if not calls:
        episode.messages.append(Message(role="assistant", content=completion.text))
        episode.done = True
        return
    ids = [f"call_{episode.steps}" if len(calls) == 1 else f"call_{episode.steps}_{j}" for j in range(len(calls))]
    episode.messages.append(Message(role="assistant", content=completion.text, tool_calls=tuple(
        ToolCall(id=call_id, name=name, arguments=arguments) for call_id, (name, arguments) in zip(ids, calls))))
    for call_id, (name, arguments) in zip(ids, calls):
        started = time.perf_counter()
        record = episode.session.call(call_id, name, arguments)
        episode.tools_s += time.perf_counter() - started
        content = harness.render_tool(episode.task.payload, {"name": name, "arguments": arguments},
                                      result_text(record.result))
        episode.messages.append(Message(role="tool", content=content, tool_call_id=call_id))
    episode.done = episode.steps >= doc.limits.max_steps


def _calls(harness: Harness, completion: Completion) -> list[tuple[str, dict[str, Any]]]:
    """The calls a turn makes: in chat mode those the backend read from the model's own format, else the one
    the text writes in the harness's syntax."""
    if harness.chat:
        return [(c.name, c.arguments) for c in completion.tool_calls]
    call = parse_call(harness, completion.text)
    return [] if call is None else [call]


def _trajectory(e: _Episode, harness: Harness, pair_id: str, seed: int) -> Trajectory:
    return Trajectory.build(
        task_id=e.task.id, pair_id=pair_id, harness_id=harness.id, sample_index=e.sample, seed=seed,
        messages=tuple(e.messages), finish_reason=e.finish,
        tokens=TokenCounts(prompt=e.prompt_tokens, completion=e.completion_tokens),
        timings=Timings(generate_s=e.generate_s, tools_s=e.tools_s),
        tool_log=tuple(e.session.records) if e.session is not None else (),
    )


class Demonstration(NamedTuple):
    messages: list[Message]
    tool_log: list[ToolRecord]
    mistaken: frozenset[int] = frozenset()  # indices of the messages that are the expert's mistakes


def demonstration(harness: Harness, family: TaskFamily, task: Task, mistakes: float = 0.0) -> Demonstration:
    """The family's expert solution of ``task`` as this harness's episode: each call written in the harness's
    syntax (and parsed back as the same call), run on the environment, its result rendered; then the final
    reply the harness's answer template writes. With ``mistakes`` > 0 the expert errs at that rate per turn and
    recovers (seeded by the task). Raises ``UserError`` when the harness cannot play it or the final state
    fails the verifier."""
    if family.expert is None or family.environment is None:
        raise UserError(f"family {family.name!r} has no expert demonstrations (or no environment)")
    session = Session(family.environment, task.payload, harness.tool_schemas)
    messages = [Message(role=role, content=content) for role, content in harness.prompt_messages(task.payload)]
    mistaken = set()
    for step, (name, arguments, mistake) in enumerate(family.expert(task.payload, mistakes,
                                                                    random.Random(f"mistakes:{task.id}")), start=1):
        text = render_call(harness, name, arguments)
        if parse_call(harness, text) != (name, arguments):
            raise UserError(f"the call {text!r} does not parse back as {name}{arguments}")
        call_id = f"call_{step}"
        if mistake:
            mistaken.add(len(messages))
        messages.append(Message(role="assistant", content=text,
                                tool_calls=(ToolCall(id=call_id, name=name, arguments=arguments),)))
        record = session.call(call_id, name, arguments)
        if isinstance(record.result, str) and record.result.startswith("error:"):
            raise UserError(f"the expert's call {text} failed: {record.result}")
        messages.append(Message(role="tool", content=harness.render_tool(
            task.payload, {"name": name, "arguments": arguments}, result_text(record.result)), tool_call_id=call_id))
    final = harness.render_answer(task.payload, task.answer)
    messages.append(Message(role="assistant", content=final))
    parsed = parse_reply(final, harness.document.answer)
    if not parsed.ok or not family.verify(task, {"state": session.state, "answer": parsed.value}):
        raise UserError(f"the expert's episode ends in a state the verifier rejects: {session.state}")
    return Demonstration(messages, session.records, frozenset(mistaken))
