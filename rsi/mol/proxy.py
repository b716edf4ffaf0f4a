"""``rsi serve``: an OpenAI-compatible proxy that answers each user turn with one LoRA specialist.

Per request: check the bearer key and its rate limit; load the conversation (``conversation_id`` in the body or
the ``X-RSI-Conversation-Id`` header) and append the new messages; pick the turn's specialist (the model name
``rsi/<specialist>`` overrides, a tool result goes back to the specialist that made the call, else the router,
and below its confidence threshold the base model without adapter); answer from the specialist's own view of the
conversation; store the reply. The reply's ``model`` is ``rsi/<specialist>`` (``rsi/base`` for the base), and the
``X-RSI-Specialist`` header and the ``rsi`` field say who answered and why.

A completion-mode specialist (the built-in model) reads the current turn as its harness's episode would read:
``rsi.pair.text.transcript`` of the user's message, then its calls and the tool results, each result rendered
through the harness's ``tool_template``; a reply the pair reads as a call (``rsi.pair.Responder``) is a tool
call. Earlier turns stay in
the stored conversation, not in its view: its harness poses one task per episode. A chat-mode specialist reads
the conversation through its base's chat template: its own turns whole, the turns other specialists answered as
one summary line each run (``chat_view``); the stored conversation names who answered each turn. A specialist
whose harness has a plan (the demo's ``digit_chunks``) answers a message that poses one of its family's tasks
in the harness's format by running the plan, as its lineage was evaluated (``Responder.posed``, ``answer_task``).

Rate limits are a token bucket per key in the state DB, shared by every worker (``rsi.mol.state.RateLimits``);
key owners and champions are read from the DB at most every ``CACHE_S`` seconds, so a revoked key or a new
champion takes effect within that. A turn is stored before its reply goes out, by one writer thread that
commits every turn waiting in one transaction (``rsi.mol.state.ConversationWriter``); turns appended to one
conversation at once are stored one after the other (``append_messages`` retries across workers).

Engines: ``hf`` (default) decodes in a process of its own per base model (``rsi.mol.process``: the decode loop
does not wait on the proxy's interpreter lock), the specialists' adapters loaded by path into its adapter LRU,
concurrent requests with equal settings decoded in one batch (``rsi.mol.batching``); ``openai`` sends the same
calls to rsi's vLLM engine with runtime LoRA (``rsi.engine``; one base only; not covered by the tests here: it
needs the engine venv). The request handler holds a worker thread only for its state-DB and routing steps, and
only when one of them may wait (a stored conversation to read, champions to look up, a base to load, a router
that runs a model); never while its reply decodes.
Streaming (``stream: true``) on the ``openai`` engine passes the engine's text through as it comes, wherever the reply
is the model's text as written (the base model; a specialist whose harness has no tools and that is not answering
in plain words a task read from a person's message); a client that goes away cancels the engine's request, and
only a finished reply is stored. Elsewhere (the ``hf`` engine decodes whole replies; a reply that may be a call, or
is composed from the pair's answer) the finished reply goes out as OpenAI chunks.
"""


import asyncio
import json
import logging
import os
import threading
import time
import uuid
from collections import Counter
from functools import partial
from contextlib import asynccontextmanager
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rsi.errors import RuntimeFailure, UserError
from rsi.hcp.syntax import render_call
from rsi.models import Message, ToolCall
from rsi.mol.views import VIEWS, knows_own, own_prompt, posed_task
from rsi.mol.views import answered
from rsi.mol.streaming import Stream, streams
from rsi.pair import Reply, Responder

log = logging.getLogger(__name__)
CONFIG_ENV = "RSI_SERVE_CONFIG"  # the ServeConfig as JSON, for uvicorn workers started by import string
CONVERSATION_HEADER = "X-RSI-Conversation-Id"
SPECIALIST_HEADER = "X-RSI-Specialist"
BASE = "base"
RECORD = "rsi_record"  # a stored assistant message's key for how the pair made it (the proxy's own writing)
RESERVED = ("auto", BASE)  # model names of the proxy itself, never specialist names
# a turn as the proxy sends and stores it: message, finish reason, prompt and completion tokens, record (``turn``)
Answer = tuple[Message, str, int, int, dict[str, Any] | None]
# Bounds on a request: a message longer than any harness's prompt, or a history longer than any episode, is a
# client error (400), not minutes of n-gram counting and decoding while every other request waits.
MAX_MESSAGE_CHARS = 8192
MAX_MESSAGES = 256
MAX_BODY_BYTES = 1 << 20
CACHE_S = 2.0  # how long the proxy trusts what it read of keys and champions


class ServeConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    router: str = "ngram"
    threshold: float = Field(0.5, ge=0.0, le=1.0)
    engine: Literal["hf", "openai"] = "hf"
    rate: float = Field(5.0, gt=0, description="requests per second per key (token bucket refill)")
    burst: int = Field(20, ge=1, description="requests a key may send at once")
    max_tokens: int = Field(64, ge=1, description="reply length of the base model (no harness)")


