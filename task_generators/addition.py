"""Addition of two non-negative integers. Level n: both operands have exactly n digits.

The text format (digit order, padding) is the harness's business; a task is just two integers and
their sum, and the verifier compares integers.
"""

from __future__ import annotations

import random
import re
from collections.abc import Generator, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rsi.basemodel import BOS_ID, EOS_ID, EVAL_STREAM, PAD_ID, TRAIN_STREAM, VOCAB, BaseRecipe
from rsi.errors import UserError
from rsi.hcp import Harness
from rsi.models import Task
from rsi.proposers import NO_EVIDENCE, Evidence, Proposal, Space, variant
from rsi.tasks import TaskFamily

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch
    from transformers import PreTrainedModel


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randrange(10) if digits == 1 else rng.randrange(10 ** (digits - 1), 10**digits)


def make(rng: random.Random, level: int) -> tuple[dict[str, Any], int]:
    a, b = _operand(rng, level), _operand(rng, level)
    return {"a": a, "b": b}, a + b


def split_key(payload: dict[str, Any]) -> list[int]:
    """a + b and b + a are one problem: they fall in the same split."""
    return sorted((payload["a"], payload["b"]))


def verify(task: Task, answer: Any) -> bool:
    return isinstance(answer, int) and not isinstance(answer, bool) and answer == task.answer


def solve(payload: dict[str, Any]) -> int:
    return payload["a"] + payload["b"]


def level_of(payload: dict[str, Any]) -> int:
    return max(len(str(payload["a"])), len(str(payload["b"])))


def read(text: str) -> list[dict[str, Any]]:
    """The payloads 'A+B=' may pose: digits as written, or least significant first (the harnesses' format),
    zero padding ignored."""
    match = re.fullmatch(r"\s*(\d{1,100})\s*\+\s*(\d{1,100})\s*=?\s*", text)
    if match is None:
        return []
    a, b = match.groups()
    return [{"a": int(a[::-1]), "b": int(b[::-1])}, {"a": int(a), "b": int(b)}]


def digit_chunks(payload: dict[str, Any], params: dict[str, Any]) -> Generator[list[dict[str, Any]], list[Any], Any]:
    """Long addition, done by the model in parts of at most ``chunk`` digits, as a carry-select adder: a payload
    of at most ``chunk`` digits is posed whole; a longer one is cut into parts (``cuts``) and posed in one round:
    the lowest part's addition, and for every higher part two, one without a carry coming in and one with it.
    The carry goes in as one more digit 5 under both operands (``a5 + b5`` = ``(a + b + 1)`` followed by 0), so
    every call adds operands of equal length, as the model learned to. Then the lowest part's carry picks the
    next part's answer, and so on up. The plan sees the payload only and only cuts, appends and joins digit
    strings; every digit of the answer comes from a model call."""
    chunk = params.get("chunk")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise UserError(f"plan 'digit_chunks': params.chunk must be a positive number of digits (got {chunk!r})")
    a, b = str(payload["a"]), str(payload["b"])
    width = max(len(a), len(b))
    if width <= chunk:
        (answer,) = yield [payload]
        return answer
    a, b = a.zfill(width)[::-1], b.zfill(width)[::-1]  # least significant digit first, to cut from the right
    edges = cuts(a, b, chunk)
    parts = [(a[lo:hi][::-1], b[lo:hi][::-1]) for lo, hi in zip(edges, edges[1:])]
    plain = [{"a": int(x), "b": int(y)} for x, y in parts]
    carried = [{"a": int(x + "5"), "b": int(y + "5")} for x, y in parts[1:]]
    answers = yield plain + carried
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in answers):
        return None  # a call gave no answer: the plan has nothing to compose
    without, with_carry = answers[:len(parts)], [None, *answers[len(parts):]]
    digits, carry = "", False
    for (x, _), plain_sum, carried_sum in zip(parts, without, with_carry, strict=True):
        size = len(x)
        if carry:
            text = str(carried_sum).zfill(size + 1)
            if text[-1] != "0":
                return None  # ...5 + ...5 ends in 0: a wrong call, reported unsolved
            text = text[:-1]
        else:
            text = str(plain_sum).zfill(size)
        low, high = text[-size:], text[:-size]
        if high not in ("", "1"):
            return None  # no part's sum (plus a carry) reaches two more digits: a wrong call, reported unsolved
        digits, carry = low + digits, high == "1"
    return int(("1" if carry else "") + digits)


