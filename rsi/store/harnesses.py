"""Harness versions locked at first use: a used ``id/version`` keeps its content hash forever.

Trajectories, pairs and verdicts name a harness by ``id/version``; if its files were edited in place,
old records would silently mean something else. The first use stores the hash, the document and the
template sources (so an edit can be undone from the DB); any later use with another hash is refused.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from rsi.errors import UserError
from rsi.hcp import Harness, HCPDocument, load_harness
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


# ---- the content-addressed store: any used or proposed harness version, loadable from the state DB alone ----


def find_row(session: Session, ref: str) -> HarnessRow | None:
    """The stored harness ``ref`` names: ``id/version`` (also ``id@version``), or its hash (a prefix of at
    least 8 hex digits)."""
    row = session.get(HarnessRow, ref.replace("@", "/"))
    if row is None and re.fullmatch(r"[0-9a-f]{8,64}", ref):
        rows = list(session.scalars(select(HarnessRow).where(HarnessRow.hash.startswith(ref))).all())
        row = rows[0] if len(rows) == 1 else None
    return row


def stored_harness(session: Session, ref: str, home: Path) -> Harness:
    """Load a stored harness by id/version or hash: from the folder it was first used from when that still
    holds the same content, else from a copy written out of the state DB under ``home/harnesses``."""
    row = find_row(session, ref)
    if row is None:
        raise UserError(f"harness {ref!r} is not in the state DB's harness store; pass an id/version or hash "
                        "that `rsi harness list` shows")
    original = Path(row.path)
    if original.is_file():
        harness = _load_quietly(original)
        if harness is not None and harness.hash == row.hash:
            return harness
    folder = home / "harnesses" / row.id
    harness = _load_quietly(folder / "hcp.toml") if (folder / "hcp.toml").is_file() else None
    if harness is None or harness.hash != row.hash:
        write_harness_dir(folder, row.document, row.sources)
        harness = load_harness(folder)
    if harness.hash != row.hash:
        raise UserError(f"harness {row.id}: the copy written from the state DB hashes to {harness.hash[:12]}…, "
                        f"not the stored {row.hash[:12]}…; the stored document does not round-trip through TOML")
    return harness


def store_new(session: Session, document: dict[str, Any], sources: dict[str, str], home: Path) -> Harness:
    """Validate a proposed harness document exactly like a shipped one, write it under ``home/harnesses`` and
    lock it (an id/version already stored with other content is refused). Returns the stored harness."""
    doc_id = f"{document.get('id')}/{document.get('version')}"
    folder = home / "harnesses" / doc_id
    with tempfile.TemporaryDirectory(dir=_ensure(home / "harnesses")) as tmp:
        write_harness_dir(Path(tmp) / "h", document, sources)
        harness = load_harness(Path(tmp) / "h")  # every check a shipped harness passes
        if not (folder / "hcp.toml").is_file() or (_load_quietly(folder / "hcp.toml") or harness).hash != harness.hash:
            write_harness_dir(folder, document, sources)
    harness = load_harness(folder)
    lock_harness(session, harness)
    return harness


def store_proposal(session: Session, document: dict[str, Any], sources: dict[str, str], home: Path) -> Harness:
    """A proposer's candidate, stored (``store_new``); or, when its id/version is stored already with the same
    content but for its description, that stored harness: the same candidate proposed again from another parent
    (a proposal's version is named by its content, its description names the parent it was proposed from)."""
    row = session.get(HarnessRow, f"{document.get('id')}/{document.get('version')}")
    if row is not None and row.sources == sources:
        try:
            mine = HCPDocument.model_validate(document).model_dump(mode="json")
        except ValueError:  # the validation store_new runs says what is wrong
            mine = None
        if mine is not None and _but_description(mine) == _but_description(row.document):
            return stored_harness(session, row.id, home)
    return store_new(session, document, sources, home)


def _but_description(document: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in document.items() if key != "description"}


def write_harness_dir(folder: Path, document: dict[str, Any], sources: dict[str, str]) -> None:
    """Write ``hcp.toml`` and its templates into ``folder``, replacing what is there in one rename."""
    import tomli_w

    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "hcp.toml").write_text(tomli_w.dumps(_without_nulls(document)), encoding="utf-8")
    for rel, source in sources.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(source, encoding="utf-8")
    if folder.exists():
        old = folder.with_name(f".{folder.name}.{os.getpid()}.old")
        folder.rename(old)
        tmp.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(folder)


def _without_nulls(value: Any) -> Any:
    """TOML has no null: a field left at None is written by leaving it out (its default)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _load_quietly(file: Path) -> Harness | None:
    try:
        return load_harness(file)
    except UserError:
        return None


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
