"""Addition of two non-negative integers. Level n: both operands have exactly n digits.

The text format (digit order, padding) is the harness's business; a task is just two integers and
their sum, and the verifier compares integers.
"""

from __future__ import annotations

import random
import re
from collections.abc import Generator
from typing import Any

from rsi.errors import UserError
from rsi.hcp import Harness
from rsi.models import Task
from rsi.proposers import Proposal, Space, variant
from rsi.tasks import TaskFamily


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
    read=read,
)


# ---- the harness proposer "addition": its answer and prompt formats, and its plan -----------------------------
PAD_PROMPT = "{{ task.a | digits_lsb(vars.width) }}+{{ task.b | digits_lsb(vars.width) }}="
PAD_ANSWER = "{{ answer | digits_lsb(vars.width + 1) }}"


def formats(harness: Harness, space: Space) -> list[Proposal]:
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
