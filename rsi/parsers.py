"""Answer parsers named by a harness's ``[answer] parser``: completion text -> value, or a reason it failed.

A parser reads the answer at the start of the completion and reports what follows it as ``extra``,
so the auditor can judge the format and the extra content as separate rules. A parser never raises:
any text, however odd, is a ``Parsed`` (ok or not, with a reason). Digits are ASCII ``0-9`` only;
other Unicode digits ('٣', '²', '３') are a failed parse, not a number.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from rsi import plugins
from rsi.errors import UserError

ASCII_DIGITS = frozenset("0123456789")
MAX_DIGITS = 4000  # below Python's int-from-text limit (4300), which would raise instead of failing


class Parsed(BaseModel):
    model_config = ConfigDict(frozen=True)

    ok: bool
    value: Any = None
    extra: str = ""
    error: str = ""


class Params(BaseModel):
    """Base of a parser's parameters (``[answer] params``): typed, strict, no unknown keys."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class NoParams(Params):
    pass


class ReversedDigitsParams(Params):
    width: int = Field(ge=1, le=MAX_DIGITS, description="digits in the answer, least significant first")


class FramedIntegerParams(Params):
    prefix: str = Field(description="the text before the integer, e.g. 'The answer is '")
    suffix: str = Field("", description="the text after it, e.g. '.'")


class WorkedParams(Params):
    separator: str = Field(" | ", min_length=1, description="what separates the steps of the worked answer")


class WordParams(Params):
    words: list[str] = Field(min_length=1, description="the replies that count, e.g. ['done']")


Parser = Callable[..., Parsed]


class ParserSpec(NamedTuple):
    """A registered parser: the function and the model its keyword parameters validate against."""

    fn: Parser
    params: type[Params]


PARSERS: dict[str, ParserSpec] = plugins.registry("parser")  # the live registry: rsi's own, others' once loaded


def parser(name: str, params: type[Params] = NoParams) -> Callable[[Parser], Parser]:
    """Register an answer parser under ``name`` (``rsi.plugins`` kind "parser"; another package registers a
    ``ParserSpec`` by entry point in ``rsi.parsers``); its keyword parameters are the fields of ``params``."""

    def register(fn: Parser) -> Parser:
        plugins.add("parser", name, ParserSpec(fn, params))
        return fn

    return register


def _non_ascii_digit(text: str) -> str:
    """A reason naming the first non-ASCII digit in ``text``, or '' if there is none."""
    for i, ch in enumerate(text):
        if ch.isdigit() and ch not in ASCII_DIGITS:
            return f"non-ASCII digit {ch!r} (U+{ord(ch):04X}) at position {i}; only 0-9 count"
    return ""


@parser("integer")
def parse_integer(text: str) -> Parsed:
    """A decimal integer in ASCII digits, most significant digit first, optional '-'."""
    m = re.match(r"-?[0-9]+", text)
    if m is None:
        reason = _non_ascii_digit(text[:2])
        return Parsed(ok=False, error=reason or f"expected an integer, got {text[:20]!r}")
    if len(m.group()) > MAX_DIGITS:
        return Parsed(ok=False, error=f"integer of more than {MAX_DIGITS} digits")
    return Parsed(ok=True, value=int(m.group()), extra=text[m.end():])


@parser("reversed_digits", ReversedDigitsParams)
def parse_reversed_digits(text: str, width: int) -> Parsed:
    """Exactly ``width`` ASCII digits, least significant first (zero-padded): '5700' with width 4 is 75."""
    if not 1 <= width <= MAX_DIGITS:
        return Parsed(ok=False, error=f"width {width} is outside 1..{MAX_DIGITS}")
    head = text[:width]
    if len(head) < width or not set(head) <= ASCII_DIGITS:
        reason = _non_ascii_digit(head)
        return Parsed(ok=False, error=reason or f"expected {width} digits, got {head!r}")
    return Parsed(ok=True, value=int(head[::-1]), extra=text[width:])


@parser("framed_integer", FramedIntegerParams)
def parse_framed_integer(text: str, prefix: str, suffix: str = "") -> Parsed:
    """``prefix``, a decimal integer (as ``integer`` reads it), then ``suffix``: the sentence a chat model
    answers in, e.g. 'The answer is 46.'."""
    if not text.startswith(prefix):
        return Parsed(ok=False, error=f"expected {prefix!r} first, got {text[:len(prefix) + 10]!r}")
    number = parse_integer(text[len(prefix):])
    if not number.ok:
        return number
    if not number.extra.startswith(suffix):
        return Parsed(ok=False, error=f"expected {suffix!r} after the integer, got {number.extra[:20]!r}")
    return Parsed(ok=True, value=number.value, extra=number.extra[len(suffix):])


@parser("word", WordParams)
def parse_word(text: str, words: list[str]) -> Parsed:
    """One of ``words`` at the start of the reply (the longest that matches): a final reply that only says the
    episode is over, e.g. 'done' (a tool family's verifier judges the final state)."""
    for word in sorted(words, key=len, reverse=True):
        if word and text.startswith(word):
            return Parsed(ok=True, value=word, extra=text[len(word):])
    return Parsed(ok=False, error=f"expected one of {words}, got {text[:20]!r}")


@parser("worked_integer", WorkedParams)
def parse_worked_integer(text: str, separator: str = " | ") -> Parsed:
    """A worked answer on one line: steps separated by ``separator``, the last step integers separated by single
    spaces (a final state: a machine's stack, say), the answer its last integer: '5 3 add | 8' is 8, '4 5' is 5.
    What follows the line is extra."""
    line, newline, rest = text.partition("\n")
    last = line.rsplit(separator, 1)[-1]
    words = last.split(" ")
    if not all(re.fullmatch(r"-?[0-9]{1,%d}" % MAX_DIGITS, w) for w in words):
        reason = _non_ascii_digit(last)
        return Parsed(ok=False, error=reason or f"expected the last step to be integers, got {last[-30:]!r}")
    return Parsed(ok=True, value=int(words[-1]), extra=newline + rest)


@parser("line")
def parse_line(text: str) -> Parsed:
    """The reply's first line, spaces around it dropped: free text a family's own rules judge (a proposed
    program, say); what follows the line break is extra."""
    line, newline, rest = text.partition("\n")
    if not line.strip():
        return Parsed(ok=False, error=f"expected a line of text, got {text[:20]!r}")
    return Parsed(ok=True, value=line.strip(), extra=newline + rest)


def get_parser(name: str) -> Parser:
    return parser_spec(name).fn


def parser_spec(name: str) -> ParserSpec:
    """The parser registered as ``name``; unknown, a ``UserError`` naming the known ones."""
    spec = plugins.get("parser", name)
    if not isinstance(spec, ParserSpec):
        raise UserError(f"answer parser {name!r} is a {type(spec).__name__}, not a rsi.parsers.ParserSpec")
    return spec


def parser_names() -> list[str]:
    return plugins.names("parser")


def digits_lsb(value: int, width: int) -> str:
    """Jinja filter: ``value`` written least significant digit first, zero-padded to ``width``."""
    text = str(int(value))
    if text.startswith("-") or len(text) > width:
        raise ValueError(f"{value} does not fit {width} unsigned digits")
    return text[::-1].ljust(width, "0")
