"""Task families: plug-ins registered under the entry-point group ``rsi.task_generators``.

A family is one module in ``task_generators/`` exposing a ``TaskFamily``; adding one edits nothing
else. Listing the families imports only their modules, never torch or a model.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points
from typing import Any

from rsi.errors import UserError
from rsi.hashing import digest
from rsi.models import Task

GROUP = "rsi.task_generators"


@dataclass(frozen=True)
class TaskFamily:
    """A verifiable task family: ``make(rng, level)`` draws (payload, answer); ``verify`` checks one answer."""

    name: str
    version: str
    description: str
    make: Callable[[random.Random, int], tuple[dict[str, Any], Any]]
    verify: Callable[[Task, Any], bool]
    min_level: int = 1
    max_level: int = 10_000

    def task(self, seed: int, level: int, index: int) -> Task:
        """The task at (seed, level, index): the same on every machine and run."""
        if not self.min_level <= level <= self.max_level:
            raise UserError(f"family {self.name!r} has levels {self.min_level}..{self.max_level}, not {level}")
        rng = random.Random(int(digest([self.name, self.version, seed, level, index])[:16], 16))
        payload, answer = self.make(rng, level)
        return Task(family=self.name, family_version=self.version, level=level, seed=seed, index=index,
                    payload=payload, answer=answer)

    def tasks(self, seed: int, level: int, n: int, start: int = 0) -> Iterator[Task]:
        for index in range(start, start + n):
            yield self.task(seed, level, index)


@cache
def _entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def family_names() -> list[str]:
    return sorted(_entry_points())


def get_family(name: str) -> TaskFamily:
    """Load a registered family; an unknown name is a user error listing the known ones."""
    eps = _entry_points()
    if name not in eps:
        known = ", ".join(family_names()) or "none installed"
        raise UserError(f"unknown task family {name!r}; known families: {known}")
    family = eps[name].load()
    if not isinstance(family, TaskFamily):
        raise UserError(f"entry point {name!r} in {GROUP} is {type(family).__name__}, not a TaskFamily")
    return family
