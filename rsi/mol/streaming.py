"""A reply streamed from rsi's vLLM engine as it is decoded, for ``rsi serve`` (``stream: true``).

The backends answer whole replies (``GenerationBackend``); a proxy streaming to a person wants the engine's text
as it comes, and wants the engine to stop when the person goes away. ``Stream`` is such a call to an
``OpenAIBackend`` (rsi's vLLM engine): ``pieces()`` sends one request with ``stream: true`` and yields the text
of each chunk the server sends, then the whole reply as a ``Completion`` (its tokens from the server's usage).
Closing the iteration early (``aclose``, or its task cancelled: the client gone) closes the connection, and
vLLM aborts a request whose connection closed, so no tokens are decoded for nobody. One sample and one try: a
reply half sent cannot be sent again. A chat call carries no tools: text once sent cannot turn out to be a call.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from rsi.backends.base import Completion
from rsi.errors import RuntimeFailure, UserError

_CLIENTS: dict[tuple[Any, Any], Any] = {}  # (backend, event loop) -> its httpx.AsyncClient: a client is its loop's


def streams(backend: Any) -> bool:
    """Whether ``backend`` can stream a reply (rsi's vLLM engine, the ``openai`` backend)."""
    from rsi.backends.openai import OpenAIBackend

    return isinstance(backend, OpenAIBackend)


class Stream(NamedTuple):
    """One reply of ``backend`` (an ``OpenAIBackend``), not requested until ``pieces()`` is iterated."""

    backend: Any
    mode: str  # "generate": ``item`` is a prompt; "chat": a conversation (Messages)
    item: Any
    params: Any  # SamplingParams (``n`` is not read: one sample)
    adapter: str | None

    async def pieces(self) -> AsyncIterator[str | Completion]:
        import httpx

        from rsi.backends.openai import _error_message, _wire_message

        backend, params = self.backend, self.params
        adapters = backend._adapters
        name = await asyncio.to_thread(adapters.acquire, self.adapter) if self.adapter else backend.model
        try:
            path = "/chat/completions" if self.mode == "chat" else "/completions"
            body: dict[str, Any] = {"model": name, "n": 1, "temperature": params.temperature, "top_p": params.top_p,
                                    "max_tokens": params.max_new_tokens, "seed": params.seed, "stream": True,
                                    "stream_options": {"include_usage": True}, "skip_special_tokens": True}
            if self.mode == "chat":
                body["messages"] = [_wire_message(m) for m in self.item]
            else:
                body["prompt"] = self.item
            if params.stop:
                body["stop"] = list(params.stop)
            text, finish, usage, started = [], "length", {}, time.perf_counter()
            try:
                async with _client(backend).stream("POST", backend.base_url + path, json=body) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        raise UserError(f"{backend.base_url}{path} rejected the request (HTTP "
                                        f"{response.status_code}): {_error_message(response)}")
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[len("data: "):])
                        usage = chunk.get("usage") or usage
                        for choice in chunk.get("choices") or ():
                            piece = ((choice.get("delta") or {}).get("content") if self.mode == "chat"
                                     else choice.get("text"))
                            if piece:
                                text.append(piece)
                                yield piece
                            if choice.get("finish_reason"):
                                finish = "length" if choice["finish_reason"] == "length" else "stop"
            except httpx.TransportError as exc:
                raise RuntimeFailure(f"the OpenAI-compatible server at {backend.base_url} broke off a streamed "
                                     f"reply ({type(exc).__name__}: {exc}); is it running? (`rsi engine status`)"
                                     ) from None
        finally:  # not awaited (a cancelled task cannot await here); an adapter unloaded off the event loop
            if self.adapter:
                asyncio.get_running_loop().run_in_executor(None, _release, adapters, name)
        yield Completion(text="".join(text), prompt_tokens=int(usage.get("prompt_tokens", 0)),
                         completion_tokens=int(usage.get("completion_tokens", 0)), finish_reason=finish,
                         generate_s=time.perf_counter() - started)


def _release(adapters: Any, name: str) -> None:
    """What ``OpenAIBackend``'s adapters do when a call that used ``name`` is done (``_Adapters.serving``)."""
    with adapters.lock:
        adapters.in_use[name] -= 1
        adapters.evict()


def _client(backend: Any) -> Any:
    """The ``httpx.AsyncClient`` of ``backend`` on the running event loop, made once (with the backend's headers
    and timeouts)."""
    import httpx

    key = (backend, asyncio.get_running_loop())
    if key not in _CLIENTS:
        for gone in [k for k in _CLIENTS if k[1].is_closed() or k[0]._closed]:  # a stopped proxy's, a closed backend's
            del _CLIENTS[gone]
        sync = backend._client
        _CLIENTS[key] = httpx.AsyncClient(headers=sync.headers, timeout=sync.timeout, limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=backend.concurrency + 2))
    return _CLIENTS[key]
