"""The ``hf`` backend: in-process transformers + PEFT generation (CPU by default, or CUDA), batched with a KV cache.

Decoding is a plain loop over ``model(...)`` with a ``DynamicCache`` (left padding, attention mask,
explicit position ids) rather than ``model.generate``, because it lets finished rows leave the batch,
gives each sampled row its own random stream, and checks stop strings without a custom criteria class.
Measured on the 1M-param Llama (batch 256, 12 tokens, 1 thread): as fast as ``model.generate`` and the
same greedy text.

Determinism: greedy decoding is a pure function of the logits. Sampling draws one uniform number per
generated token from a per-row ``torch.Generator`` seeded from (seed, prompt text, occurrence of that
text in the call, sample index). A row's logits are bit-identical whatever else is in the call, so a call
can be split into shards (``rsi.runners``) without changing a sample. On CPU that takes three choices,
each measured necessary (``tests/test_backend_hf.py``): decoding uses one intra-op thread (with two, the
attention output depends on the thread count and the batch size: half the rows of a 2,952-row call differed
in the last bits); only prompts of equal token length share a batch (left padding moves the logits by
~1e-6); and every forward pass has at least ``MIN_ROWS`` rows (matmuls of 1-3 rows take another kernel).
Parallelism comes from processes instead: a 1M-param model gains little from threads, and on a busy
2-core CPU one thread decoded 3x faster than two.
"""

from __future__ import annotations

import gc
import hashlib
import inspect
import threading
import time
import warnings
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from rsi.backends.base import Completion, SamplingParams
from rsi.errors import UserError
from rsi.models import Message

MAX_LOADED_ADAPTERS = 8
# Fewest rows in a forward pass. CPU matmuls of 1-3 rows take another kernel than 4 or more (other last bits,
# measured with torch 2.13 on this machine's CPU), so a row's logits would depend on how many others decode
# with it; 8 leaves a margin for other CPUs.
MIN_ROWS = 8
_ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass
class _Row:
    """One (prompt, sample) to generate and, once done, its output."""

    prompt_ids: list[int]
    seed: int
    out_ids: list[int] = field(default_factory=list)
    finish_reason: Literal["stop", "length"] | None = None
    generate_s: float = 0.0