# ---- the request ---------------------------------------------------------------------------------------------


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallIn(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(max_length=64)


class ToolSpec(BaseModel):
    """A tool a client offers: accepted where the answering specialist's harness exposes a tool of that name (the
    harness's own schema is what the model was trained on, so the client's is not read)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionSpec


class ContentPart(BaseModel):
    """One part of a message's content; the text parts are what the models read (others are refused)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str = Field(max_length=MAX_MESSAGE_CHARS)


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)] | Annotated[list[ContentPart], Field(max_length=64)] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: the text ones, joined
            return "".join(p.text for p in self.content)
        return self.content or ""

    def message(self) -> Message:
        """The message as rsi reads it (``rsi.models.Message``): text content, calls with their arguments parsed."""
        calls = tuple(ToolCall(id=c.id, name=c.function.name, arguments=_arguments(c.id, c.function.arguments))
                      for c in self.tool_calls or ())
        return Message(role=self.role, content=self.text(), tool_calls=calls, tool_call_id=self.tool_call_id)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = None


class ChatRequest(BaseModel):
    """The fields the proxy reads; others are ignored. ``tools``: the client runs the calls of the specialist it
    names (each a tool of the specialist's harness); a sampling field sent as null takes its default, as OpenAI's
    API does."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[MessageIn] = Field(min_length=1, max_length=MAX_MESSAGES)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(0.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    n: int | None = Field(1, ge=1, le=1)
    seed: int | None = 0
    stop: Annotated[str, Field(min_length=1, max_length=64)] | Annotated[
        list[Annotated[str, Field(min_length=1, max_length=64)]], Field(max_length=4)] | None = None
    conversation_id: str | None = Field(None, pattern=r"^conv-[0-9a-f]{32}$")
    tools: list[ToolSpec] | None = Field(None, max_length=64)

    @model_validator(mode="after")
    def _defaults(self) -> "ChatRequest":
        for name in ("stream", "temperature", "top_p", "n", "seed"):  # null: the default
            if getattr(self, name) is None:
                object.__setattr__(self, name, type(self).model_fields[name].default)
        return self

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ApiError(Exception):
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.headers = status, type_, param, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


# ---- messages: rsi.models.Message from the request to the reply; OpenAI's shape only at the HTTP and DB edges ------


def openai_message(m: Message) -> dict[str, Any]:
    """A message in OpenAI's shape (its calls' arguments as JSON strings), as the conversation stores it."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments":
                              json.dumps(c.arguments)}} for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def stored(m: dict[str, Any]) -> Message:
    """A stored message (OpenAI's shape) as a ``Message``."""
    calls = tuple(ToolCall(id=c["id"], name=c["function"]["name"], arguments=_arguments(c["id"], c["function"]["arguments"]))
                  for c in m.get("tool_calls") or ())
    return Message(role=m["role"], content=m.get("content") or "", tool_calls=calls, tool_call_id=m.get("tool_call_id"))


def same_message(a: Message, b: Message) -> bool:
    """Whether a resent message is a stored one (a tool-call turn by its call ids: clients send its content as null)."""
    ids = [[c.id for c in m.tool_calls] for m in (a, b)]
    same_content = bool(ids[0]) or a.content == b.content
    return ids[0] == ids[1] and a.role == b.role and same_content and (a.tool_call_id or None) == (b.tool_call_id or None)


def new_part(stored: list[Message], sent: list[Message]) -> list[Message]:
    """What a request adds to a stored conversation: a client may resend the whole history or only what is new."""
    if len(sent) >= len(stored) and all(same_message(a, b) for a, b in zip(stored, sent)):
        return sent[len(stored):]
    return sent


def call_specialist(call_id: str) -> str | None:
    """The specialist a tool call id names (``call_<specialist>_<hex>``, as this proxy writes them)."""
    if call_id.startswith("call_") and call_id.count("_") >= 2:
        return call_id[len("call_"):call_id.rindex("_")]
    return None


def view(harness: Any, messages: list[Message]) -> list[Message]:
    """A completion-mode specialist's view: the last user message and what followed it, tool results rendered
    through the harness's tool template, calls written in its syntax."""
    start = max((i for i, m in enumerate(messages) if m.role == "user"), default=None)
    if start is None:
        raise ApiError(400, "the conversation has no user message; send one with role 'user'", param="messages")
    calls: dict[str, ToolCall] = {}
    out = []
    for m in messages[start:]:
        if m.role == "assistant" and m.tool_calls:
            calls |= {c.id: c for c in m.tool_calls}
            try:
                text = m.content or "".join(render_call(harness, c.name, c.arguments) for c in m.tool_calls)
            except UserError as exc:  # a call the client made up: no such tool, or arguments it does not take
                raise ApiError(400, f"an assistant tool call cannot be shown to the specialist: {exc}",
                               param="messages") from None
            out.append(Message(role="assistant", content=text))
        elif m.role == "tool":
            if m.tool_call_id not in calls:
                raise ApiError(400, f"tool message for call {m.tool_call_id!r}: no assistant tool call with "
                               "that id precedes it in this turn", param="messages")
            call = calls[m.tool_call_id]
            try:
                content = harness.render_tool({}, {"name": call.name, "arguments": call.arguments}, m.content)
            except UserError as exc:
                raise ApiError(400, f"tool result of call {m.tool_call_id!r} cannot be shown to the "
                               f"specialist: {exc}", param="messages") from None
            out.append(Message(role="tool", content=content, tool_call_id=m.tool_call_id))
        elif m.role in ("user", "assistant"):
            out.append(Message(role=m.role, content=m.content))
    return out


