"""Dynamic batching: concurrent proxy requests to one in-process backend decoded in one backend call.

The ``hf`` backend decodes one call at a time (a lock) but a call of many prompts costs little more than a call
of one. ``Batcher`` wraps a backend with the same ``generate``/``chat`` methods; a call waits in a queue, and one
thread takes every waiting call with the same (mode, adapter, sampling, tools) into one backend call, so the
requests that arrive while a batch decodes go together in the next one. Nothing waits on purpose: a lone
request is decoded at once.

A reply does not depend on what it was batched with: the backend's rows are independent of the batch (greedy
and sampled, ``rsi.backends.hf``), except that a prompt repeated in one call gets another random stream for
each occurrence, so with temperature > 0 a call whose prompt is already in the batch waits for the next one.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from rsi.backends.base import Completion, SamplingParams
from rsi.models import Message


@dataclass
class Call:
    mode: str  # "generate" or "chat"
    items: list[Any]  # prompts, or conversations
    params: SamplingParams
    adapter: str | None
    tools: Sequence[dict] = ()
    result: Future = field(default_factory=Future)

    def key(self) -> tuple:
        return self.mode, self.adapter, self.params.model_dump_json(), json.dumps(list(self.tools), sort_keys=True)

    def texts(self) -> set[str]:
        return {json.dumps(i if isinstance(i, str) else [m.model_dump() for m in i]) for i in self.items}


class Submitter:
    """``generate`` and ``chat`` of a backend that queues calls: ``submit`` returns a future of the completions."""

    def submit(self, mode: str, items: list[Any], params: SamplingParams, adapter: str | None,
               tools: Sequence[dict] = ()) -> Future:
        raise NotImplementedError

    def generate(self, prompts: Sequence[str], params: SamplingParams, adapter: str | None = None
                 ) -> list[list[Completion]]:
        return self.submit("generate", list(prompts), params, adapter).result()

    def chat(self, conversations: Sequence[Sequence[Message]], tools: Sequence[dict], params: SamplingParams,
             adapter: str | None = None) -> list[list[Completion]]:
        return self.submit("chat", [list(c) for c in conversations], params, adapter, tools).result()


class Batcher(Submitter):
    """A backend's ``generate`` and ``chat``, with concurrent calls of equal settings merged into one."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._waiting: list[Call] = []
        self._ready = threading.Condition()
        threading.Thread(target=self._run, name="rsi-batcher", daemon=True).start()

    def submit(self, mode: str, items: list[Any], params: SamplingParams, adapter: str | None,
               tools: Sequence[dict] = ()) -> Future:
        """Queue a call (``mode`` 'generate' with prompts, or 'chat' with conversations); its future holds the
        completions, or the backend's exception."""
        call = Call(mode, items, params, adapter, tools)
        with self._ready:
            self._waiting.append(call)
            self._ready.notify()
        return call.result

    def close(self) -> None:
        self.backend.close()

    def _take(self) -> list[Call]:
        with self._ready:
            while not self._waiting:
                self._ready.wait()
            batch, self._waiting = take(self._waiting)
            return batch

    def _run(self) -> None:
        while True:
            decode(self.backend, self._take())


def take(waiting: list[Call]) -> tuple[list[Call], list[Call]]:
    """(the oldest waiting call and every later one that may share its backend call, the calls left waiting)."""
    first = waiting[0]
    batch, seen, rest = [first], first.texts(), []
    for call in waiting[1:]:
        texts = call.texts()
        if call.key() == first.key() and not (first.params.temperature > 0 and texts & seen):
            batch.append(call)
            seen |= texts
        else:
            rest.append(call)
    return batch, rest


def decode(backend: Any, batch: list[Call]) -> None:
    """One backend call for the batch, each call's future done when it returns; when it raises, each call alone
    (one bad call must not fail the others), as if unbatched."""
    try:
        _decode(backend, batch)
    except Exception as exc:
        if len(batch) == 1:
            batch[0].result.set_exception(exc)
            return
        for call in batch:
            try:
                _decode(backend, [call])
            except Exception as alone:
                call.result.set_exception(alone)


def _decode(backend: Any, batch: list[Call]) -> None:
    first, items = batch[0], [i for call in batch for i in call.items]
    if first.mode == "chat":
        out = backend.chat(items, first.tools, first.params, adapter=first.adapter)
    else:
        out = backend.generate(items, first.params, adapter=first.adapter)
    start = 0
    for call in batch:
        call.result.set_result(out[start:start + len(call.items)])
        start += len(call.items)
