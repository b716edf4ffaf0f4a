"""What the serving proxy keeps in the state DB: API keys, conversations and rate limits.

A key is a random token shown once; the DB holds its SHA-256 (the token has 256 random bits, so a fast hash
is enough: nothing to brute-force). Conversations and rate-limit buckets are rows, so they survive a restart and
every proxy worker on the same DB shares them.
"""

from __future__ import annotations

import hashlib
import logging
import random
import secrets
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select

from rsi.errors import UserError

log = logging.getLogger(__name__)

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


def set_harvest(store: Store, name: str, on: bool) -> None:
    """Whether the key ``name``'s conversations may be harvested as training data (``rsi.mol.harvest``)."""
    from rsi.store.schema import ApiKeyRow

    with store.session() as s:
        row = s.get(ApiKeyRow, name)
        if row is None:
            known = ", ".join(s.scalars(select(ApiKeyRow.name).order_by(ApiKeyRow.name))) or "none"
            raise UserError(f"no key named {name!r} (keys: {known}); `rsi keys list` shows them")
        row.harvest = on


def list_keys(store: Store) -> list[dict[str, Any]]:
    from rsi.store.schema import ApiKeyRow

    with store.session() as s:
        return [{"name": r.name, "created_at": r.created_at.isoformat(), "revoked": r.revoked_at is not None,
                 "harvested": r.harvest} for r in s.scalars(select(ApiKeyRow).order_by(ApiKeyRow.name))]


def key_owner(store: Store, key: str) -> str | None:
    """The name of the active key ``key``, or None."""
    from rsi.store.schema import ApiKeyRow

    with store.session() as s:
        row = s.scalars(select(ApiKeyRow).where(ApiKeyRow.key_hash == _hash(key))).first()
        return row.name if row is not None and row.revoked_at is None else None