def chat_view(messages: list[Message], specialists: list[str | None], me: str | None) -> list[Message]:
    """A chat-mode specialist's view: the conversation through its own turns, each run of turns another
    specialist answered replaced by a one-line summary (``[earlier: addition answered 2 turns]``) put before the
    next user message, so it neither reads nor imitates another adapter's replies. A turn is a user message and
    what follows it; its answerer is the specialist of its assistant messages."""
    turns: list[tuple[list[Message], str | None]] = []
    for m, who in zip(messages, specialists):
        if m.role == "user" or not turns:
            turns.append(([], None))
        turns[-1][0].append(m)
        if who is not None:
            turns[-1] = (turns[-1][0], who)
    out: list[Message] = []
    others: Counter[str] = Counter()
    for turn, who in turns:
        if who is not None and who != me and turn[0].role == "user":
            others[who] += 1
            continue
        for m in turn:
            content = m.content
            if others and m.role == "user":
                summary = ", ".join(f"{name} answered {n} turn{'s' * (n > 1)}" for name, n in others.items())
                content, others = f"[earlier: {summary}]\n{content}", Counter()
            out.append(Message(role=m.role, content=content, tool_call_id=m.tool_call_id))
    return out


def _arguments(call_id: str, text: str | None) -> dict[str, Any]:
    try:
        arguments = json.loads(text or "{}")
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"tool call {call_id!r}: function.arguments must be a JSON object string",
                       param="messages")
    return arguments


def viewed(champion: Any) -> Any:
    """The view that reads people's messages for a champion's family (``rsi.mol.views``), or None: a family
    without a view is served in its harness's format only. A chat-mode harness is viewed as any: its model too
    sees only its harness's prompts (its system prompt included), not a person's message as written."""
    return VIEWS.get(champion.harness.document.family)


def with_system(harness: Any, messages: list[Message]) -> list[Message]:
    """A chat-mode specialist's conversation led by its harness's system prompt (where the harness has one that
    reads no task, and the client sent no system message of its own): the instructions its lineage trained
    under, also where the client runs its tools turn by turn."""
    if harness.document.prompt.system_template is None or any(m.role == "system" for m in messages):
        return messages
    try:
        system = harness.render("system_template", {})
    except UserError:  # a system prompt written from the task: there is no task here to write it from
        return messages
    return [Message(role="system", content=system), *messages]


def no_chat_model(champions: dict[str, Any]) -> str:
    """The reply to a message no specialist reads where the base is no chat model: what each specialist reads."""
    asks = [f"{v.asks} (rsi/{name})" for name, c in champions.items() if (v := viewed(c)) is not None]
    return ("No specialist here reads a task in this message, and this server has no chat model to answer it"
            + (". Ask " + "; or ".join(asks) + "." if asks else "."))


def offered(tools: list[ToolSpec] | None, harness: Any, specialist: str | None) -> None:
    """A client's ``tools`` for a specialist: each must be a tool of its harness (the client then runs the calls
    itself, turn by turn); else a 400 naming the field."""
    for i, tool in enumerate(tools or ()):
        if tool.function.name not in harness.tool_schemas:
            known = ", ".join(sorted(harness.tool_schemas)) or "none"
            raise ApiError(400, f"tools[{i}].function.name: {tool.function.name!r} is not a tool of model "
                           f"'rsi/{specialist}' (its harness's tools: {known}); send only those, or leave tools out",
                           param=f"tools[{i}].function.name")


def specialist_params(harness: Any, max_tokens: int | None, temperature: float = 0.0, top_p: float = 1.0,
                      seed: int = 0, stop: tuple[str, ...] = ()) -> Any:
    """A specialist's sampling: its harness's decoding (its stop strings and the client's, reply length capped by
    its limits)."""
    from rsi.backends.base import SamplingParams

    doc = harness.document
    return SamplingParams(max_new_tokens=min(max_tokens or doc.decoding.max_new_tokens, doc.limits.max_completion_tokens),
                          temperature=temperature, top_p=top_p, seed=seed,
                          stop=tuple(dict.fromkeys((*doc.decoding.stop, *stop))))


# ---- the service: routing and answering, without HTTP ------------------------------------------------------------


