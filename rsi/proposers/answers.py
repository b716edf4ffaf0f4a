"""An operator for replies the answer parser refuses (cause ``format_violation``): the parser's parameters
(``[answer] params``) drawn from the failed replies themselves. Each parameter is varied alone, by its type: a
number by small steps and by the lengths the replies have; a text by the prefixes and suffixes around the
replies' digits; a list of texts by the replies the pair writes most. A candidate is kept where more of the failed
replies parse cleanly under it than under the harness's own parameters (the parser runs here; no model does); the
two that parse most are proposed."""

from __future__ import annotations

import re
import typing
from collections import Counter
from typing import Any

from pydantic import ValidationError

from rsi.hcp import Harness
from rsi.hcp.syntax import parse_reply
from rsi.parsers import parser_spec
from rsi.proposers.base import Evidence, Proposal, Space, proposer, variant

KEEP = 2
_AROUND_DIGITS = re.compile(r"^(\D*)\d+(?:\D+\d+)*(\D*)$")


@proposer("answer_params")
def answer_params(harness: Harness, space: Space, evidence: Evidence) -> list[Proposal]:
    answer = harness.document.answer
    replies = [f.replies[-1] for f in evidence.of("format_violation") if f.replies and f.finish_reason == "stop"]
    if not replies:
        return []
    model = parser_spec(answer.parser).params
    scored = []
    for name, value in candidates(model, dict(answer.params), replies):
        params = {**answer.params, name: value}
        try:
            model.model_validate(params)
        except ValidationError:
            continue
        parsed = _parsing(answer.model_copy(update={"params": params}), replies)
        scored.append((parsed, name, value))
    baseline = _parsing(answer, replies)
    best = sorted((s for s in scored if s[0] > baseline), key=lambda s: -s[0])[:KEEP]
    return [variant(harness, f"{name}-{_slug(value)}", f"{parsed} of {len(replies)} refused replies parse with "
                    f"answer.params.{name} = {value!r} (was {answer.params.get(name)!r})",
                    {f"answer.params.{name}": value}, cause="format_violation")
            for parsed, name, value in best]


def candidates(model: type, current: dict[str, Any], replies: list[str]) -> list[tuple[str, Any]]:
    """(parameter, value) pairs to try, each parameter of the parser's params model varied alone."""
    texts = Counter(r.strip() for r in replies)
    out: list[tuple[str, Any]] = []
    for name, field in model.model_fields.items():
        kind, now = field.annotation, current.get(name)
        if kind is int:
            steps = [now + d for d in (-2, -1, 1, 2)] if isinstance(now, int) else []
            lengths = [len(t) for t, _ in texts.most_common(3)]
            out += [(name, v) for v in dict.fromkeys([*steps, *lengths]) if v != now]
        elif kind is str:
            framed = [m.groups() for t in texts if (m := _AROUND_DIGITS.match(t))]
            out += [(name, v) for v in dict.fromkeys(s for pair in framed for s in pair) if v != now]
        elif typing.get_origin(kind) is list:
            common = [t for t, _ in texts.most_common(3) if t]
            out += [(name, v) for t in common for v in ([t], [*(now or []), t]) if v != now]
    return out


def _parsing(answer: Any, replies: list[str]) -> int:
    return sum(bool((p := parse_reply(r, answer)).ok and not p.extra) for r in replies)


def _slug(value: Any) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "", str(value))[:16] or "x"
