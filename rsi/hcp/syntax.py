"""How a harness's model writes what rsi reads: a tool call in the harness's ``[tool_calls] syntax`` (rendered
and parsed back), and a final reply read by the harness's answer parser (``[answer]``)."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from rsi.errors import UserError
from rsi.parsers import Parsed, get_parser

if TYPE_CHECKING:
    from rsi.hcp.document import Answer
    from rsi.hcp.harness import Harness

_PYTHON_CALL = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\((.*)\)$", re.DOTALL)


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


def parse_reply(text: str, answer: Answer) -> Parsed:
    """Parse the reply; a parser that raises yields a failed parse with the reason, not an exception."""
    try:
        return get_parser(answer.parser)(text, **answer.params)
    except Exception as exc:  # noqa: BLE001 - any parser failure is a judgement, not a crash
        return Parsed(ok=False, error=f"parser {answer.parser!r} raised {type(exc).__name__}: {exc}")
