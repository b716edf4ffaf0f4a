"""The ``openai`` backend: completions from an OpenAI-compatible server (a vLLM server with runtime LoRA).

Requests go to ``POST {base_url}/completions`` with a list of up to ``batch_size`` prompts each (``chat``: to
``POST {base_url}/chat/completions``, one conversation each, with the harness's tools), at most
``concurrency`` requests in flight (a thread pool). Transient failures (connection errors, timeouts, 429,
5xx) are retried with exponential backoff; other 4xx answers are not (they become a ``UserError`` naming
the server's message). A server that cannot be reached at all is a ``RuntimeFailure``.

Token counts. The server's ``usage`` is per request, not per completion, so each completion is counted on
its own: the backend asks vLLM for the token ids (``return_token_ids``), which include the EOS token when a
completion ended on EOS -- the same count the ``hf`` backend reports. A server that does not return token ids
needs ``tokenizer_dir``: the completion text (plus the matched stop string, which the server cuts off) is
tokenized without special tokens, +1 when ``finish_reason`` is ``"stop"`` because of EOS (``stop_reason``
null); a stop string that spans a token boundary may then be off by one token.

Determinism. Greedy (temperature 0) asks for one sample per prompt and repeats it ``n`` times, as the ``hf``
backend does. Sampling sends ``seed`` with each request; vLLM seeds every prompt of a request with its own
generator from that seed, so a prompt's samples depend on (prompt, seed, sample index), not on the other
prompts or the batch. A prompt that occurs more than once in one call gets a different seed for each
occurrence (derived from the seed and the occurrence number), so repeated prompts give independent samples.
The sampled values differ from the ``hf`` backend's (different random streams); greedy outputs agree up to
floating-point differences between the two engines' kernels.

Adapters. ``generate(..., adapter=DIR)`` loads the adapter into the server at run time
(``POST /v1/load_lora_adapter``, needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` on the server) under the
name ``rsi-<first 16 hex of rsi.train.adapter_hash(DIR)>``: a name per content, so two versions of an adapter
never share a name (or the server's prefix cache), and the same content loaded by two clients is one
adapter. At most ``max_adapters`` (the server's ``--max-loras``) stay loaded; the least recently used one
is unloaded (``POST /v1/unload_lora_adapter``). ``close()`` unloads what this backend loaded. An adapter that
vanished from the server (restart, another client unloaded it) is loaded again once, transparently.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from rsi.backends.base import Completion, SamplingParams
from rsi.errors import RuntimeFailure, UserError
from rsi.models import Message, ToolCall

_RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class _AdapterGone(Exception):
    """The server does not know the adapter name a request used."""


class OpenAIBackend:
    """A ``GenerationBackend`` over HTTP; thread-safe (calls may overlap)."""

    def __init__(
        self,
        base_url: str,
        model: str = "base",
        *,
        tokenizer_dir: Path | None = None,
        concurrency: int = 8,
        timeout_s: float = 60,
        retries: int = 4,
        batch_size: int = 64,
        api_key: str | None = None,
        max_adapters: int = 4,
        backoff_s: float = 0.5,
    ) -> None:
        import httpx

        if concurrency < 1 or batch_size < 1 or retries < 0 or max_adapters < 1:
            raise UserError("concurrency, batch_size and max_adapters must be >= 1 and retries >= 0")
        base_url = base_url.rstrip("/")
        if not base_url.endswith("/v1"):
            base_url += "/v1"
        self.base_url = base_url
        self.model = model
        self.tokenizer_dir = Path(tokenizer_dir).expanduser().resolve() if tokenizer_dir else None
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.retries = retries
        self.batch_size = batch_size
        self.max_adapters = max_adapters
        self.backoff_s = backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            headers=headers, timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            limits=httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2),
        )
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="rsi-openai")
        self._tokenizer = None
        self._tok_lock = threading.Lock()
        self._post = partial(_post_json, self._client, base_url, retries, backoff_s)
        self._adapters = _Adapters(self._post, max_adapters)
        self._closed = False

    # ---- public API -------------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[str], params: SamplingParams, adapter: str | None = None
    ) -> list[list[Completion]]:
        """For each prompt, ``params.n`` completions, in prompt order then sample order."""
        if self._closed:
            raise RuntimeError("OpenAIBackend is closed")
        prompts = list(prompts)
        if not prompts:
            return []
        with self._adapters.serving(adapter, self.model) as name:
            return self._generate(prompts, params, name, adapter)

    def chat(
        self, conversations: Sequence[Sequence[Message]], tools: Sequence[dict], params: SamplingParams,
        adapter: str | None = None,
    ) -> list[list[Completion]]:
        """For each conversation, ``params.n`` assistant replies from ``POST /chat/completions`` (one request per
        conversation, the server's chat template and tool-call parser); seeds as for ``generate``."""
        if self._closed:
            raise RuntimeError("OpenAIBackend is closed")
        if not conversations:
            return []
        samples = 1 if params.temperature == 0 else params.n
        seen: Counter[str] = Counter()
        bodies = []
        for messages in conversations:
            wire = [_wire_message(m) for m in messages]
            key = json.dumps(wire, sort_keys=True)
            seed = params.seed if not seen[key] else _occurrence_seed(params.seed, seen[key])
            seen[key] += 1
            body: dict[str, Any] = {"messages": wire, "n": samples, "temperature": params.temperature,
                                    "top_p": params.top_p, "max_tokens": params.max_new_tokens, "seed": seed,
                                    "return_token_ids": True, "skip_special_tokens": True}
            if tools:
                body["tools"] = list(tools)
            if params.stop:
                body["stop"] = list(params.stop)
            bodies.append(body)
        with self._adapters.serving(adapter, self.model) as name:
            futures = [self._pool.submit(self._chat_job, {**body, "model": name}, samples) for body in bodies]
            replies = [future.result() for future in futures]
        return [row * params.n if samples == 1 else row for row in replies]

    def _chat_job(self, body: dict[str, Any], samples: int) -> list[Completion]:
        started = time.perf_counter()
        data = self._post("/chat/completions", body)
        share = (time.perf_counter() - started) / samples
        choices = sorted(data.get("choices", []), key=lambda c: c["index"])
        if len(choices) != samples:
            raise RuntimeFailure(f"server returned {len(choices)} chat choices for n={samples}")
        usage = data.get("usage") or {}
        prompt_ids = data.get("prompt_token_ids")
        prompt_tokens = len(prompt_ids) if prompt_ids is not None else int(usage.get("prompt_tokens", 0))
        return [_chat_completion(c, prompt_tokens, usage if samples == 1 else {}, share, self._encode) for c in choices]

    def adapter_name(self, adapter: str | Path) -> str:
        """The server-side name of an adapter directory: ``rsi-`` + 16 hex of its content hash."""
        return self._adapters.name(adapter)

    def loaded_adapters(self) -> dict[str, str]:
        """Adapters this backend has loaded into the server: name -> directory, least recently used first."""
        with self._adapters.lock:
            return dict(self._adapters.loaded)

    def unload_adapter(self, adapter: str | Path) -> None:
        """Unload an adapter this backend loaded (no-op if it is not loaded)."""
        name = self._adapters.name(adapter)
        with self._adapters.lock:
            if name in self._adapters.loaded:
                self._adapters.unload(name)

    def close(self) -> None:
        """Unload the adapters this backend loaded and release the connections."""
        if self._closed:
            return
        self._closed = True
        self._adapters.close()
        self._pool.shutdown(wait=True)
        self._client.close()

    def __enter__(self) -> OpenAIBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- generation -------------------------------------------------------------------------------

    def _generate(self, prompts: list[str], params: SamplingParams, name: str, adapter: str | None) -> list[list[Completion]]:
        greedy = params.temperature == 0
        samples = 1 if greedy else params.n
        # Occurrence k of a prompt goes into requests with seed(k): repeated prompts sample independently.
        seen: Counter[str] = Counter()
        by_occurrence: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            by_occurrence.setdefault(seen[prompt], []).append(i)
            seen[prompt] += 1
        jobs = []
        for occurrence, indices in sorted(by_occurrence.items()):
            seed = params.seed if occurrence == 0 else _occurrence_seed(params.seed, occurrence)
            for start in range(0, len(indices), self.batch_size):
                jobs.append((indices[start : start + self.batch_size], seed))
        results: list[list[Completion] | None] = [None] * len(prompts)
        futures = [self._pool.submit(self._run_job, [prompts[i] for i in idx], params, samples, seed, name, adapter)
                   for idx, seed in jobs]
        for (idx, _), future in zip(jobs, futures, strict=True):
            for i, completions in zip(idx, future.result(), strict=True):
                results[i] = completions * params.n if greedy else completions
        return results  # type: ignore[return-value]

    def _run_job(self, prompts: list[str], params: SamplingParams, samples: int, seed: int, name: str,
                 adapter: str | None) -> list[list[Completion]]:
        body: dict[str, Any] = {
            "model": name,
            "prompt": prompts,
            "n": samples,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_new_tokens,
            "seed": seed,
            "return_token_ids": True,
            "skip_special_tokens": True,
        }
        if params.stop:
            body["stop"] = list(params.stop)
        started = time.perf_counter()
        try:
            data = self._post("/completions", body)
        except _AdapterGone:
            if adapter is None:
                raise UserError(f"the server at {self.base_url} does not serve model {name!r}; "
                                f"check the model name (`rsi engine status` lists them)") from None
            with self._adapters.lock:  # restarted server or another client unloaded it: load again, once
                self._adapters.loaded.pop(name, None)
                self._adapters.load(name, str(Path(adapter).expanduser().resolve()))
            data = self._post("/completions", body)
        share = (time.perf_counter() - started) / max(1, len(prompts) * samples)
        choices = sorted(data.get("choices", []), key=lambda c: c["index"])
        if len(choices) != len(prompts) * samples:
            raise RuntimeFailure(f"server returned {len(choices)} choices for {len(prompts)} prompts x n={samples}")
        out = []
        for p, prompt in enumerate(prompts):
            row = [self._completion(prompt, choices[p * samples + k], params, share) for k in range(samples)]
            out.append(row)
        return out

    def _completion(self, prompt: str, choice: dict[str, Any], params: SamplingParams, share: float) -> Completion:
        text = choice.get("text") or ""
        reason = "stop" if choice.get("finish_reason") == "stop" else "length"
        token_ids = choice.get("token_ids")
        prompt_ids = choice.get("prompt_token_ids")
        if token_ids is not None:
            completion_tokens = len(token_ids)
        else:
            stop_reason = choice.get("stop_reason")
            counted = text + stop_reason if isinstance(stop_reason, str) else text
            completion_tokens = len(self._encode(counted, special=False))
            if reason == "stop" and stop_reason is None:
                completion_tokens += 1  # the EOS token, which the text does not show
        prompt_tokens = len(prompt_ids) if prompt_ids is not None else len(self._encode(prompt, special=True))
        return Completion(text=text, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          finish_reason=reason, generate_s=share)

    def _encode(self, text: str, *, special: bool) -> list[int]:
        with self._tok_lock:
            if self._tokenizer is None:
                if self.tokenizer_dir is None:
                    raise UserError(f"the server at {self.base_url} returns no token ids; pass tokenizer_dir "
                                    "(the model directory) so the backend can count tokens")
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir, local_files_only=True)
        return self._tokenizer(text, add_special_tokens=special)["input_ids"]


