"""Holding a lineage's lease for a run: taken at the start, renewed by a heartbeat thread, released at the end.
The SQL is ``rsi.store.leases``."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from rsi.store.leases import Fence, acquire_lease, heartbeat, release_lease

log = logging.getLogger("rsi.cycle")


@contextmanager
def holding_lease(fence: Fence, ttl_s: int = 120) -> Iterator[Fence]:
    """Take the lineage's lease for ``fence`` (its holder and token are set), renewed by a heartbeat thread, and
    release it at the end; a fence that already names a holder is held by its opener and left to it."""
    if fence.holder is not None:
        yield fence
        return
    fence.holder, fence.token = acquire_lease(fence.store, fence.lineage, ttl_s)
    stop = threading.Event()
    threading.Thread(target=keep_alive, args=(fence, stop), daemon=True).start()
    try:
        yield fence
    finally:
        stop.set()
        release_lease(fence.store, fence.lineage, fence.holder, fence.token)
        fence.holder = fence.token = None


def keep_alive(fence: Fence, stop: threading.Event, every_s: float = 30.0, retries: int = 5,
               backoff_s: float = 2.0) -> None:
    """The heartbeat thread: renew every ``every_s``; a failed renewal (e.g. SQLite 'database is locked') is
    retried with backoff. After ``retries`` failures in a row, or when the lease was taken over, it records
    why in ``fence.problem``; the run stops at its next write or check with that message (exit 1)."""
    failures, last = 0, ""
    while not stop.wait(every_s if failures == 0 else backoff_s * 2 ** min(failures, 4)):
        try:
            if not heartbeat(fence.store, fence.lineage, fence.holder, fence.token):
                fence.problem = (f"lineage {fence.lineage!r}: the lease was taken over by another run; "
                                 "this run stops without writing more")
                return
            failures = 0
        except Exception as exc:  # noqa: BLE001 - any DB error: retry, and report if it persists
            failures, last = failures + 1, str(exc).splitlines()[0]
            log.warning("lease heartbeat failed (%d/%d): %s", failures, retries, last)
            if failures >= retries:
                fence.problem = (f"lineage {fence.lineage!r}: the lease heartbeat failed {failures} times "
                                 f"in a row (last: {last}); stopping so no other run can overlap. Run `rsi run` "
                                 "again to continue where it stopped")
                return
