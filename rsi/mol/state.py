"""What the serving proxy keeps in the state DB (API keys, conversations) and in memory (rate limits).

A key is a random token shown once; the DB holds its SHA-256 (the token has 256 random bits, so a fast hash
is enough: nothing to brute-force). Conversations are rows, so they survive a restart and every proxy worker
on the same DB sees them.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select

from rsi.errors import UserError

if TYPE_CHECKING:
    from rsi.store import Store

KEY_PREFIX = "rsi-"


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(store: Store, name: str) -> str:
    """A new key named ``name``; the key itself is returned once and never stored."""
    from rsi.store.schema import ApiKeyRow

    if not name or len(name) > 64:
        raise UserError(f"key name {name!r}: give 1 to 64 characters")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    with store.session() as s:
        if s.get(ApiKeyRow, name) is not None:
            raise UserError(f"a key named {name!r} exists already; `rsi keys revoke {name}` it or pick another name")
        s.add(ApiKeyRow(name=name, key_hash=_hash(key)))
    return key


def revoke_key(store: Store, name: str) -> None:
    """Revoke a key (the row stays, so the name is not reused by mistake)."""
    from rsi.store.schema import ApiKeyRow, utcnow

    with store.session() as s:
        row = s.get(ApiKeyRow, name)
        if row is None or row.revoked_at is not None:
            active = ", ".join(s.scalars(select(ApiKeyRow.name).where(ApiKeyRow.revoked_at.is_(None)))) or "none"
            raise UserError(f"no active key named {name!r} (active keys: {active}); `rsi keys list` shows them")
        row.revoked_at = utcnow()


def list_keys(store: Store) -> list[dict[str, Any]]:
    from rsi.store.schema import ApiKeyRow

    with store.session() as s:
        return [{"name": r.name, "created_at": r.created_at.isoformat(), "revoked": r.revoked_at is not None}
                for r in s.scalars(select(ApiKeyRow).order_by(ApiKeyRow.name))]


def key_owner(store: Store, key: str) -> str | None:
    """The name of the active key ``key``, or None."""
    from rsi.store.schema import ApiKeyRow

    with store.session() as s:
        row = s.scalars(select(ApiKeyRow).where(ApiKeyRow.key_hash == _hash(key))).first()
        return row.name if row is not None and row.revoked_at is None else None


# ---- conversations ---------------------------------------------------------------------------------------


def new_conversation(store: Store, owner: str) -> str:
    from rsi.store.schema import ConversationRow

    conversation_id = "conv-" + uuid.uuid4().hex
    with store.session() as s:
        s.add(ConversationRow(id=conversation_id, api_key=owner))
    return conversation_id


def conversation_messages(store: Store, conversation_id: str, owner: str) -> list[tuple[dict[str, Any], str | None]]:
    """The stored messages of a conversation, in order, each with the specialist that wrote it (assistant
    messages); a conversation of another key is as unknown as a missing one."""
    from rsi.store.schema import ConversationMessageRow, ConversationRow

    with store.session() as s:
        conv = s.get(ConversationRow, conversation_id)
        if conv is None or conv.api_key != owner:
            raise LookupError(conversation_id)
        rows = s.scalars(select(ConversationMessageRow).where(ConversationMessageRow.conversation_id == conversation_id)
                         .order_by(ConversationMessageRow.position))
        return [(r.message, r.specialist) for r in rows]


def append_messages(store: Store, conversation_id: str, messages: list[tuple[dict[str, Any], str | None]]) -> None:
    """Append messages after the stored ones, in one transaction (two writers cannot take one position: the
    unique (conversation, position) constraint refuses the second)."""
    from rsi.store.schema import ConversationMessageRow

    with store.session() as s:
        start = s.scalar(select(func.count()).select_from(ConversationMessageRow)
                         .where(ConversationMessageRow.conversation_id == conversation_id)) or 0
        for i, (message, specialist) in enumerate(messages):
            s.add(ConversationMessageRow(conversation_id=conversation_id, position=start + i, message=message,
                                         specialist=specialist))


# ---- rate limits -----------------------------------------------------------------------------------------


class TokenBuckets:
    """A token bucket per key: ``burst`` requests at once, refilled at ``rate`` per second (per process)."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, time of last update)
        self._lock = threading.Lock()

    def take(self, key: str) -> float:
        """0.0 when a request may go now, else the seconds until one may."""
        with self._lock:
            now = time.monotonic()
            tokens, then = self._buckets.get(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - then) * self.rate)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate if self.rate > 0 else float("inf")