class _Adapters:
    """The LoRA adapters one backend loaded into the server, by content name, least recently used first; those
    not in use by a running call are unloaded beyond ``max_adapters``."""

    def __init__(self, post: Callable[[str, dict[str, Any]], dict[str, Any]], max_adapters: int):
        self.post, self.max_adapters = post, max_adapters
        self.lock = threading.RLock()
        self.loaded: OrderedDict[str, str] = OrderedDict()  # adapter name -> path, least recently used first
        self.in_use: Counter[str] = Counter()
        self.hashes: dict[tuple, str] = {}

    @contextmanager
    def serving(self, adapter: str | None, base: str) -> Iterator[str]:
        """The model name requests use: the base's, or the adapter's, loaded and held for the block."""
        if adapter is None:
            yield base
            return
        name = self.acquire(adapter)
        try:
            yield name
        finally:
            with self.lock:
                self.in_use[name] -= 1
                self.evict()

    def name(self, adapter: str | Path) -> str:
        """The server-side name of an adapter directory: ``rsi-`` + 16 hex of its content hash."""
        path = Path(adapter).expanduser().resolve()
        if not (path / "adapter_config.json").is_file():
            raise UserError(f"no LoRA adapter at {path} (adapter_config.json missing); pass a PEFT save_pretrained directory")
        weights = path / "adapter_model.safetensors"
        if not weights.is_file():
            raise UserError(f"LoRA adapter at {path} has no adapter_model.safetensors")
        key = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in (weights, path / "adapter_config.json"))
        if key not in self.hashes:
            from rsi.train import adapter_hash

            self.hashes[key] = "rsi-" + adapter_hash(path)[:16]
        return self.hashes[key]

    def acquire(self, adapter: str) -> str:
        name = self.name(adapter)
        path = str(Path(adapter).expanduser().resolve())
        with self.lock:
            if name in self.loaded:
                self.loaded.move_to_end(name)
            else:
                self.load(name, path)
            self.in_use[name] += 1
            self.evict()
        return name

    def load(self, name: str, path: str) -> None:
        try:
            self.post("/load_lora_adapter", {"lora_name": name, "lora_path": path})
        except UserError as exc:
            if "already" not in str(exc).lower():  # loaded by another client under the same content name
                raise UserError(f"the server could not load adapter {path} as {name}: {exc}") from None
        self.loaded[name] = path
        self.loaded.move_to_end(name)

    def unload(self, name: str) -> None:
        try:
            self.post("/unload_lora_adapter", {"lora_name": name})
        except (UserError, _AdapterGone):
            pass  # not loaded there (any more): nothing to do
        self.loaded.pop(name, None)

    def evict(self) -> None:
        """Unload least recently used adapters, not in use by a running call, down to ``max_adapters``."""
        for name in list(self.loaded):
            if len(self.loaded) <= self.max_adapters:
                return
            if self.in_use[name] <= 0:
                self.in_use.pop(name, None)
                self.unload(name)

    def close(self) -> None:
        with self.lock:
            for name in list(self.loaded):
                try:
                    self.unload(name)
                except Exception:  # the server may be gone already; nothing to unload then
                    self.loaded.pop(name, None)