class Service:
    """Specialists, router, backends and state DB behind the HTTP layer."""

    def __init__(self, config: ServeConfig, store: Any, home: Path) -> None:
        from rsi.mol.registry import Registry
        from rsi.mol.routers import load_router
        from rsi.mol.state import ConversationWriter, RateLimits, Recent

        self.config, self.store, self.home = config, store, Path(home)
        self.registry = Registry(store, self.home)
        self.router = load_router(config.router, self.home)
        self.limits = RateLimits(store, config.rate, config.burst)
        self.writer = ConversationWriter(store)
        self._recent = Recent(CACHE_S)
        self._backends: dict[Path, Any] = {}
        self._backends_lock = threading.Lock()  # concurrent first requests must not load a base twice
        self._loading: set[Path] = set()  # bases sent to be loaded in the background
        self._loading_lock = threading.Lock()
        self._started_engine = self._closed = False
        self._threads = ThreadPoolExecutor(64, thread_name_prefix="rsi-serve-backend")

    def owner(self, key: str, cached: bool = False) -> str | None:
        """The active key's name (remembered for ``CACHE_S``: a revocation reaches the proxy within it);
        ``cached``: only what is remembered, None if that would need the DB."""
        from rsi.mol.state import key_owner

        if cached:
            return self._recent.peek(("key", key))
        return self._recent.get(("key", key), lambda: key_owner(self.store, key))

    def champions(self, owner: str | None = None) -> dict[str, Any]:
        """The registry's champions the key named ``owner`` sees: the public ones and its own private ones (None:
        the public ones); remembered for ``CACHE_S``, so a promotion reaches the proxy within it. Every path of a
        request (the model name, the views, the router, a tool result, ``/v1/models``) reads only these."""
        from rsi.mol.registry import visible

        return visible(self._recent.get("champions", self.registry.champions), owner)

    def warm(self, owner: str | None = None) -> dict[str, Any] | None:
        """The champions ``owner`` sees (as ``champions``), when a turn can be routed and sent with them without
        waiting on anything (they are remembered, every one's base is loaded, the router runs no model), else
        None. A champion's base not yet loaded is sent to be loaded in the background (once), so a specialist no
        request has reached yet does not keep every request off this path."""
        from rsi.mol.registry import visible

        champions = self._recent.peek("champions")
        if not champions or self.router.decodes:
            return None
        missing = {c.base_dir for c in champions.values()} - self._backends.keys()
        if missing:
            with self._loading_lock:
                missing -= self._loading
                self._loading |= missing
            for base_dir in missing:
                self._threads.submit(self._preload, base_dir)
            return None
        return visible(champions, owner)

    def _preload(self, base_dir: Path) -> None:
        try:
            self.backend(base_dir)
        except Exception:  # a request routed to it gets the error; nothing else is held up
            log.exception("cannot load the base model %s in the background", base_dir)

    def backend(self, base_dir: Path) -> Any:
        with self._backends_lock:
            if self._closed:
                raise RuntimeError("the proxy is shutting down")
            if base_dir not in self._backends:
                from rsi.backends import get_backend

                if self.config.engine == "openai":
                    from rsi import engine

                    if self._backends:
                        raise UserError("the openai engine serves one base model; every specialist must share it")
                    state = engine.start(base_dir, self.home)
                    self._started_engine = "already running" not in (state.note or "")
                    self._backends[base_dir] = get_backend("openai", base_url=state.base_url, tokenizer_dir=base_dir)
                else:  # its own process, concurrent requests decoded together (rsi.mol.process, .batching)
                    from rsi.mol.process import EngineProcess

                    self._backends[base_dir] = EngineProcess("hf", model_dir=base_dir)
            return self._backends[base_dir]

    def close(self) -> None:
        """Stop the engines this service started (the hf engine processes, the vLLM engine) and free the DB."""
        with self._backends_lock:
            backends, self._backends, self._closed = list(self._backends.items()), {}, True
        for base_dir, backend in backends:
            backend.close()
        self.writer.close()
        if self._started_engine:  # a vLLM engine that was running before the proxy stays running
            from rsi import engine

            engine.stop(self.home)
        self.store.dispose()

    def choose(self, model: str, messages: list[Message], specialists: list[str | None],
               champions: dict[str, Any]) -> Any:
        """The turn's route: model-name override, tool-call stickiness, else the router."""
        from rsi.mol.routers import Route, decide

        name = model.removeprefix("rsi/")
        if not model.startswith("rsi/"):  # another service's name (or another tenant's): never answered by one here
            raise ApiError(404, f"model {model!r} does not exist; models: {', '.join(self.model_ids(champions))}",
                           param="model", code="model_not_found")
        if name not in ("auto",):
            if name == BASE:
                if messages[-1].role == "tool":
                    raise ApiError(400, "model 'rsi/base' makes no tool calls, so it takes no tool result; send the "
                                   "result with model 'rsi/auto' or the specialist that made the call", param="model")
                return Route(specialist=None, confidence=1.0, scores={}, router="override", reason="model name")
            if name not in champions:
                raise ApiError(404, f"model {model!r} does not exist; models: {', '.join(self.model_ids(champions))}",
                               param="model", code="model_not_found")
            return Route(specialist=name, confidence=1.0, scores={}, router="override", reason="model name")
        last = messages[-1]
        if last.role == "tool":
            for m, who in zip(reversed(messages), reversed(specialists)):
                if m.role == "assistant" and last.tool_call_id in [c.id for c in m.tool_calls]:
                    owner = who or call_specialist(last.tool_call_id)
                    if owner in champions:
                        return Route(specialist=owner, confidence=1.0, scores={}, router="sticky",
                                     reason="tool result goes back to the specialist that made the call")
            raise ApiError(400, f"tool result for call {last.tool_call_id!r}: no serving specialist made that "
                           "call in this conversation (send its assistant tool-call message first, or continue the "
                           "conversation it belongs to with its conversation_id)", param="messages")
        user = next((m for m in reversed(messages) if m.role == "user"), None)
        if user is None:
            raise ApiError(400, "the conversation has no user message; send one with role 'user'", param="messages")
        text = user.content
        own = [name for name, champ in champions.items() if own_prompt(champ, text)]
        readers = [] if own else [name for name, champ in champions.items()
                                  if (v := viewed(champ)) is not None and v.read(text) is not None]
        if len(readers) == 1:
            return Route(specialist=readers[0], confidence=1.0, scores={}, router="view",
                         reason="its view reads the message as a task of its family")
        route = decide(self.router, text, readers or list(champions), 0.0 if readers else self.config.threshold)
        picked = champions.get(route.specialist) if route.specialist else None
        if picked is not None and not own and not readers and viewed(picked) is not None and knows_own(picked):
            # a message that is not the specialist's own prompt and that no view reads never reaches its raw format
            return Route(specialist=None, confidence=route.confidence, scores=route.scores, router=route.router,
                         reason=f"no specialist's view reads a task in the message ({route.specialist} scored "
                         "highest): the base answers")
        return route

    @staticmethod
    def model_ids(champions: dict[str, Any]) -> list[str]:
        return ["rsi/auto", *[f"rsi/{n}" for n in champions], f"rsi/{BASE}"]

    def answer(self, route: Any, champions: dict[str, Any], messages: list[Message], req: ChatRequest,
               specialists: list[str | None]) -> tuple[Message, str, int, int]:
        """(assistant message, finish reason, prompt tokens, completion tokens) of the routed model."""
        future, finish = self.begin_answer(route, champions, messages, req, specialists)
        return finish(future.result())[:4]

    def begin_answer(self, route: Any, champions: dict[str, Any], messages: list[Message], req: ChatRequest,
                     specialists: list[str | None]) -> tuple[Future | Stream, Callable[[Any], Answer]]:
        """The routed model's call, sent: (a future of its completions, or the ``Stream`` the response will pass
        through, and the function that makes its completions ``answer``'s tuple). The HTTP handler awaits the
        future without holding a thread while the engine decodes."""
        from rsi.backends.base import SamplingParams

        wanted = req.max_completion_tokens or req.max_tokens
        champion = champions.get(route.specialist) if route.specialist else None
        if champion is None and req.tools:
            raise ApiError(400, "tools: the base model ('rsi/base') makes no tool calls; send tools to the specialist "
                           "whose harness has them, or leave tools out", param="tools")
        if champion is None and route.router != "override" and champions and \
                not any(c.harness.chat for c in champions.values()):
            # routed away from every specialist, and the base is no chat model (rsi's built-in writes digits):
            # a clear refusal, not its noise; `rsi/base` by name still gets the base
            done: Future = Future()
            done.set_result(Reply(Message(role="assistant", content=no_chat_model(champions)), "stop", 0, 0))
            return done, turn
        if champion is None:  # the base model, no adapter, no harness
            if not champions:
                raise ApiError(503, "no specialist has a promoted champion, so there is no base model to serve",
                               type_="server_error")
            params = SamplingParams(max_new_tokens=min(wanted or self.config.max_tokens, self.config.max_tokens),
                                    temperature=req.temperature, top_p=req.top_p, seed=req.seed, stop=req.stops())
            chatting = next((c for c in champions.values() if c.harness.chat), None)
            if chatting is not None:  # a chat model: the conversation through its chat template, as the base sees it
                future = self._call(self.backend(chatting.base_dir), "chat",
                                    [chat_view(messages, specialists, BASE)], params, None, stream=bool(req.stream))
                return future, lambda out: _plain(out[0][0])
            user = next(m for m in reversed(messages) if m.role == "user")  # no chat model: the last user message
            base_dir = next(iter(champions.values())).base_dir
            future = self._call(self.backend(base_dir), "generate", [user.content or " "], params, None,
                                stream=bool(req.stream))
            return future, lambda out: _plain(out[0][0])
        harness = champion.harness
        params = specialist_params(harness, wanted, req.temperature, req.top_p, req.seed, req.stops())
        pair = Responder(harness, self.backend(champion.base_dir), champion.pair_id, champion.adapter_dir)
        offered(req.tools, harness, route.specialist)
        plain, last = viewed(champion), messages[-1]
        if plain is not None and last.role == "user" and not req.tools and not own_prompt(champion, last.content):
            try:  # a person's message: the task it poses, answered in plain words
                task = posed_task(plain, pair, last.content)
            except UserError as exc:
                raise ApiError(400, f"{exc}; send a shorter task", param="messages", code="task_not_posable") from None
            if task is not None:
                return self._threads.submit(answered, plain, pair, task, params), lambda out: turn(*out)
            if knows_own(champion):
                raise ApiError(400, f"model 'rsi/{route.specialist}' answers {plain.asks}, and this message poses "
                               f"none; send it to 'rsi/auto' (which gives it to the base model when no specialist "
                               "reads it) or 'rsi/base'", param="messages", code="no_task")
        task = pair.posed(messages[-1]) if harness.document.plan else None
        if task is not None:  # the champion's harness answers it by its plan, call after call
            return self._threads.submit(pair.answer_task, task, params), turn
        convo = (with_system(harness, chat_view(messages, specialists, route.specialist)) if harness.chat
                 else view(harness, messages))
        mode, items = pair.request([convo])
        # a harness without tools replies in text only: its text can go out as the engine writes it
        future = self._call(pair.backend, mode, items, params, pair.adapter, harness.chat_tools,
                            stream=bool(req.stream) and not harness.document.tools)

        def call_id(j: int, n: int) -> str:  # the id names the specialist, so its result finds it again
            return f"call_{route.specialist}_{uuid.uuid4().hex[:12]}"

        return future, lambda completions: turn(pair.reply(completions[0][0], call_id))

    def _call(self, backend: Any, mode: str, items: list[Any], params: Any, adapter: str | None, tools: Any = (),
              stream: bool = False) -> Future | Stream:
        """The engine call of one reply: a ``Stream`` where the reply may go out as it is decoded (``stream``
        asked, and a backend that streams: rsi's vLLM engine), else sent now (``_submit``)."""
        if stream and streams(backend):
            return Stream(backend, mode, items[0], params, adapter)
        return self._submit(backend, mode, items, params, adapter, tools)

    def _submit(self, backend: Any, mode: str, items: list[Any], params: Any, adapter: str | None,
                tools: Any = ()) -> Future:
        """A backend call as a future: queued where the backend queues (``rsi.mol.batching.Submitter``), else run
        on the service's threads (the openai backend: its HTTP call; the vLLM server batches concurrent ones)."""
        from rsi.mol.batching import Submitter

        if isinstance(backend, Submitter):
            return backend.submit(mode, items, params, adapter, tools)
        if mode == "chat":
            return self._threads.submit(backend.chat, items, tools, params, adapter=adapter)
        return self._threads.submit(backend.generate, items, params, adapter=adapter)


