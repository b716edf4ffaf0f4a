"""Answer parsers named by a harness's ``[answer] parser``: completion text -> value, or a reason it failed.

A parser reads the answer at the start of the completion and reports what follows it as ``extra``,
so the auditor can judge the format and the extra content as separate rules.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from rsi.errors import UserError


class Parsed(BaseModel):
    model_config = ConfigDict(frozen=True)

    ok: bool
    value: Any = None
    extra: str = ""
    error: str = ""


Parser = Callable[..., Parsed]
PARSERS: dict[str, tuple[Parser, set[str]]] = {}


def parser(name: str, params: set[str]) -> Callable[[Parser], Parser]:
    """Register an answer parser under ``name``, accepting exactly the keyword ``params``."""

    def register(fn: Parser) -> Parser:
        PARSERS[name] = (fn, params)
        return fn

    return register


@parser("integer", params=set())
def parse_integer(text: str) -> Parsed:
    """A decimal integer, most significant digit first, optional sign."""
    m = re.match(r"-?\d+", text)
    if m is None:
        return Parsed(ok=False, error=f"expected an integer, got {text[:20]!r}")
    return Parsed(ok=True, value=int(m.group()), extra=text[m.end():])


@parser("reversed_digits", params={"width"})
def parse_reversed_digits(text: str, width: int) -> Parsed:
    """Exactly ``width`` digits, least significant first (zero-padded): '5700' with width 4 is 75."""
    head = text[:width]
    if len(head) < width or not head.isdigit():
        return Parsed(ok=False, error=f"expected {width} digits, got {head!r}")
    return Parsed(ok=True, value=int(head[::-1]), extra=text[width:])


def get_parser(name: str) -> Parser:
    if name not in PARSERS:
        raise UserError(f"unknown answer parser {name!r}; known parsers: {', '.join(sorted(PARSERS))}")
    return PARSERS[name][0]


def digits_lsb(value: int, width: int) -> str:
    """Jinja filter: ``value`` written least significant digit first, zero-padded to ``width``."""
    text = str(int(value))
    if text.startswith("-") or len(text) > width:
        raise ValueError(f"{value} does not fit {width} unsigned digits")
    return text[::-1].ljust(width, "0")
