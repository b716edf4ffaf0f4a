"""Harness versions locked at first use: a used ``id/version`` keeps its content hash forever.

Trajectories, pairs and verdicts name a harness by ``id/version``; if its files were edited in place,
old records would silently mean something else. The first use stores the hash, the document and the
template sources (so an edit can be undone from the DB); any later use with another hash is refused.
"""

from __future__ import annotations

import re
from pathlib import Path

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from rsi.errors import UserError
from rsi.hcp import Harness
from rsi.store.schema import HarnessRow


def locked_hash(session: Session, harness_id: str) -> str | None:
    """The hash ``harness_id`` ("<id>/<version>") was first used with, or None if it was never used."""
    row = session.get(HarnessRow, harness_id)
    return row.hash if row else None


def lock_harness(session: Session, harness: Harness) -> None:
    """Record the first use of ``harness``; refuse (UserError) a used version whose content changed."""
    row = session.get(HarnessRow, harness.id)
    if row is None:
        try:
            with session.begin_nested():  # a concurrent first use may win the insert
                document = harness.document.model_dump(mode="json")
                session.add(HarnessRow(id=harness.id, hash=harness.hash, document=document,
                                       sources=dict(harness.sources), path=str(harness.path)))
            return
        except IntegrityError:
            row = session.get(HarnessRow, harness.id)
    if row.hash != harness.hash:
        raise UserError(_changed(row, harness))


def _changed(row: HarnessRow, harness: Harness) -> str:
    now = harness.document.model_dump(mode="json")
    what = [key for key in sorted(set(now) | set(row.document)) if now.get(key) != row.document.get(key)]
    what += [name for name in sorted(set(harness.sources) | set(row.sources))
             if harness.sources.get(name) != row.sources.get(name)]
    return (
        f"harness {harness.id} ({harness.path}) was first used with hash {row.hash[:12]}… and now hashes to "
        f"{harness.hash[:12]}… (changed: {', '.join(what) or 'content'}): a used harness version is immutable; "
        f"restore it or copy it to a new version directory (e.g. {_next_version_dir(harness)}) and bump `version`"
    )


def _next_version_dir(harness: Harness) -> str:
    """The first free sibling directory after this version: v2 -> v3 (or v2-2 for a version without a number)."""
    family_dir, version = harness.folder.parent, harness.document.version
    m = re.fullmatch(r"(.*?)(\d+)", version)
    prefix, n = (m.group(1), int(m.group(2))) if m else (f"{version}-", 1)
    candidate = family_dir / f"{prefix}{n + 1}"
    while candidate.exists():
        n += 1
        candidate = family_dir / f"{prefix}{n + 1}"
    try:
        return str(candidate.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(candidate)