class Recent:
    """Values remembered for ``ttl_s`` seconds (thread-safe), so the proxy does not ask the state DB on every
    request what it asked a moment ago (a key's owner, the champions); a revoked key or a new champion is seen
    within ``ttl_s``. None is not remembered (a wrong key is asked again; no growth from made-up keys)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._values: dict[Any, tuple[float, Any]] = {}
        self._lock = threading.Lock()

    def peek(self, key: Any) -> Any:
        """The remembered value, or None when there is none within ``ttl_s`` (without computing it)."""
        with self._lock:
            hit = self._values.get(key)
        return hit[1] if hit is not None and time.monotonic() - hit[0] < self.ttl_s else None

    def get(self, key: Any, compute: Any) -> Any:
        value = self.peek(key)
        if value is not None:
            return value
        now = time.monotonic()
        value = compute()
        if value is not None:
            with self._lock:
                if len(self._values) > 4096:
                    self._values = {k: v for k, v in self._values.items() if now - v[0] < self.ttl_s}
                self._values[key] = (now, value)
        return value


# ---- conversations ---------------------------------------------------------------------------------------


def new_conversation_id() -> str:
    return "conv-" + uuid.uuid4().hex


def new_conversation(store: Store, owner: str) -> str:
    conversation_id = new_conversation_id()
    start_conversation(store, conversation_id, owner, [])
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


def prune_conversations(store: Store, before: Any, batch: int = 1000, dry_run: bool = False) -> int:
    """Delete the conversations with no message since ``before`` (a UTC datetime), their messages and the
    trajectories harvested from them (with their verdicts, and their places in training sets: the adapters trained
    on them stay, their data does not); returns how many (``dry_run``: counts them, deletes nothing). ``batch``
    conversations a transaction, so a proxy's writes never wait on a long one. A turn sent to a conversation
    while it is deleted gets a LookupError (``append_messages``)."""
    from sqlalchemy import delete

    from rsi.store.schema import ConversationMessageRow as M, ConversationRow as C, DatasetItem
    from rsi.store.schema import TrajectoryRow as T, VerdictRow

    recent = select(M.id).where(M.conversation_id == C.id, M.created_at >= before).exists()
    stale = select(C.id).where(C.created_at < before, ~recent)
    if dry_run:
        with store.engine.connect() as conn:
            return conn.scalar(select(func.count()).select_from(stale.subquery()))
    deleted = 0
    while True:
        with store.engine.begin() as conn:
            ids = conn.scalars(stale.limit(batch)).all()
            if not ids:
                return deleted
            harvested = select(T.id).where(T.conversation_id.in_(ids))
            conn.execute(delete(DatasetItem).where(DatasetItem.trajectory_id.in_(harvested)))
            conn.execute(delete(VerdictRow).where(VerdictRow.trajectory_id.in_(harvested)))
            conn.execute(delete(T).where(T.conversation_id.in_(ids)))
            conn.execute(delete(M).where(M.conversation_id.in_(ids)))
            conn.execute(delete(C).where(C.id.in_(ids)))
        deleted += len(ids)


Turn = list[tuple[dict[str, Any], str | None]]  # messages, each with the specialist that wrote it (or None)


def _write(conn: Any, turns: list[tuple[str, str, str | None, Turn]]) -> None:
    """Write turns, each ("start", conversation, owner, messages) -- a new conversation with its first messages
    -- or ("append", conversation, None, messages) -- messages after the conversation's stored ones, their
    positions read in the same transaction: one INSERT of the new conversations, one COUNT of the appended ones,
    one INSERT of every message (Core statements: on each reply's path, and a group commit writes many turns)."""
    from sqlalchemy import insert

    from rsi.store.schema import ConversationMessageRow as M, ConversationRow, utcnow

    now = utcnow()
    started = [{"id": c, "api_key": owner, "created_at": now} for kind, c, owner, _ in turns if kind == "start"]
    if started:
        conn.execute(insert(ConversationRow.__table__), started)
    appended = {c for kind, c, _, _ in turns if kind == "append"}
    following = dict(conn.execute(select(M.conversation_id, func.count()).where(M.conversation_id.in_(appended))
                                  .group_by(M.conversation_id)).all()) if appended else {}
    rows = []
    for _, c, _, messages in turns:
        start = following.get(c, 0)
        rows += [{"conversation_id": c, "position": start + i, "message": message, "specialist": specialist,
                  "created_at": now} for i, (message, specialist) in enumerate(messages)]
        following[c] = start + len(messages)
    if rows:
        conn.execute(insert(M.__table__), rows)


def start_conversation(store: Store, conversation_id: str, owner: str, messages: Turn) -> None:
    """A new conversation with its first messages, in one transaction (its first turn costs one write)."""
    with store.engine.begin() as conn:
        _write(conn, [("start", conversation_id, owner, messages)])


def append_messages(store: Store, conversation_id: str, messages: Turn, attempts: int = 20) -> None:
    """Append messages after the stored ones, in one transaction.

    Two writers appending to one conversation at once both read the same next position; the unique
    (conversation, position) constraint refuses the second (SQLite may refuse its stale read instead), which
    then reads the positions again and retries: both turns are stored, one after the other. A conversation
    that no longer exists (pruned since the turn began) is a LookupError, not retried."""
    from sqlalchemy.exc import IntegrityError, OperationalError

    from rsi.store.schema import ConversationRow

    for attempt in range(attempts):
        try:
            with store.engine.begin() as conn:
                _write(conn, [("append", conversation_id, None, messages)])
            return
        except (IntegrityError, OperationalError):
            with store.engine.connect() as conn:
                if conn.scalar(select(ConversationRow.id).where(ConversationRow.id == conversation_id)) is None:
                    raise LookupError(conversation_id) from None
            if attempt == attempts - 1:
                raise
            time.sleep(random.uniform(0.001, 0.005) * (attempt + 1))


class ConversationWriter:
    """A proxy's conversation writes, committed together: one thread takes every turn waiting and writes them in
    one transaction (group commit), so concurrent requests share a commit instead of queueing on the database's
    write lock one commit each (``bench/serve.py``: the store stage at 32 clients). A request's future is done
    once its turn is committed. The thread keeps one connection, not a pooled one per batch. A batch the
    database refuses (another worker appended to a conversation in it) is written again one turn at a time,
    appends with ``append_messages``' retries, and the connection is replaced."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._conn: Any = None
        self._waiting: list[tuple[str, str, str | None, Turn, Future]] = []
        self._ready = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="rsi-conversation-writer", daemon=True)
        self._thread.start()

    def start(self, conversation_id: str, owner: str, messages: Turn) -> Future:
        return self._put("start", conversation_id, owner, messages)

    def append(self, conversation_id: str, messages: Turn) -> Future:
        return self._put("append", conversation_id, None, messages)

    def _put(self, kind: str, conversation_id: str, owner: str | None, messages: Turn) -> Future:
        future: Future = Future()
        with self._ready:
            if self._closing:
                raise RuntimeError("the conversation writer is closed")
            self._waiting.append((kind, conversation_id, owner, messages, future))
            self._ready.notify()
        return future

    def close(self) -> None:
        """Write the turns waiting, then stop the thread and close its connection."""
        with self._ready:
            self._closing = True
            self._ready.notify()
        self._thread.join(30)

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._waiting and not self._closing:
                    self._ready.wait()
                batch, self._waiting = self._waiting, []
            if not batch:  # closing, and nothing left to write
                self._close()
                return
            try:
                self._conn = self._conn or self.store.engine.connect()
                with self._conn.begin():
                    _write(self._conn, [turn[:4] for turn in batch])
            except Exception:  # each turn alone: one refused turn must not lose the others
                self._close()
                for kind, conversation_id, owner, messages, future in batch:
                    try:
                        if kind == "start":
                            start_conversation(self.store, conversation_id, owner, messages)
                        else:
                            append_messages(self.store, conversation_id, messages)
                    except Exception as exc:
                        future.set_exception(exc)
                    else:
                        future.set_result(None)
            else:
                for *_, future in batch:
                    future.set_result(None)

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # a connection that broke: the pool discards it
                log.warning("closing the conversation writer's connection failed", exc_info=True)


# ---- rate limits -----------------------------------------------------------------------------------------


class RateLimits:
    """A token bucket per key in the state DB (``rsi_rate_limits``), so every proxy worker on the DB shares it:
    ``burst`` requests at once, refilled at ``rate`` per second. Taking tokens is one UPDATE that refills and
    takes only when enough tokens are there, atomic in SQLite and PostgreSQL alike.

    A worker takes up to ``LEASE_S`` seconds' worth of the rate (at most half the burst) at once and spends it
    locally (one DB write per lease, not per request, at high rates); what it has not spent when its lease
    expires is dropped, so the workers together never exceed the limit (a worker may refuse a request while
    another holds unspent tokens). A lease three quarters spent or expired is renewed by a thread of its own
    while requests go on spending it, so a key in steady use asks the DB once a lease, off its requests' path.
    A new lease adds to what is left of the current one (a renewal, and concurrent first requests that each
    leased: a burst gets every token it took); a renewal that finds the bucket short of a lease is not tried
    again before the bucket can have one. At rates under 2/``LEASE_S`` per second (or a burst under 4) every
    request asks the DB."""

    LEASE_S = 1.0

    def __init__(self, store: Store, rate: float, burst: int) -> None:
        self.store, self.rate, self.burst = store, rate, burst
        # tokens a worker takes at once: at most half the bucket, so a renewal finds them while a lease lasts
        self.lease = max(1, min(burst // 2, int(rate * self.LEASE_S)))
        self._leases: dict[str, tuple[float, int]] = {}  # key -> (lease expiry, tokens left in it)
        self._renewing: set[str] = set()
        self._renew_after: dict[str, float] = {}  # key -> when a renewal may find a lease's tokens in the bucket
        self._lock = threading.Lock()
        self._renewer = ThreadPoolExecutor(1, thread_name_prefix="rsi-rate-lease")

    def take(self, key: str) -> float:
        """0.0 when a request may go now, else the seconds until one may."""
        if self.take_leased(key):
            return 0.0
        got, wait = self._take(key, self.lease)
        if not got and self.lease > 1:
            got, wait = self._take(key, 1)
        if got > 1:
            self._add_lease(key, got - 1)
        if not got and self.take_leased(key):  # a concurrent request of this worker leased the last tokens
            return 0.0
        return 0.0 if got else wait

    def _add_lease(self, key: str, tokens: int) -> None:
        """A new lease of ``tokens``, plus what is left of the current one (a token taken is never dropped
        while its lease lasts: concurrent first requests each lease, and a renewal lands on an unspent lease)."""
        now = time.monotonic()
        with self._lock:
            expires, left = self._leases.get(key, (0.0, 0))
            self._leases[key] = (now + self.LEASE_S, tokens + (left if now < expires else 0))

    def take_leased(self, key: str) -> bool:
        """Take a token from this worker's lease, without the DB; False when the lease is spent or expired."""
        now = time.monotonic()
        with self._lock:
            expires, left = self._leases.get(key, (0.0, 0))
            if left <= 0 or now >= expires:
                return False
            self._leases[key] = (expires, left - 1)
            renew = (key not in self._renewing and now >= self._renew_after.get(key, 0.0)
                     and (left - 1 < self.lease / 4 or expires - now < self.LEASE_S / 4))
            if renew:
                self._renewing.add(key)
        if renew:
            self._renewer.submit(self._renew, key)
        return True

    def _renew(self, key: str) -> None:
        try:
            got, wait = self._take(key, self.lease)
            if got:
                self._add_lease(key, got)
            else:  # the bucket is short of a lease: not again before it can have one
                with self._lock:
                    self._renew_after[key] = time.monotonic() + wait
        except Exception:  # the request path takes its own lease when this one is missing
            log.exception("renewing the rate-limit lease of key %r", key)
        finally:
            with self._lock:
                self._renewing.discard(key)

    def _take(self, key: str, n: int) -> tuple[int, float]:
        """(tokens taken from the DB bucket, n or 0; seconds until n are there)."""
        from sqlalchemy import case, update
        from sqlalchemy.exc import IntegrityError

        from rsi.store.schema import RateLimitRow as R

        for _ in range(3):
            now = time.time()  # may be older than ``updated`` when another worker wrote while this one waited
            later = R.updated < now
            grown = R.tokens + case((later, now - R.updated), else_=0.0) * self.rate
            refilled = case((grown > self.burst, float(self.burst)), else_=grown)
            with self.store.session() as s:
                took = s.execute(update(R).where(R.api_key == key, refilled >= n)
                                 .values(tokens=refilled - n, updated=case((later, now), else_=R.updated))).rowcount
                if took:
                    return n, 0.0
                left = s.scalar(select(refilled).where(R.api_key == key))
            if left is not None:
                return 0, (n - left) / self.rate
            try:
                with self.store.session() as s:  # a key's first request: a full bucket less what it takes
                    s.add(R(api_key=key, tokens=float(self.burst - n), updated=now))
                return n, 0.0
            except IntegrityError:
                continue  # another worker made the row first: take from it
        raise RuntimeError(f"rate limit row of key {key!r} could not be read or made")
