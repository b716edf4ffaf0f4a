"""Sorting by swaps: a tool-using family. The model gets a shuffled list of the digits 0..N-1 and sorts it by
calling ``swap(i, j)``, which exchanges the items at positions i and j and returns the new list; it says it is
done with a final reply. The family verifies the final state (the list is sorted); the swaps it took do not
matter, as long as the harness's step limit allows them.

Level n: the list is exactly n swaps away from sorted (n = N minus its number of cycles), so an episode needs
at least n tool calls. The list is drawn by n swaps from the sorted list, each joining two cycles.
"""

from __future__ import annotations

import random
from typing import Any

from rsi.models import Task
from rsi.substrate import Context, Environment, ToolError
from rsi.tasks import TaskFamily

N = 7  # list length: levels 1..N-1


def distance(items: list[int]) -> int:
    """Fewest swaps that sort ``items`` (a permutation of 0..len-1): its length minus its cycles."""
    seen, cycles = set(), 0
    for start in range(len(items)):
        if start not in seen:
            cycles += 1
            k = start
            while k not in seen:
                seen.add(k)
                k = items[k]
    return len(items) - cycles


def make(rng: random.Random, level: int) -> tuple[dict[str, Any], list[int]]:
    items = list(range(N))
    for _ in range(level):  # swapping two items of different cycles joins them: one swap further from sorted
        while True:
            i, j = rng.sample(range(N), 2)
            if distance(_swapped(items, i, j)) > distance(items):
                break
        items = _swapped(items, i, j)
    return {"items": items}, sorted(items)


def _swapped(items: list[int], i: int, j: int) -> list[int]:
    items = list(items)
    items[i], items[j] = items[j], items[i]
    return items


def init(payload: dict[str, Any]) -> dict[str, Any]:
    return {"items": list(payload["items"])}


def swap(state: dict[str, Any], arguments: dict[str, Any], ctx: Context) -> tuple[dict[str, Any], str]:
    """Exchange the items at positions i and j; the result is the new list, as the prompt writes it."""
    items, i, j = state["items"], arguments["i"], arguments["j"]
    if not (0 <= i < len(items) and 0 <= j < len(items)):
        raise ToolError(f"positions are 0..{len(items) - 1}, got {i} and {j}")
    state["items"] = _swapped(items, i, j)
    return state, "".join(map(str, state["items"]))


def verify(task: Task, outcome: Any) -> bool:
    """The final state holds the sorted list (``outcome``: the episode's final state and parsed answer)."""
    return isinstance(outcome, dict) and isinstance(outcome.get("state"), dict) \
        and outcome["state"].get("items") == task.answer


def level_of(payload: dict[str, Any]) -> int:
    return distance(payload["items"])


def expert(payload: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A shortest sorting, as tool calls: put the smallest misplaced value in place, one swap each."""
    items, calls = list(payload["items"]), []
    for i in range(len(items)):
        if items[i] != i:
            j = items.index(i)
            items = _swapped(items, i, j)
            calls.append(("swap", {"i": i, "j": j}))
    return calls


family = TaskFamily(
    name="sorting",
    version="1",
    description=f"Sort a shuffled list of 0..{N - 1} with swap(i, j) tool calls; level n = n swaps from sorted.",
    make=make,
    verify=verify,
    min_level=1,
    max_level=N - 1,
    level_of=level_of,
    environment=Environment(init=init, tools={"swap": swap}),
    expert=expert,
)