def turn(reply: Reply, record: dict[str, Any] | None = None) -> Answer:
    """A turn of the pair as the proxy sends and stores it: the assistant message, the finish reason, prompt and
    completion tokens, and what the proxy keeps of how the pair made it (``rsi.mol.views.answered``: stored with
    the message, never sent)."""
    return reply.message, reply.finish_reason, reply.prompt_tokens, reply.completion_tokens, record


def _plain(out: Any) -> Answer:
    return (Message(role="assistant", content=out.text), out.finish_reason, out.prompt_tokens, out.completion_tokens,
            None)


# ---- HTTP ----------------------------------------------------------------------------------------------------


def create_app(config: ServeConfig | None = None, store: Any = None, home: Path | None = None):
    """The ASGI app (FastAPI, its chat route called directly: ``Proxy``); with no arguments (a uvicorn worker) its
    config comes from ``RSI_SERVE_CONFIG``."""
    from fastapi import FastAPI, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
    from starlette.exceptions import HTTPException

    from rsi.config import get_settings
    from rsi.mol import state
    from rsi.store import open_store

    config = config or ServeConfig.model_validate_json(os.environ.get(CONFIG_ENV, "{}"))
    home = home or get_settings().home
    store = store or open_store()
    _sync_at_checkpoints(store)
    service = Service(config, store, home)
    metrics = CollectorRegistry()
    requests = Counter("rsi_serve_requests", "HTTP requests by path and status", ["path", "status"], registry=metrics)
    routed = Counter("rsi_serve_routed_turns", "turns answered, by specialist and how it was chosen",
                     ["specialist", "router"], registry=metrics)
    routing_s = Histogram("rsi_serve_routing_seconds", "time to pick a specialist", registry=metrics)
    answer_s = Histogram("rsi_serve_answer_seconds", "time to generate a reply", registry=metrics)
    tokens = Counter("rsi_serve_tokens", "tokens, by kind", ["kind"], registry=metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:  # the champions' engines start loading in the background (warm loads private ones' bases too)
            await run_in_threadpool(lambda: (service.champions(), service.warm()))
        except Exception:  # a request meets the problem and gets its error; the proxy still starts
            log.exception("cannot read the specialists at startup")
        yield
        service.close()  # the engine processes (and a vLLM engine the proxy started) stop with the proxy

    app = FastAPI(title="rsi Mixture-of-LoRA proxy", lifespan=lifespan)

    def error(exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(_validation_error(exc.errors()))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return error(ApiError(exc.status_code, str(exc.detail), code=str(exc.status_code)))

    @app.exception_handler(UserError)
    async def _user(request: Request, exc: UserError) -> JSONResponse:
        # what a request does wrong is an ApiError; a UserError here is the server's setup (a missing base, an
        # engine that would not start): the operator's to fix, logged in full, its paths not shown to clients
        log.error("cannot serve %s: %s", request.url.path, exc)
        return error(ApiError(503, "the proxy cannot serve this request: a problem with its setup (the proxy's log "
                              "says which)", type_="server_error", code="service_unavailable"))

    def unexpected(exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return error(ApiError(500, f"internal error ({type(exc).__name__}); see the proxy's log", type_="server_error"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return unexpected(exc)

    async def guarded(scope: dict, receive: Any, send: Any, inner: Any, route: str | None = None) -> None:
        """Refuse an oversized body before reading it; count the response by its route (a made-up path is
        'other', so the metric's series stay bounded), 500s included."""
        size = dict(scope["headers"]).get(b"content-length", b"0")
        status, started = 500, False

        async def sending(message: dict) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        if not size.isdigit() or int(size) > MAX_BODY_BYTES:
            status = 413
            await error(ApiError(413, f"request body over {MAX_BODY_BYTES} bytes (or no valid Content-Length); "
                                 "send fewer or shorter messages", code="request_too_large"))(scope, receive, send)
        else:
            try:
                await inner(scope, receive, sending)
            except Exception as exc:  # raised past the handlers: still an OpenAI-style 500, and counted
                if started:
                    raise
                await unexpected(exc)(scope, receive, send)
        requests.labels(route or getattr(scope.get("route"), "path", "other"), str(status)).inc()

    class Guard:
        """``guarded`` as FastAPI's middleware, for the routes FastAPI serves. Plain ASGI, not
        ``@app.middleware``: Starlette's request/response middleware costs each request a task and a stream."""

        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return await self.app(scope, receive, send)
            await guarded(scope, receive, send, self.app)

    app.add_middleware(Guard)

    async def chat_endpoint(scope: dict, receive: Any, send: Any) -> None:
        request = Request(scope, receive)
        try:
            response = await chat_completions(request)
        except ApiError as exc:
            response = error(exc)
        except UserError as exc:
            response = await _user(request, exc)
        await response(scope, receive, send)

    class Proxy:
        """The app uvicorn runs: ``POST /v1/chat/completions`` straight to its handler (its errors answered by the
        same handlers), everything else through FastAPI, whose middleware, routing and dependency layers would
        otherwise run on every chat request's path, between the engine's reply and the client."""

        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == "/v1/chat/completions":
                await guarded(scope, receive, send, chat_endpoint, "/v1/chat/completions")
            else:
                await self.app(scope, receive, send)

    def bearer(request: Request) -> str:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        return key.strip() if scheme.lower() == "bearer" else ""

    def owner_now(request: Request) -> str | None:
        """The key's owner when neither the key nor the rate limit needs the state DB (a remembered key, a
        token left in this worker's lease), on the event loop; else None, and ``owner_of`` on a thread."""
        key = bearer(request)
        owner = service.owner(key, cached=True) if key else None
        return owner if owner is not None and service.limits.take_leased(owner) else None

    def owner_of(request: Request) -> str:
        key = bearer(request)
        owner = service.owner(key) if key else None
        if owner is None:
            raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' with a key from "
                           "`rsi keys create NAME`", type_="authentication_error", code="invalid_api_key")
        wait = service.limits.take(owner)
        if wait > 0:
            raise ApiError(429, f"rate limit of key {owner!r} exceeded ({config.rate}/s, burst {config.burst}); "
                           f"retry in {wait:.2f} s", type_="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(max(1, round(wait)))})
        return owner

    @app.get("/health")
    def health() -> dict[str, Any]:  # a worker thread: no request holds one while its reply decodes
        # no key is asked here, so only public specialists are named
        return {"status": "ok", "specialists": sorted(service.champions()), "router": config.router,
                "not_served": sorted(service.registry.broken())}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    def models(request: Request) -> dict[str, Any]:
        champions = service.champions(owner_of(request))
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "rsi"}
                                           for m in service.model_ids(champions)]}

    def begin(req: ChatRequest, owner: str, conversation_id: str | None, champions: dict[str, Any] | None = None
              ) -> tuple:
        """The state-DB and routing half of a request: the conversation, the route, the engine call sent."""
        continued = bool(conversation_id)
        sent = [m.message() for m in req.messages]
        if continued:
            try:
                history = [(stored(m), who) for m, who in state.conversation_messages(store, conversation_id, owner)]
            except LookupError:
                raise ApiError(404, f"conversation {conversation_id!r} does not exist for this key; omit "
                               "conversation_id to start one", param="conversation_id",
                               code="conversation_not_found") from None
        else:  # stored with its first turn, in one transaction
            conversation_id, history = state.new_conversation_id(), []
        added = new_part([m for m, _ in history], sent)
        if not added or added[-1].role not in ("user", "tool"):
            raise ApiError(400, "the last message must be a user message or a tool result", param="messages")
        messages = [m for m, _ in history] + added
        specialists = [who for _, who in history] + [None] * len(added)
        started = time.perf_counter()
        champions = champions or service.champions(owner)
        route = service.choose(req.model, messages, specialists, champions)
        routing_s.observe(time.perf_counter() - started)
        future, finish = service.begin_answer(route, champions, messages, req, specialists)
        return conversation_id, continued, added, route, future, finish, champions

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        clock = [time.perf_counter()]

        def lap() -> float:
            clock.append(time.perf_counter())
            return clock[-1] - clock[-2]

        owner = owner_now(request) or await run_in_threadpool(owner_of, request)  # 401 before the body is read
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            raise ApiError(400, f"the request body is not valid JSON ({exc}); send a JSON object") from None
        except RecursionError:
            raise ApiError(400, "the request body nests JSON arrays or objects too deeply to read; send the "
                           "chat request's flat shape") from None
        try:
            req = ChatRequest.model_validate(body)
        except ValidationError as exc:
            raise _validation_error(exc.errors()) from None
        times = {"auth": lap()}
        conversation_id = req.conversation_id or request.headers.get(CONVERSATION_HEADER)
        champions = None if conversation_id else service.warm(owner)
        if champions is not None:  # a new conversation, nothing to wait for: on the event loop, no thread hop
            prepared = begin(req, owner, None, champions)
        else:  # a stored conversation to read, a base to load, or a router that decodes: on a worker thread
            prepared = await run_in_threadpool(begin, req, owner, conversation_id)
        conversation_id, continued, added, route, future, finish, champions = prepared
        times["prepare"] = lap()
        who = route.specialist or BASE
        info = {"specialist": who, "confidence": route.confidence, "router": route.router, "reason": route.reason,
                "conversation_id": conversation_id}
        completion_id, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), f"rsi/{who}"
        event = partial(_event, completion_id, created, model, info)

        async def keep(answer: Answer) -> dict[str, int]:
            """Store the turn and count it; its usage. The turn is stored before the reply (or, streamed, its
            end) goes out: a client that has the reply finds it in the conversation."""
            reply, _, prompt_tokens, completion_tokens, record = answer
            turn = [(openai_message(m), None) for m in added] + [
                (openai_message(reply) | ({RECORD: record} if record else {}), who)]
            try:
                await asyncio.wrap_future(service.writer.append(conversation_id, turn) if continued
                                          else service.writer.start(conversation_id, owner, turn))
            except LookupError:  # deleted (`rsi conversations prune`) while the turn was answered
                raise ApiError(404, f"conversation {conversation_id!r} was deleted while this turn was answered; "
                               "omit conversation_id to start a new one", param="conversation_id",
                               code="conversation_not_found") from None
            # /metrics is read without a key: a specialist private to a key is counted, never named
            public = who == BASE or (who in champions and champions[who].specialist.owner_key is None)
            routed.labels(who if public else "private", route.router).inc()
            tokens.labels("prompt").inc(prompt_tokens)
            tokens.labels("completion").inc(completion_tokens)
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens}

        def turn_headers() -> dict[str, str]:  # who answered, and where the request's time went (so far)
            return {CONVERSATION_HEADER: conversation_id, SPECIALIST_HEADER: who,
                    "Server-Timing": ", ".join(f"{k};dur={1000 * v:.2f}" for k, v in times.items())}

        if isinstance(future, Stream):  # the engine's text passed through as it comes; the turn stored at its end
            async def passed() -> Any:
                yield event({"role": "assistant", "content": ""})
                try:
                    async for piece in future.pieces():
                        if isinstance(piece, str):
                            yield event({"content": piece})
                        else:
                            answer = finish([[piece]])
                except (UserError, RuntimeFailure) as exc:  # the status is sent: the error is the last event
                    log.error("a streamed reply broke off: %s", exc)
                    broke = ApiError(502, "the engine broke off this reply; ask again", type_="server_error",
                                     code="engine_error")
                    yield f"data: {json.dumps(broke.body())}\n\n"
                    return
                answer_s.observe(times["prepare"] + lap())
                try:
                    usage = await keep(answer)
                except ApiError as exc:  # the status is sent: the error goes as the stream's last event
                    yield f"data: {json.dumps(exc.body())}\n\n"
                    return
                yield event({}, answer[1])
                if req.include_usage():
                    yield event(None, usage=usage)
                yield "data: [DONE]\n\n"

            return PassedThrough(passed(), media_type="text/event-stream", headers=turn_headers())
        answer = finish(await asyncio.wrap_future(future))
        times["engine"] = lap()
        answer_s.observe(times["prepare"] + times["engine"])
        usage = await keep(answer)
        times["store"] = lap()
        reply, finish_reason = answer[0], answer[1]
        headers = turn_headers()
        if req.stream:
            return StreamingResponse(_chunks(event, reply, finish_reason, usage if req.include_usage() else None),
                                     media_type="text/event-stream", headers=headers)
        message = openai_message(reply)
        if reply.tool_calls:  # the text the model wrote for its calls is the proxy's; a client reads the calls
            message["content"] = None
        body = {"id": completion_id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
                "usage": usage, "conversation_id": conversation_id, "rsi": info}
        return JSONResponse(body, headers=headers)

    class PassedThrough(StreamingResponse):
        """A stream that notices a client gone while the engine decodes, not only at the next piece sent (uvicorn
        speaks ASGI 2.4, where Starlette's stream learns of it only from a failed send): the stream is cancelled,
        and with it the engine's request (``Stream``)."""

        async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
            import anyio

            async with anyio.create_task_group() as group:
                async def respond() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-send
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(respond)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()

    return Proxy(app)


