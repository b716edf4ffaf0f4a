"""The stateful action substrate: an environment a task family declares, and the tools that act on it.

An environment's state is JSON data, made from a task's payload (``Environment.init``); its snapshot is the
state's canonical JSON and its hash the snapshot's digest. A tool is a deterministic function of (state,
arguments, context) that returns the new state and a result; the context gives it a random stream seeded from
the episode's initial snapshot and the call's number, and a frozen clock, so a replay of the same calls from
the same initial state gives the same results and state hashes, on any machine. Every call is logged as a
``ToolRecord``: call id, name, arguments, result, and the state hash before and after.

Tools touch only that state. A tool gets a copy of the state (it cannot keep a reference into the session's),
and while it runs an audit hook (``sys.addaudithook``) refuses file, network and process access, so a family
whose tool reaches outside its state fails loudly (``SubstrateViolation``) instead of making episodes that
depend on the machine.

A call the model gets wrong (a tool the harness does not expose, arguments outside the tool's JSON schema, a
value the tool refuses with ``ToolError``) still gets a logged result, ``error: <why>``, and leaves the state
as it was: the model sees what went wrong, and the auditor replays the same answer.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import random
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jsonschema

from rsi.errors import UserError
from rsi.hashing import canonical_json, digest
from rsi.models import ToolRecord

FROZEN_CLOCK = 1_700_000_000.0  # what ``Context.now`` says, in every episode (2023-11-14T22:13:20Z)
# Audit events a tool may not raise: file, network and process access (Python's audit events table).
_REFUSED = ("open", "os.", "socket.", "subprocess.", "shutil.", "urllib.", "http.", "ftplib.", "smtplib.",
            "ctypes.", "pty.", "sqlite3.", "glob.", "tempfile.", "webbrowser.")
_IN_TOOL: contextvars.ContextVar[str | None] = contextvars.ContextVar("rsi_substrate_tool", default=None)
_HOOKED = False


class ToolError(Exception):
    """A tool refuses its arguments (e.g. an index out of range): the call's result is ``error: <message>``
    and the state does not change."""


class SubstrateViolation(UserError):
    """A family's tool reached outside its state (files, network, processes): a bug in the family."""


@dataclass(frozen=True)
class Context:
    """What a tool may use besides the state and its arguments."""

    rng: random.Random
    now: float = FROZEN_CLOCK


ToolFn = Callable[[Any, dict[str, Any], Context], tuple[Any, Any]]  # (state, arguments, ctx) -> (state, result)


class Call(NamedTuple):
    """A tool call of an expert demonstration; ``mistake``: a wrong call the demonstration then mends (not a
    thing to imitate: the base is not trained on it)."""

    name: str
    arguments: dict[str, Any]
    mistake: bool = False


@dataclass(frozen=True)
class Environment:
    """What a family declares: how a task's payload becomes the initial state, and its tools by name."""

    init: Callable[[dict[str, Any]], Any]
    tools: Mapping[str, ToolFn] = field(default_factory=dict)


def snapshot(state: Any) -> str:
    """The state's canonical JSON (sorted keys, no whitespace): equal states have equal snapshots."""
    return canonical_json(state).decode()


def state_hash(state: Any) -> str:
    return "state-" + digest(state)[:24]


def result_text(result: Any) -> str:
    """How a tool result reads in a message: a string as it is, anything else as canonical JSON."""
    return result if isinstance(result, str) else snapshot(result)


def schema_problem(instance: Any, schema: dict[str, Any]) -> str:
    """Why ``instance`` does not match the JSON ``schema`` ('' when it does). The schema was checked when its
    harness was loaded; its validator is built once (building one checks the schema again, which took over 90 %
    of an audit's time when done per call)."""
    error = next(_validator(snapshot(schema)).iter_errors(instance), None)
    return "" if error is None else error.message


@functools.lru_cache(maxsize=256)
def _validator(schema_json: str) -> Any:
    schema = json.loads(schema_json)
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)


def _refuse_io(event: str, _args: tuple) -> None:
    tool = _IN_TOOL.get()
    if tool is not None and event.startswith(_REFUSED):
        raise SubstrateViolation(f"tool {tool!r} attempted {event!r}: tools act only on the environment's state "
                                 "(no files, network or processes); fix the family's tool")


def _install_hook() -> None:
    global _HOOKED
    if not _HOOKED:  # audit hooks cannot be removed: one, installed once, checks a context variable
        sys.addaudithook(_refuse_io)
        _HOOKED = True


@contextlib.contextmanager
def sandboxed(name: str) -> Iterator[None]:
    """Run code as a tool runs: file, network and process access inside raise ``SubstrateViolation`` naming
    ``name`` (a family's tool, or its interpreter: ``rsi.task_generators.programs``)."""
    _install_hook()
    token = _IN_TOOL.set(name)
    try:
        yield
    finally:
        _IN_TOOL.reset(token)


class Session:
    """One episode's environment: the state, and the log of every call made on it.

    ``schemas``: the JSON schema of each tool the harness exposes (name -> schema); a call to any other tool,
    or with arguments outside its schema, is answered with an error and changes nothing."""

    def __init__(self, env: Environment, payload: dict[str, Any], schemas: Mapping[str, dict[str, Any]]):
        self.env, self.schemas = env, dict(schemas)
        unknown = sorted(set(self.schemas) - set(env.tools))
        if unknown:
            raise UserError(f"the harness exposes tools {unknown} that the family does not declare "
                            f"(its tools: {', '.join(sorted(env.tools)) or 'none'})")
        self.state = _copy(env.init(payload))
        self.initial_hash = state_hash(self.state)
        self.records: list[ToolRecord] = []

    @property
    def hash(self) -> str:
        return state_hash(self.state)

    def call(self, call_id: str, name: str, arguments: dict[str, Any]) -> ToolRecord:
        """Run one call on the state and log it."""
        before = self.hash
        result = self._run(name, arguments)
        record = ToolRecord(call_id=call_id, name=name, arguments=arguments, result=result, state_before=before,
                            state_after=self.hash)
        self.records.append(record)
        return record

    def _run(self, name: str, arguments: dict[str, Any]) -> Any:
        if name not in self.schemas:
            return f"error: no tool {name!r} (tools: {', '.join(sorted(self.schemas)) or 'none'})"
        problem = schema_problem(arguments, self.schemas[name])
        if problem:
            return f"error: arguments of {name}: {problem}"
        rng = random.Random(digest(["rsi-tool-rng", self.initial_hash, len(self.records)]))
        try:
            with sandboxed(name):
                state, result = self.env.tools[name](_copy(self.state), _copy(arguments), Context(rng=rng))
        except ToolError as exc:
            return f"error: {exc}"
        self.state = _copy(state)
        return _copy(result)


def _copy(value: Any) -> Any:
    """A deep copy through JSON: what a tool gets and returns is plain data, never shared with the session."""
    try:
        return json.loads(canonical_json(value))
    except (TypeError, ValueError) as exc:
        raise UserError(f"environment state and tool results must be JSON data: {exc}") from None


def replay(env: Environment, payload: dict[str, Any], schemas: Mapping[str, dict[str, Any]],
           calls: list[tuple[str, str, dict[str, Any]]]) -> Session:
    """Run ``calls`` ((id, name, arguments), in order) from the payload's initial state: the session whose
    records a genuine episode must carry."""
    session = Session(env, payload, schemas)
    for call_id, name, arguments in calls:
        session.call(call_id, name, arguments)
    return session
