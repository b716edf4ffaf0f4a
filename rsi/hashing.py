"""Stable content hashes: the same value gives the same bytes, and so the same digest, everywhere."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def canonical_json(value: Any) -> bytes:
    """JSON with sorted keys, no whitespace and ASCII escapes: independent of dict order and locale."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def digest(value: Any, *, prefix: str = "") -> str:
    """sha256 hex digest of ``value``'s canonical JSON, optionally namespaced by ``prefix``."""
    h = hashlib.sha256()
    h.update(prefix.encode())
    h.update(canonical_json(value))
    return h.hexdigest()


def digest_bytes(chunks: list[tuple[str, bytes]]) -> str:
    """Digest of named byte strings (e.g. files), in name order, with line endings normalised."""
    h = hashlib.sha256()
    for name, data in sorted(chunks):
        data = data.replace(b"\r\n", b"\n")
        h.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()


def digest_dir(path: Path, *, skip: tuple[str, ...] = ()) -> str:
    """Digest of every file under ``path`` (relative names + bytes): a model's or adapter's identity."""
    files = [p for p in sorted(Path(path).rglob("*")) if p.is_file() and p.name not in skip]
    return digest_bytes([(str(p.relative_to(path)), p.read_bytes()) for p in files])