def _sync_at_checkpoints(store: Any) -> None:
    """SQLite in WAL mode with ``synchronous=NORMAL`` on the proxy's connections: a commit no longer waits for
    an fsync (4 ms of each request's 2 writes on this machine's disk); a killed proxy still loses nothing
    committed, only a power loss may drop the last turns (SQLite's documented WAL trade-off)."""
    from sqlalchemy import event

    if store.engine.dialect.name == "sqlite":
        event.listen(store.engine, "connect", lambda conn, _: conn.execute("PRAGMA synchronous=NORMAL"))
        store.engine.dispose()  # connections opened before the listener get it when opened again


def _event(completion_id: str, created: int, model: str, info: dict[str, Any], delta: dict[str, Any] | None,
           finish_reason: str | None = None, **extra: Any) -> str:
    """One OpenAI ``chat.completion.chunk`` server-sent event (``delta`` None: a chunk with no choices)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
    chunk = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices, **extra, "conversation_id": info["conversation_id"], "rsi": info}
    return f"data: {json.dumps(chunk)}\n\n"


def _chunks(event: Callable[..., str], reply: Message, finish: str, usage: dict[str, int] | None = None):
    """A finished reply as server-sent events (``_event``; an engine that does not stream: the hf engine decodes
    whole replies), ending with ``data: [DONE]``; with ``usage`` (``stream_options.include_usage``) a last chunk
    with no choices carries it."""
    yield event({"role": "assistant", "content": ""})
    if reply.tool_calls:
        yield event({"tool_calls": [{"index": i, **c} for i, c in enumerate(openai_message(reply)["tool_calls"])]})
    else:
        text = reply.content
        for i in range(0, len(text), 4):
            yield event({"content": text[i:i + 4]})
    yield event({}, finish)
    if usage is not None:
        yield event(None, usage=usage)
    yield "data: [DONE]\n\n"


def _validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """The first problem of a request body, named by its field, as a 400."""
    first = errors[0]
    # the path of the field, without pydantic's names of union branches ('constrained-str', 'list[ContentPart]')
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and (isinstance(p, int) or str(p).isidentifier())
           and p != "str"]
    field = ".".join(loc) or "body"
    return ApiError(400, f"invalid request: field {field!r}: {first.get('msg', 'invalid')}"
                    + (" (n > 1 is not supported: one reply per request)" if loc == ["n"] else ""), param=field)
