"""Harness proposers: candidate harness documents, generated from a declared search space.

A proposer is a function ``(harness, space) -> [Proposal]`` registered under a name with ``@proposer``: one
per family (it knows the family's prompt and answer formats) or generic. ``space`` is the lineage's
``harness_search.space``: knob -> values to try. A proposal is a whole HCP document plus its templates; the
harness search stores each one (validated like a shipped harness, immutable, content-addressed) before
anything runs under it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, JsonValue

from rsi.errors import UserError
from rsi.hashing import digest
from rsi.hcp import Harness

Space = dict[str, list[JsonValue]]


class Proposal(BaseModel):
    model_config = ConfigDict(frozen=True)

    document: dict[str, Any]
    sources: dict[str, str]
    why: str  # one line: what changes and what it is for


Proposer = Callable[[Harness, Space], list[Proposal]]
PROPOSERS: dict[str, Proposer] = {}


def proposer(name: str) -> Callable[[Proposer], Proposer]:
    def register(fn: Proposer) -> Proposer:
        PROPOSERS[name] = fn
        return fn
    return register


def get_proposer(name: str) -> Proposer:
    if name not in PROPOSERS:
        import difflib

        close = difflib.get_close_matches(name, PROPOSERS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UserError(f"unknown harness proposer {name!r}{hint} (known: {', '.join(sorted(PROPOSERS))})")
    return PROPOSERS[name]


def propose(harness: Harness, names: list[str] | tuple[str, ...], space: Space) -> list[Proposal]:
    """Every registered proposer's candidates, in order, without duplicates or the harness itself."""
    seen = {_content_key(harness.document.model_dump(mode="json"), harness.sources)}
    out = []
    for name in names:
        for p in get_proposer(name)(harness, space):
            key = _content_key(p.document, p.sources)
            if key not in seen:
                seen.add(key)
                out.append(p)
    return out


def _content_key(document: dict[str, Any], sources: dict[str, str]) -> str:
    return digest({"document": {k: v for k, v in document.items() if k not in ("version", "description")},
                   "sources": sources})


def variant(harness: Harness, slug: str, why: str, changes: dict[str, Any], sources: dict[str, str] | None = None,
            drop: tuple[str, ...] = ()) -> Proposal:
    """``harness`` with dotted fields set (``decoding.temperature``), templates added or replaced, template files
    dropped, and the version ``<root>.<slug>-<content digest>``: the same content always gets the same id."""
    doc = harness.document.model_dump(mode="json")  # a fresh dict, edited in place
    for dotted, value in changes.items():
        node = doc
        *path, last = dotted.split(".")
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    files = {k: v for k, v in harness.sources.items() if k not in drop} | (sources or {})
    root = harness.document.version.split(".")[0]
    doc["version"] = f"{root}.{slug}-{_content_key(doc, files)[:8]}"
    doc["description"] = f"{why} (proposed from {harness.id})"
    return Proposal(document=doc, sources=files, why=why)


# --------------------------------------------------------------------------------------------------------
# addition: the answer and prompt formats of reverse addition
# --------------------------------------------------------------------------------------------------------
PAD_PROMPT = "{{ task.a | digits_lsb(vars.width) }}+{{ task.b | digits_lsb(vars.width) }}="
PAD_ANSWER = "{{ answer | digits_lsb(vars.width + 1) }}"


@proposer("addition")
def addition_formats(harness: Harness, space: Space) -> list[Proposal]:
    """Fixed-width reverse addition at each ``width`` of the space (``format`` "pad": operands and sum least
    significant digit first, zero-padded), with token limits sized to the width; and the harness as it is
    with the family's ``digit_chunks`` plan at each ``chunk`` of the space (a long addition posed as additions
    of ``chunk``-digit parts plus carries, each in the harness's own format: no migration needed). A plan's
    calls stay within the short levels the pair already adds well, so its candidates sample one reply per
    task (``decoding.samples = 1``): a task of level 16 at chunk 3 makes 11 calls, and 8 samples of each cost
    what they would not teach."""
    out = []
    for chunk in space.get("chunk", []):
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise UserError(f"harness_search.space.chunk: {chunk!r} is not a positive number of digits")
        out.append(variant(harness, f"chunks{chunk}", f"long additions as {chunk}-digit parts plus carries",
                           {"plan": {"name": "digit_chunks", "params": {"chunk": chunk}}, "decoding.samples": 1}))
    for fmt in space.get("format", ["pad"]):
        if fmt != "pad":
            raise UserError(f"harness_search.space.format: unknown addition format {fmt!r}; known: pad")
        for width in space.get("width", []):
            if not isinstance(width, int) or width < 1:
                raise UserError(f"harness_search.space.width: {width!r} is not a positive number of digits")
            changes = {"prompt.template": "templates/prompt.j2", "prompt.system_template": None,
                       "prompt.vars": {"width": width},
                       "answer.parser": "reversed_digits", "answer.params": {"width": width + 1},
                       "answer.template": "templates/answer.j2", "decoding.max_new_tokens": width + 2,
                       "limits.max_completion_tokens": width + 2, "limits.max_prompt_tokens": 2 * width + 12}
            out.append(variant(harness, f"pad{width}", f"fixed width {width}: levels up to {width} posable",
                               changes, {"templates/prompt.j2": PAD_PROMPT, "templates/answer.j2": PAD_ANSWER},
                               drop=tuple(harness.sources)))
    return out
