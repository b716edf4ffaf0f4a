"""Harness proposers: candidate harness documents, generated from a declared search space.

A proposer is a function ``(harness, space) -> [Proposal]``, a plugin (``rsi.plugins`` kind "proposer"): generic
ones here with ``@proposer``, a family's in its own module by entry point in ``rsi.proposers`` (it knows the
family's prompt and answer formats; addition's is ``rsi.task_generators.addition.formats``). ``space`` is the lineage's
``harness_search.space``: knob -> values to try. A proposal is a whole HCP document plus its templates; the
harness search stores each one (validated like a shipped harness, immutable, content-addressed) before
anything runs under it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, JsonValue

from rsi import plugins
from rsi.hashing import digest
from rsi.hcp import Harness

Space = dict[str, list[JsonValue]]


class Proposal(BaseModel):
    model_config = ConfigDict(frozen=True)

    document: dict[str, Any]
    sources: dict[str, str]
    why: str  # one line: what changes and what it is for


Proposer = Callable[[Harness, Space], list[Proposal]]


def proposer(name: str) -> Callable[[Proposer], Proposer]:
    """Register a proposer under ``name`` (``rsi.plugins`` kind "proposer"; another package's by entry point in
    ``rsi.proposers``)."""
    return plugins.plugin("proposer", name)


def get_proposer(name: str) -> Proposer:
    return plugins.get("proposer", name)


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