def cuts(a: str, b: str, chunk: int) -> list[int]:
    """Where to cut two equal-length, least-significant-first digit strings into parts of at most ``chunk``
    digits: part k is ``[edges[k], edges[k+1])``. Preferred, in order: no part whose top digit is 0 in either
    operand (the model has only seen operands of equal length, and a part "0456 + 7891" is 456 + 7891), the
    fewest parts, the smallest largest part. (With the demo's champion at generation 2, level 7 cut evenly,
    unequal-length calls were right in 2 of 36, equal-length ones in 561 of 564: ``--even`` of
    bench/harness_research/plan_calls.py.)"""
    n = len(a)
    best: dict[int, tuple[tuple[int, int, int], list[int]]] = {0: ((0, 0, 0), [0])}
    for end in range(1, n + 1):
        options = []
        for start in range(max(0, end - chunk), end):
            if start in best:
                (bad, count, largest), edges = best[start]
                uneven = int(a[end - 1] == "0" or b[end - 1] == "0")
                options.append(((bad + uneven, count + 1, max(largest, end - start)), edges + [end]))
        best[end] = min(options)
    return best[n][1]


family = TaskFamily(
    name="addition",
    version="2",  # 2: tasks drawn per split (train / heldout / test by a hash of the operand pair)
    description="a + b with n-digit operands at level n",
    make=make,
    verify=verify,
    max_level=100,
    split_key=split_key,
    solve=solve,
    level_of=level_of,
    plans={"digit_chunks": digit_chunks},
    plan_params={"digit_chunks": {"chunk": tuple(range(1, 9))}},
    read=read,
)


# ---- the harness proposer "addition": its answer and prompt formats, and its plan -----------------------------
PAD_PROMPT = "{{ task.a | digits_lsb(vars.width) }}+{{ task.b | digits_lsb(vars.width) }}="
PAD_ANSWER = "{{ answer | digits_lsb(vars.width + 1) }}"


def formats(harness: Harness, space: Space, evidence: Evidence = NO_EVIDENCE) -> list[Proposal]:
    """Fixed-width reverse addition at each ``width`` of the space (``format`` "pad": operands and sum least
    significant digit first, zero-padded), with token limits sized to the width; and the harness as it is
    with the family's ``digit_chunks`` plan at each ``chunk`` of the space (a long addition posed as additions
    of ``chunk``-digit parts plus carries, each in the harness's own format: no migration needed). A plan's
    calls stay within the short levels the pair already adds well, so its candidates sample one reply per
    task (``decoding.samples = 1``): a task of level 16 at chunk 3 makes 11 calls, and 8 samples of each cost
    what they would not teach. Registered by entry point as the harness proposer ``addition`` (rsi.proposers)."""
    out = []
    for chunk in space.get("chunk", []):
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise UserError(f"harness_search.space.chunk: {chunk!r} is not a positive number of digits")
        out.append(variant(harness, f"chunks{chunk}", f"long additions as {chunk}-digit parts plus carries",
                           {"plan": {"name": "digit_chunks", "params": {"chunk": chunk}}, "decoding.samples": 1}))
    for fmt in space.get("format", ["pad"]):
        if fmt != "pad":
            raise UserError(f"harness_search.space.format: unknown addition format {fmt!r}; known: pad")
        for width in space.get("width", []):
            if not isinstance(width, int) or width < 1:
                raise UserError(f"harness_search.space.width: {width!r} is not a positive number of digits")
            changes = {"prompt.template": "templates/prompt.j2", "prompt.system_template": None,
                       "prompt.vars": {"width": width},
                       "answer.parser": "reversed_digits", "answer.params": {"width": width + 1},
                       "answer.template": "templates/answer.j2", "decoding.max_new_tokens": width + 2,
                       "limits.max_completion_tokens": width + 2, "limits.max_prompt_tokens": 2 * width + 12}
            out.append(variant(harness, f"pad{width}", f"fixed width {width}: levels up to {width} posable",
                               changes, {"templates/prompt.j2": PAD_PROMPT, "templates/answer.j2": PAD_ANSWER},
                               drop=tuple(harness.sources)))
    return out


