"""The lineage lease: one run per lineage, every write of that run fenced by its token.

A run takes the lease (``acquire_lease``) and renews it from a heartbeat thread; its writes go through a
``Fence``, which checks inside the write's own transaction that the lease still names the run's holder and
token. The holder and token are plain values, so a stage in another process (given them in its
``rsi.run.RunContext``) writes under the same lease."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta, timezone

from sqlalchemy import update
from sqlalchemy.orm import Session

from rsi.errors import RuntimeFailure, UserError
from rsi.store.db import Store
from rsi.store.schema import Lease, utcnow


class LeaseHeld(UserError):
    """Another live run holds the lineage."""


def holder_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _alive(holder: str) -> bool:
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname():
        return True  # cannot see another machine's processes: trust the heartbeat
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    return True


def acquire_lease(store: Store, lineage: str, ttl_s: int = 120) -> tuple[str, int]:
    """Take the lineage's lease and a new fencing token, or raise ``LeaseHeld`` naming the live holder.

    A lease is free when released, when its holder's process is gone (same host) or when its heartbeat is
    older than its ttl, so a run killed with -9 can be started again at once."""
    me = holder_id()
    now = utcnow()
    with store.session() as s:
        lease = s.get(Lease, lineage, with_for_update=True)
        if lease is None:
            lease = Lease(lineage=lineage, holder="", acquired_at=now, heartbeat_at=now, ttl_s=ttl_s, token=0)
            s.add(lease)
        beat = lease.heartbeat_at if lease.heartbeat_at.tzinfo else lease.heartbeat_at.replace(tzinfo=timezone.utc)
        fresh = now - beat < timedelta(seconds=lease.ttl_s)
        if lease.holder and lease.holder != me and fresh and _alive(lease.holder):
            raise LeaseHeld(f"lineage {lineage!r} is being run by {lease.holder} (since "
                            f"{lease.acquired_at:%Y-%m-%d %H:%M:%S} UTC); wait for it to finish or stop it first")
        lease.holder, lease.acquired_at, lease.heartbeat_at, lease.ttl_s = me, now, now, ttl_s
        lease.token = (lease.token or 0) + 1
        return me, lease.token


def heartbeat(store: Store, lineage: str, holder: str, token: int) -> bool:
    """Renew the lease; False when it is no longer ours (another run took it over)."""
    with store.session() as s:
        done = s.execute(update(Lease).where(Lease.lineage == lineage, Lease.holder == holder, Lease.token == token)
                         .values(heartbeat_at=utcnow()))
        return done.rowcount == 1


def release_lease(store: Store, lineage: str, holder: str, token: int | None = None) -> None:
    """Free the lease if it is still ours; the row (and its token) stays so tokens keep growing."""
    with store.session() as s:
        query = update(Lease).where(Lease.lineage == lineage, Lease.holder == holder)
        if token is not None:
            query = query.where(Lease.token == token)
        s.execute(query.values(holder=""))


class Fence:
    """Writes of one lease holder: each commits only while the lease still names ``holder`` and ``token``
    (checked inside the same transaction, row-locked on PostgreSQL). ``problem`` is set by the heartbeat when
    the lease is lost; every later write or check stops with it."""

    def __init__(self, store: Store, lineage: str, holder: str | None = None, token: int | None = None):
        self.store, self.lineage, self.holder, self.token = store, lineage, holder, token
        self.problem: str | None = None

    def check(self) -> None:
        """Stop (exit 1) once the heartbeat has reported the lease lost."""
        if self.problem:
            raise RuntimeFailure(self.problem)

    @contextmanager
    def write(self) -> Iterator[Session]:
        self.check()
        with self.store.session() as s:
            lease = s.get(Lease, self.lineage, with_for_update=True)
            if self.token is None or lease is None or lease.holder != self.holder or lease.token != self.token:
                now = f"{lease.holder or 'nobody'} (token {lease.token})" if lease else "nobody"
                raise RuntimeFailure(f"lineage {self.lineage!r}: this run ({self.holder}, token {self.token}) "
                                     f"no longer holds the lease, {now} does; stopping without writing")
            yield s
