"""Sorting by adjacent swaps: a tool-using family. The model gets a list of digits and sorts it by calling
``swap(i)``, which exchanges the items at positions i and i+1 and returns the new list; it says it is done with a
final reply. The family verifies the final state (the list is sorted); the swaps it took do not matter, as long
as the harness's step limit allows them.

Level n: the list holds n inversions (pairs out of order), so an episode needs exactly n swaps at least, and every
swap of a neighbouring pair out of order is one of the fewest. What a turn asks stays the same at every level —
find two neighbours out of order — while the episode grows one call per level: the base learns the turn on
levels 1-2 and the lineage learns to keep it up for longer.
"""

from __future__ import annotations

import random
import re
from typing import Any

from rsi.models import Task
from rsi.substrate import Call, Context, Environment, ToolError
from rsi.tasks import TaskFamily

N = 7  # list length
MAX_LEVEL = 12  # inversions; a level-12 episode's transcript is 206 tokens of the built-in model's 256


def inversions(items: list[int]) -> int:
    """Pairs out of order: the adjacent swaps that sort ``items``, fewest."""
    return sum(a > b for k, a in enumerate(items) for b in items[k + 1:])


def make(rng: random.Random, level: int) -> tuple[dict[str, Any], list[int]]:
    """A sorted draw of N digits, then ``level`` swaps of neighbours in order: each adds one inversion."""
    while True:
        items = sorted(rng.choices(range(10), k=N))
        for _ in range(level):
            rising = _neighbours(items, out_of_order=False)
            if not rising:
                break  # too many repeated digits for this many inversions: draw again
            items = _swapped(items, rng.choice(rising))
        else:
            return {"items": items}, sorted(items)


def solve(payload: dict[str, Any]) -> list[int]:
    """The sorted list (a task's answer, as ``make`` gives it): what a task derived from a payload stores."""
    return sorted(payload["items"])


def read(text: str) -> list[dict[str, Any]]:
    """The payloads a sorting harness's prompt may pose ("3141592>" under sorting/v1): each run of N digits in it
    (the serving proxy keeps the one the harness renders back to the very text)."""
    return [{"items": [int(d) for d in run]} for run in re.findall(rf"(?<!\d)\d{{{N}}}(?!\d)", text)]


def _neighbours(items: list[int], out_of_order: bool) -> list[int]:
    """Positions k whose pair (k, k+1) is out of order (a swap there removes an inversion), or strictly in order
    (a swap there adds one); equal neighbours are neither."""
    return [k for k in range(len(items) - 1) if (items[k] > items[k + 1] if out_of_order else items[k] < items[k + 1])]


def _swapped(items: list[int], i: int) -> list[int]:
    items = list(items)
    items[i], items[i + 1] = items[i + 1], items[i]
    return items


def init(payload: dict[str, Any]) -> dict[str, Any]:
    return {"items": list(payload["items"])}


def swap(state: dict[str, Any], arguments: dict[str, Any], ctx: Context) -> tuple[dict[str, Any], str]:
    """Exchange the items at positions i and i+1; the result is the new list, as the prompt writes it."""
    items, i = state["items"], arguments["i"]
    if not 0 <= i < len(items) - 1:
        raise ToolError(f"i is a position 0..{len(items) - 2} (it swaps i and i+1), got {i}")
    state["items"] = _swapped(items, i)
    return state, "".join(map(str, state["items"]))


def verify(task: Task, outcome: Any) -> bool:
    """The final state holds the sorted list (``outcome``: the episode's final state and parsed answer)."""
    return isinstance(outcome, dict) and isinstance(outcome.get("state"), dict) \
        and outcome["state"].get("items") == task.answer


def level_of(payload: dict[str, Any]) -> int:
    return inversions(payload["items"])


MAX_MISTAKES = 2  # per demonstration: a level-n episode stays within n + 4 swaps


def expert(payload: dict[str, Any], mistakes: float = 0.0, rng: random.Random | None = None) -> list[Call]:
    """A sorting, as tool calls: swap the first neighbours out of order, until none are (a shortest one).
    With ``mistakes``, at that rate a turn instead swaps two neighbours in order (one more inversion to mend),
    at most MAX_MISTAKES times, even when the list is already sorted."""
    items, calls, made = list(payload["items"]), [], 0
    while True:
        rising, descents = _neighbours(items, out_of_order=False), _neighbours(items, out_of_order=True)
        if mistakes and made < MAX_MISTAKES and rising and rng.random() < mistakes:
            calls.append(Call("swap", {"i": (k := rng.choice(rising))}, mistake=True))
            made += 1
        elif descents:
            calls.append(Call("swap", {"i": (k := descents[0])}))
        else:
            return calls
        items = _swapped(items, k)


family = TaskFamily(
    name="sorting",
    version="2",
    description=f"Sort {N} digits with swap(i) tool calls (neighbours i, i+1); level n = n inversions.",
    make=make,
    verify=verify,
    min_level=1,
    max_level=MAX_LEVEL,
    level_of=level_of,
    solve=solve,
    read=read,
    environment=Environment(init=init, tools={"swap": swap}),
    expert=expert,
)