# ---- the built-in base's pretraining on addition (plugin kind "pretraining", registered by entry point) ------------
#
# Task format (fixed width ``W``): ``prompt = A + "+" + B + "="`` with both operands written least-significant
# digit first and zero-padded to ``W`` digits; ``completion`` = the sum, least-significant digit first, padded to
# ``W + 1`` digits, then EOS. Level ``n`` = both operands have ``n`` random digits (leading digit nonzero for
# ``n > 1``). Loss is on completion tokens and EOS only. Pretraining draws only operand pairs of the ``train``
# split, so no held-out or test task is ever seen by the base; ``pretraining_pairs`` replays that stream.

DIGIT0_ID = VOCAB.index("0")
PLUS_ID = VOCAB.index("+")
EQ_ID = VOCAB.index("=")


def seq_len(width: int) -> int:
    """Tokens in one full example: BOS + prompt (2W+2) + completion (W+1) + EOS."""
    return 1 + (2 * width + 2) + (width + 1) + 1


def format_example(a: int, b: int, width: int) -> tuple[str, str]:
    """(prompt, completion without EOS) for ``a + b`` in reverse, fixed-width form."""
    if a < 0 or b < 0 or a >= 10**width or b >= 10**width:
        raise ValueError(f"operands must be in [0, 10**{width})")
    rev = lambda x, n: str(x).zfill(n)[::-1]  # noqa: E731
    return f"{rev(a, width)}+{rev(b, width)}=", rev(a + b, width + 1)


def _draw_digits(rng: np.random.Generator, level: int, n: int, width: int) -> np.ndarray:
    import numpy as np

    d = np.zeros((n, width), dtype=np.int64)
    d[:, :level] = rng.integers(0, 10, size=(n, level))
    if level > 1:
        d[:, level - 1] = rng.integers(1, 10, size=n)
    return d


def digits_to_int(d: np.ndarray) -> list[int]:
    """Rows of least-significant-first digits -> Python ints."""
    return [int("".join(map(str, row[::-1])) or "0") for row in d.tolist()]