def _post_json(client: Any, base_url: str, retries: int, backoff_s: float, path: str,
               body: dict[str, Any]) -> dict[str, Any]:
    """POST JSON with retries on transient errors; the decoded JSON answer (``{}`` for an empty body)."""
    import httpx

    url = base_url + path
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1) * (1 + 0.25 * random.random()))
        try:
            response = client.post(url, json=body)
        except httpx.TransportError as exc:  # connection refused/reset, timeouts
            last = f"{type(exc).__name__}: {exc}"
            continue
        if response.status_code in _RETRY_STATUS:
            last = f"HTTP {response.status_code}: {response.text[:500]}"
            continue
        if response.status_code == 404 and "model" in body and _mentions_missing_model(response):
            raise _AdapterGone(body["model"])
        if response.status_code >= 400:
            raise UserError(f"{url} rejected the request (HTTP {response.status_code}): {_error_message(response)}")
        try:
            return response.json() if response.content else {}
        except ValueError:
            return {"text": response.text}
    raise RuntimeFailure(
        f"the OpenAI-compatible server at {base_url} did not answer after {retries + 1} tries "
        f"({last}); is it running? (`rsi engine status`, `rsi engine start`)"
    )


def _wire_message(m: Message) -> dict[str, Any]:
    """A message in the OpenAI chat format (tool-call arguments as a JSON string)."""
    item: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        item["tool_calls"] = [{"id": c.id, "type": "function",
                               "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in m.tool_calls]
    if m.tool_call_id is not None:
        item["tool_call_id"] = m.tool_call_id
    return item


def _chat_completion(choice: dict[str, Any], prompt_tokens: int, usage: dict[str, Any], share: float,
                     encode: Callable[..., list[int]]) -> Completion:
    """One chat choice as a Completion: its text, its parsed tool calls, its token count (the server's token ids,
    else the request's usage for n = 1, else the text recounted plus the EOS)."""
    message = choice.get("message") or {}
    text = message.get("content") or ""
    calls = []
    for i, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") or {}
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except ValueError:
            arguments = {"_unparsed": function.get("arguments")}  # kept, so the auditor's schema check fails it
        if not isinstance(arguments, dict):
            arguments = {"_unparsed": arguments}
        calls.append(ToolCall(id=call.get("id") or f"call_{i}", name=str(function.get("name")), arguments=arguments))
    reason = "length" if choice.get("finish_reason") == "length" else "stop"  # "tool_calls" ends on the model's stop
    if choice.get("token_ids") is not None:
        tokens = len(choice["token_ids"])
    elif "completion_tokens" in usage:
        tokens = int(usage["completion_tokens"])
    else:
        tokens = len(encode(text, special=False)) + (reason == "stop")
    return Completion(text=text, tool_calls=tuple(calls), prompt_tokens=prompt_tokens, completion_tokens=tokens,
                      finish_reason=reason, generate_s=share)


def _occurrence_seed(seed: int, occurrence: int) -> int:
    digest = hashlib.sha256(f"{seed}\x00{occurrence}".encode()).digest()
    return int.from_bytes(digest[:4], "little") >> 1


def _error_message(response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:500]
        return str(err)[:500]
    return str(data)[:500]


def _mentions_missing_model(response) -> bool:
    msg = _error_message(response).lower()
    return "does not exist" in msg or "not found" in msg
