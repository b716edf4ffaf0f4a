"""Addition of two non-negative integers. Level n: both operands have exactly n digits.

The text format (digit order, padding) is the harness's business; a task is just two integers and
their sum, and the verifier compares integers.
"""

from __future__ import annotations

import random
from typing import Any

from rsi.models import Task
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


family = TaskFamily(
    name="addition",
    version="2",  # 2: tasks drawn per split (train / heldout / test by a hash of the operand pair)
    description="a + b with n-digit operands at level n",
    make=make,
    verify=verify,
    max_level=100,
    split_key=split_key,
)
