"""The proxy's in-process engine moved to its own process: a backend whose calls are batched, driven over a pipe.

Why: the ``hf`` backend's decode loop is Python (a few-layer model spends its time between torch calls, not in
them), so in the proxy's process it shares one interpreter lock with the HTTP, auth, routing and state-DB work
of every request; each of those steps makes the decode thread wait for the lock. In its own process the
decoder runs on its own core and the proxy's Python costs requests only their own latency, as vLLM's API server
and engine core are split. ``bench/serve.py`` measures the proxy against the engine alone.

``EngineProcess`` has the backend methods the proxy calls (``generate``, ``chat``, ``close``), and ``submit``
for a caller that awaits a future instead of blocking a thread. Each call is pickled to the child with an id;
a reader thread here hands the child's answers to their futures. The child batches concurrent calls exactly as
the proxy's own batcher would (``rsi.mol.batching``), on its one thread: no hop from a reader thread to a
decoding one. A child that dies fails the calls in flight and every
later one with an error naming its exit code; the child exits when the pipe closes, so a killed proxy leaves
no engine behind.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import pickle
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from rsi.backends.base import SamplingParams
from rsi.mol.batching import Submitter

log = logging.getLogger(__name__)


class EngineProcess(Submitter):
    """``get_backend(kind, **options)`` in a child process (spawned: no inherited threads or locks)."""

    def __init__(self, kind: str, **options: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._proc = context.Process(target=_child, args=(child, kind, options), name=f"rsi-engine-{kind}",
                                     daemon=True)
        self._proc.start()
        child.close()
        try:
            ok, value = self._conn.recv()  # the backend loaded, or why not
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the {kind} engine process exited (code {self._proc.exitcode}) while loading") from None
        if not ok:
            self._proc.join(5)
            raise value
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards the pipe's sending end and _pending
        self._dead: str | None = None
        threading.Thread(target=self._read, name="rsi-engine-reader", daemon=True).start()

    def submit(self, mode: str, items: list[Any], params: SamplingParams, adapter: str | None,
               tools: Sequence[dict] = ()) -> Future:
        """Send one call; its future holds the completions, or the exception the backend raised."""
        future: Future = Future()
        with self._lock:
            if self._dead is not None:
                raise RuntimeError(self._dead)
            call_id = next(self._ids)
            self._pending[call_id] = future
            try:
                self._conn.send((call_id, mode, items, params, adapter, list(tools)))
            except OSError:  # the child is gone; the reader is about to say so
                del self._pending[call_id]
                self._proc.join(5)
                raise RuntimeError(self._exited()) from None
        return future

    def close(self) -> None:
        """Stop the child (it frees the model as it exits) and fail what is still waiting."""
        with self._lock:
            if self._dead is None:
                self._dead = "the engine process was closed"
                try:
                    self._conn.send(None)
                except OSError:
                    pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
        self._conn.close()

    def _exited(self) -> str:
        return f"the engine process exited (code {self._proc.exitcode}); restart the proxy"

    def _read(self) -> None:
        while True:
            try:
                call_id, ok, value = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                future = self._pending.pop(call_id)
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
        self._proc.join(5)
        with self._lock:
            self._dead = self._dead or self._exited()
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(RuntimeError(self._dead))


def _picklable(exc: BaseException) -> BaseException:
    """The exception itself when it crosses the pipe intact, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _child(conn: Any, kind: str, options: dict[str, Any]) -> None:
    """The engine process, one thread: load the backend, then take every call the pipe holds, decode those that
    may share a backend call together (``rsi.mol.batching.take``), send their answers, and again; calls sent
    while a batch decodes wait in the pipe for the next. Ctrl-C in a terminal reaches the whole process group:
    the proxy shuts down and closes the pipe, which ends this loop."""
    import signal

    from rsi.backends import get_backend
    from rsi.mol.batching import Call, decode, take

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        backend = get_backend(kind, **options)
    except Exception as exc:
        conn.send((False, _picklable(exc)))
        return
    conn.send((True, None))
    waiting: list[Call] = []
    ids: dict[int, int] = {}  # id(call) -> the proxy's call id
    try:
        while True:
            while not waiting or conn.poll():  # wait for a call when there is none; take every one sent
                message = conn.recv()
                if message is None:
                    return
                call_id, *fields = message
                call = Call(*fields)
                ids[id(call)] = call_id
                waiting.append(call)
            batch, waiting = take(waiting)
            decode(backend, batch)
            for call in batch:
                exc = call.result.exception()
                conn.send((ids.pop(id(call)), True, call.result.result()) if exc is None
                          else (ids.pop(id(call)), False, _picklable(exc)))
    except (EOFError, OSError):  # the proxy is gone
        pass
    finally:
        backend.close()