class HFBackend:
    """A local Hugging Face causal LM (float32, eval mode) with LoRA adapters switched in place.

    ``generate_s`` of a completion is the wall time of its batch divided by the rows in that batch.
    ``threads``: torch's intra-op thread count while generating (restored after each call); 1 keeps a
    row's output independent of the batch (see above), None leaves torch's setting.
    ``device``: cpu (the default, where the determinism above is measured), cuda, or auto (cuda when torch sees
    a GPU); cuda without one is a ``UserError``. Sampling's random streams stay on the CPU on either.
    Calls are serialized by a lock, so threads of a pool may share one backend.
    """

    def __init__(self, model_dir: str | Path, *, batch_size: int = 256, threads: int | None = 1,
                 device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rsi.device import resolve_device

        model_dir = Path(model_dir).expanduser().resolve()
        if not (model_dir / "config.json").is_file():
            raise UserError(f"no Hugging Face model at {model_dir} (config.json missing); pass a saved model directory")
        if batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {batch_size}")
        self.model_dir = model_dir
        self.batch_size = batch_size
        self.threads = threads
        self.device = resolve_device(device)  # a run sets it as train.device
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        # Loaded in its saved dtype, then cast: works across transformers versions (torch_dtype vs dtype).
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
        self.model = model.float().to(self.device).eval()
        self._lock = threading.Lock()
        self._peft = None  # the PeftModel wrapping self.model once an adapter is loaded
        self._adapters: OrderedDict[str, tuple[str, int, int]] = OrderedDict()  # name -> (path, mtime, size)
        self._eos_ids = _eos_ids(self.model, self.tokenizer)
        forward_args = inspect.signature(self.model.forward).parameters
        # transformers 5.x renamed ``past_key_values`` to ``cache``; use whichever this version takes.
        self._cache_kw = "cache" if "cache" in forward_args else "past_key_values"
        # Only the last position's logits are needed; skips the LM head over the prompt where supported.
        self._extra_kw = {"logits_to_keep": 1} if "logits_to_keep" in forward_args else {}
        self._pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self._eos_ids, default=0)

    # ---- public API -------------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[str], params: SamplingParams, adapter: str | None = None
    ) -> list[list[Completion]]:
        """For each prompt, ``params.n`` completions, in prompt order then sample order."""
        return self._generate(prompts, params, adapter, special=True)

    def chat(
        self, conversations: Sequence[Sequence[Message]], tools: Sequence[dict], params: SamplingParams,
        adapter: str | None = None,
    ) -> list[list[Completion]]:
        """For each conversation, ``params.n`` assistant replies: the chat template's text of the conversation
        (``rsi.chat.render``, the assistant's turn opened) decoded as a prompt like any other, without the special
        tokens the tokenizer adds to plain text (the template writes its own); tool calls read from the reply."""
        from rsi import chat

        chat.require_template(self.tokenizer, str(self.model_dir))
        texts = [chat.render(self.tokenizer, messages, tools) for messages in conversations]
        outputs = self._generate(texts, params, adapter, special=False)
        if not tools:
            return outputs
        return [[c.model_copy(update={"tool_calls": chat.parse_tool_calls(c.text)}) for c in row] for row in outputs]

    def _generate(self, prompts: Sequence[str], params: SamplingParams, adapter: str | None,
                  special: bool) -> list[list[Completion]]:
        if self.model is None:
            raise RuntimeError("HFBackend is closed")
        rows = self._make_rows(prompts, params, special)
        by_length: dict[int, list[_Row]] = {}
        for row in rows:  # equal lengths only share a batch: no padding, so no row depends on another's length
            by_length.setdefault(len(row.prompt_ids), []).append(row)
        with self._lock, _intra_op_threads(self.threads), self._use_adapter(adapter), torch.inference_mode():
            for length in sorted(by_length):
                group = by_length[length]
                for start in range(0, len(group), self.batch_size):
                    self._decode_batch(group[start : start + self.batch_size], params)
        completions = [self._completion(row, params) for row in rows]
        if params.temperature == 0:  # greedy samples are identical; one row per prompt was decoded
            return [[c] * params.n for c in completions]
        return [completions[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def unload_adapter(self, path: str | Path) -> None:
        """Drop a loaded adapter (no-op if it is not loaded)."""
        name = _adapter_name(Path(path).expanduser().resolve())
        if name in self._adapters:
            self._delete_adapter(name)

    def close(self) -> None:
        """Free the model and adapters."""
        self.model = None
        self._peft = None
        self._adapters.clear()
        gc.collect()

    # ---- rows and completions ---------------------------------------------------------------------

    def _make_rows(self, prompts: Sequence[str], params: SamplingParams, special: bool) -> list[_Row]:
        encoded = self.tokenizer(list(prompts), add_special_tokens=special)["input_ids"] if prompts else []
        samples = 1 if params.temperature == 0 else params.n
        seen: Counter[str] = Counter()
        rows = []
        for i, (prompt, ids) in enumerate(zip(prompts, encoded, strict=True)):
            if not ids:
                raise UserError(f"prompt {i} ({prompt!r}) encodes to no tokens; a prompt needs at least one token")
            occurrence = seen[prompt]
            seen[prompt] += 1
            rows += [_Row(list(ids), _row_seed(params.seed, prompt, occurrence, k)) for k in range(samples)]
        return rows

    def _completion(self, row: _Row, params: SamplingParams) -> Completion:
        text = self.tokenizer.decode(row.out_ids, skip_special_tokens=True)
        reason = row.finish_reason or "length"
        cut = _first_stop(text, params.stop)
        if cut is not None:
            text, reason = text[:cut], "stop"
        return Completion(
            text=text,
            prompt_tokens=len(row.prompt_ids),
            completion_tokens=len(row.out_ids),
            finish_reason=reason,
            generate_s=row.generate_s,
        )

    # ---- decoding ---------------------------------------------------------------------------------

    def _decode_batch(self, rows: list[_Row], params: SamplingParams) -> None:
        """Decode one batch in place; rows leave the batch (and its KV cache) as they finish, except that every
        forward pass keeps at least ``MIN_ROWS`` rows: filler rows top up a small batch, finished rows stay while
        fewer are running (their further tokens are discarded)."""
        started = time.perf_counter()
        batch = rows + [_Row(rows[0].prompt_ids, seed=0, finish_reason="stop") for _ in range(MIN_ROWS - len(rows))]
        ids_B_T, mask_B_T = (t.to(self.device) for t in _left_pad([r.prompt_ids for r in batch], self._pad_id))
        pos_B_T = (mask_B_T.cumsum(-1) - 1).clamp(min=0)
        generators = [torch.Generator().manual_seed(r.seed) for r in batch] if params.temperature > 0 else []
        live = list(range(len(batch)))  # batch slot -> index into batch
        cache = None
        stop_window = max((len(s) for s in params.stop), default=0) + 2  # tokens decoded to look for a stop
        for _ in range(params.max_new_tokens):
            out = self.model(
                input_ids=ids_B_T,
                attention_mask=mask_B_T,
                position_ids=pos_B_T,
                use_cache=True,
                **self._extra_kw,
                **{self._cache_kw: cache},
            )
            cache = getattr(out, self._cache_kw)
            next_B = _pick(out.logits[:, -1, :].float(), params, [generators[i] for i in live] if generators else [])
            running = [slot for slot, tok in enumerate(next_B.tolist()) if batch[live[slot]].finish_reason is None
                       and self._advance(batch[live[slot]], tok, params, stop_window)]
            if not running:
                break
            idle = [slot for slot in range(len(live)) if slot not in set(running)]
            keep = sorted(running + idle[:max(0, MIN_ROWS - len(running))])
            if len(keep) < len(live):
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                live = [live[slot] for slot in keep]
                next_B, mask_B_T, pos_B_T = next_B[index], mask_B_T[index], pos_B_T[index]
            ids_B_T = next_B[:, None]
            mask_B_T = torch.cat([mask_B_T, mask_B_T.new_ones(len(live), 1)], dim=1)
            pos_B_T = pos_B_T[:, -1:] + 1
        share = (time.perf_counter() - started) / len(rows)
        for row in rows:
            row.generate_s = share

    def _advance(self, row: _Row, token: int, params: SamplingParams, stop_window: int) -> bool:
        """Append a token to a row; False once the row is finished."""
        row.out_ids.append(token)
        if token in self._eos_ids:
            row.finish_reason = "stop"
        elif params.stop and _first_stop(self.tokenizer.decode(row.out_ids[-stop_window:], skip_special_tokens=True), params.stop) is not None:
            row.finish_reason = "stop"
        elif len(row.out_ids) >= params.max_new_tokens:
            row.finish_reason = "length"
        return row.finish_reason is None

    # ---- adapters ---------------------------------------------------------------------------------

    def _use_adapter(self, adapter: str | None) -> AbstractContextManager:
        """Activate an adapter (loading it on first use) or, for None, disable all adapters."""
        if adapter is None:
            if self._peft is None or not self._adapters:
                return nullcontext()
            return self._peft.disable_adapter()
        name = self._load_adapter(Path(adapter).expanduser().resolve())
        self._peft.set_adapter(name)
        return nullcontext()

    def _load_adapter(self, path: Path) -> str:
        """Load an adapter once; a directory whose weights changed on disk is loaded again."""
        stamp = _adapter_stamp(path)
        name = _adapter_name(path)
        if self._adapters.get(name) == stamp:
            self._adapters.move_to_end(name)
            return name
        if name in self._adapters:
            self._delete_adapter(name)
        if self._peft is None:
            from peft import PeftModel

            # Wrapping injects LoRA layers into self.model in place; self.model stays the module we call.
            self._peft = PeftModel.from_pretrained(self.model, str(path), adapter_name=name).eval()
        else:
            self._peft.load_adapter(str(path), adapter_name=name)
        self._adapters[name] = stamp
        while len(self._adapters) > MAX_LOADED_ADAPTERS:
            self._delete_adapter(next(iter(self._adapters)))
        return name

    def _delete_adapter(self, name: str) -> None:
        del self._adapters[name]
        with warnings.catch_warnings():
            # PEFT warns when the active adapter goes; the next generate sets the one it needs.
            warnings.simplefilter("ignore", UserWarning)
            self._peft.delete_adapter(name)


# ---- helpers --------------------------------------------------------------------------------------


@contextmanager
def _intra_op_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to ``threads`` for the block (None: unchanged)."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if threads is not None:
            torch.set_num_threads(previous)


def _eos_ids(model, tokenizer) -> set[int]:
    """End-of-sequence ids from the generation config and the tokenizer."""
    ids: set[int] = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(value)
    return ids


def _row_seed(seed: int, prompt: str, occurrence: int, sample: int) -> int:
    """A 63-bit seed for one sample's random stream, independent of the rest of the call."""
    digest = hashlib.sha256(f"{seed}\x00{occurrence}\x00{sample}\x00{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask, padded on the left so every row's next token is at the end."""
    width = max(len(s) for s in seqs)
    ids_B_T = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask_B_T = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids_B_T[i, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask_B_T[i, width - len(seq) :] = 1
    return ids_B_T, mask_B_T


def _pick(logits_B_V: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]) -> torch.Tensor:
    """Next token per row: argmax, or temperature + top-p sampling by inverse CDF on one uniform per row."""
    if params.temperature == 0:
        return logits_B_V.argmax(dim=-1)
    probs_B_V = torch.softmax(logits_B_V / params.temperature, dim=-1)
    sorted_B_V, order_B_V = probs_B_V.sort(dim=-1, descending=True, stable=True)
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before_B_V = sorted_B_V.cumsum(dim=-1) - sorted_B_V
        sorted_B_V = sorted_B_V.masked_fill(mass_before_B_V >= params.top_p, 0.0)
    cum_B_V = sorted_B_V.cumsum(dim=-1)
    uniform_B = torch.cat([torch.rand(1, generator=g) for g in generators]).to(logits_B_V.device)
    target_B1 = (uniform_B * cum_B_V[:, -1])[:, None]
    rank_B1 = torch.searchsorted(cum_B_V, target_B1, right=True).clamp(max=cum_B_V.shape[-1] - 1)
    # A rank may land on a zeroed tail entry only through rounding at the very top; step back to a kept one.
    kept_B = (sorted_B_V > 0).sum(dim=-1, keepdim=True)
    rank_B1 = torch.minimum(rank_B1, kept_B - 1)
    return order_B_V.gather(-1, rank_B1).squeeze(-1)


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index of the earliest stop string in text, or None."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def _adapter_name(path: Path) -> str:
    """A PEFT-safe adapter name derived from the resolved directory."""
    return "a" + hashlib.sha256(str(path).encode()).hexdigest()[:16]


def _adapter_stamp(path: Path) -> tuple[str, int, int]:
    """Path plus weight-file mtime and size, so a rewritten adapter directory is not served stale."""
    if not (path / "adapter_config.json").is_file():
        raise UserError(f"no LoRA adapter at {path} (adapter_config.json missing); pass a PEFT save_pretrained directory")
    for filename in _ADAPTER_WEIGHT_FILES:
        weights = path / filename
        if weights.is_file():
            stat = weights.stat()
            return str(path), stat.st_mtime_ns, stat.st_size
    raise UserError(f"LoRA adapter at {path} has no weights ({' or '.join(_ADAPTER_WEIGHT_FILES)})")