def sample_operands(rng: np.random.Generator, level: int, n: int, width: int,
                    split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """Two (n, width) digit arrays, least-significant digit first, for ``level``-digit operands whose pair
    lies in ``split`` of the addition family (draws of other splits are rejected and drawn again)."""
    import numpy as np

    kept_a, kept_b, need = [], [], n
    while need:
        a, b = _draw_digits(rng, level, need, width), _draw_digits(rng, level, need, width)
        keep = np.array([family.split_of({"a": x, "b": y}) == split
                         for x, y in zip(digits_to_int(a), digits_to_int(b))], dtype=bool)
        kept_a.append(a[keep])
        kept_b.append(b[keep])
        need -= int(keep.sum())
    return np.concatenate(kept_a), np.concatenate(kept_b)


def _add_digits(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    import numpy as np

    n, w = a.shape
    s = np.zeros((n, w + 1), dtype=np.int64)
    carry = np.zeros(n, dtype=np.int64)
    for i in range(w):
        t = a[:, i] + b[:, i] + carry
        s[:, i], carry = t % 10, t // 10
    s[:, w] = carry
    return s


def _encode_batch(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Token ids [n, seq_len] for BOS + prompt + completion + EOS (matches build_tokenizer's ids)."""
    import numpy as np

    n, _ = a.shape
    cols = [
        np.full((n, 1), BOS_ID), a + DIGIT0_ID, np.full((n, 1), PLUS_ID), b + DIGIT0_ID,
        np.full((n, 1), EQ_ID), _add_digits(a, b) + DIGIT0_ID, np.full((n, 1), EOS_ID),
    ]
    return np.concatenate(cols, axis=1).astype(np.int64)



def _pretraining_batches(r: BaseRecipe) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The base's training stream: per step, (a, b) digit arrays of train-split pairs, levels by weight."""
    import numpy as np

    rng = np.random.default_rng([TRAIN_STREAM, r.seed])
    probs = np.asarray(r.level_weights, dtype=np.float64) / sum(r.level_weights)
    for _ in range(r.steps):
        counts = rng.multinomial(r.batch_size, probs)
        parts = [sample_operands(rng, lv, int(c), r.width) for lv, c in zip(r.train_levels, counts) if c]
        yield np.concatenate([a for a, _ in parts]), np.concatenate([b for _, b in parts])



def pretraining_pairs(r: BaseRecipe):
    """Every (a, b) the base trains on, in order (replays the stream; no model is built)."""
    for a, b in _pretraining_batches(r):
        yield from zip(digits_to_int(a), digits_to_int(b))


def _eval_rng(seed: int, level: int):
    import numpy as np

    return np.random.default_rng([EVAL_STREAM, seed, level])




def _generate(model: PreTrainedModel, prompt_ids: torch.Tensor, max_new: int, temperature: float,
              gen: torch.Generator | None) -> torch.Tensor:
    """Batched KV-cached decoding of equal-length prompts; returns [n, max_new] new token ids."""
    import inspect

    import torch
    from transformers import DynamicCache

    # transformers >= 5.24 renamed the forward argument ``past_key_values`` to ``cache``
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        try:
            cache = DynamicCache(config=model.config)
        except TypeError:  # older transformers
            cache = DynamicCache()
        out = model(input_ids=prompt_ids, use_cache=True, **{key: cache})
        new = []
        done = torch.zeros(prompt_ids.shape[0], dtype=torch.bool)
        for i in range(max_new):
            logits = out.logits[:, -1, :].float()
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            else:
                nxt = logits.argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, PAD_ID), nxt)
            new.append(nxt)
            done |= nxt == EOS_ID
            if bool(done.all()) or i == max_new - 1:
                break
            out = model(input_ids=nxt[:, None], use_cache=True, **{key: cache})
        res = torch.stack(new, dim=1)
        if res.shape[1] < max_new:
            res = torch.nn.functional.pad(res, (0, max_new - res.shape[1]), value=PAD_ID)
        return res


def _evaluate(model: PreTrainedModel, width: int, levels: Iterable[int], n: int, seed: int, k: int = 1,
              temperature: float = 0.0, batch: int = 512) -> dict[int, float]:
    import numpy as np
    import torch

    model.eval()
    gen = torch.Generator().manual_seed(seed)
    p0 = 1 + 2 * width + 2
    res: dict[int, float] = {}
    for lv in levels:
        a, b = sample_operands(_eval_rng(seed, lv), lv, n, width, split="heldout")
        ids = torch.from_numpy(np.unique(_encode_batch(a, b), axis=0))  # distinct held-out tasks
        m = ids.shape[0]
        prompts, target = ids[:, :p0], ids[:, p0:]
        prompts = prompts.repeat_interleave(k, dim=0)
        target = target.repeat_interleave(k, dim=0)
        ok = []
        for s in range(0, prompts.shape[0], batch):
            outp = _generate(model, prompts[s : s + batch], target.shape[1], temperature, gen)
            ok.append((outp == target[s : s + batch]).all(dim=1))
        hit = torch.cat(ok).view(m, k).any(dim=1)
        res[lv] = float(hit.float().mean())
    return res


class Text:
    """Addition's pretraining: its fixed-width reverse text, without a harness (the original recipe)."""

    harness = False

    def check(self, r: BaseRecipe) -> None:
        if r.max_position_embeddings < seq_len(r.width):
            raise ValueError("max_position_embeddings shorter than one example")

    def batches(self, r: BaseRecipe) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return _pretraining_batches(r)

    def loss(self, model: PreTrainedModel, batch: Any, r: BaseRecipe) -> tuple[torch.Tensor, int]:
        """One batch's loss on the answer positions only, and the tokens read."""
        import torch
        import torch.nn.functional as F

        p0 = 1 + 2 * r.width + 2  # index of first completion token
        ids = torch.from_numpy(_encode_batch(*batch)).to(model.device)
        hidden = model.model(input_ids=ids[:, :-1]).last_hidden_state[:, p0 - 1 :]
        logits = model.lm_head(hidden)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, p0:].reshape(-1))
        return loss, ids.shape[0] * (ids.shape[1] - 1)

    def measure(self, model: PreTrainedModel, model_dir: Path, r: BaseRecipe,
                n: int) -> tuple[dict[int, float], dict[int, float]]:
        """Greedy accuracy per level (the trained levels and two above) and pass@8 one level above, on held-out
        tasks, as text."""
        top = max(r.train_levels)
        report_levels = sorted(set(r.train_levels) | {lv for lv in (top + 1, top + 2) if lv <= r.width})
        greedy = _evaluate(model, r.width, report_levels, n, seed=r.seed)
        beyond = [lv for lv in (top + 1,) if lv <= r.width]
        return greedy, _evaluate(model, r.width, beyond, n, seed=r.seed, k=8, temperature=1.0)


pretraining = Text()
