"""Task families: plug-ins (``rsi.plugins`` kind "family") registered by entry point in ``rsi.families`` (or
``rsi.task_generators``, the group before it).

A family is one module exposing a ``TaskFamily`` (rsi's own in ``task_generators/``); adding one edits nothing
else. Listing the families imports only their modules, never torch or a model.

Splits by construction: every task belongs to exactly one of ``train``, ``heldout`` and ``test``, decided
by a hash of its split key (by default its payload), never by the seed it was drawn with. A stream of
one split rejects draws of the others, so no two splits can share a task, whatever their seeds.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from rsi import plugins
from rsi.errors import UserError
from rsi.hashing import digest
from rsi.models import SPLITS, Split, Task
from rsi.substrate import Call, Environment

# Shares of the task space; heldout decides (curriculum, gate), test only reports.
SPLIT_SHARES: dict[Split, float] = {"train": 0.8, "heldout": 0.1, "test": 0.1}
MAX_DRAWS = 10_000  # rejection draws for one task before a split is declared empty at a level
DERIVED_SEED = -1  # the seed of a derived task: one a plan poses as part of another (``TaskFamily.derive``)

# A plan (``TaskFamily.plans``): a program over payloads that poses one task as calls the harness can pose. Called
# with the task's payload and the harness's plan params, it yields lists of call payloads (one round of calls, run
# in one batch), receives their parsed answers (None where a call gave none) and returns the task's answer
# composed from them (None when it cannot). It gets neither the task's answer nor the family, so it cannot solve
# or verify: the runner (``rsi.pair.plans``) makes each call a task for the auditor.
Plan = Callable[[dict[str, Any], dict[str, Any]], Generator[list[dict[str, Any]], list[Any], Any]]


def split_of_key(family: str, key: Any) -> Split:
    """The split a task with split key ``key`` belongs to: a hash of (family, key) cut by SPLIT_SHARES."""
    u = int(digest(["rsi-split", family, key])[:13], 16) / 16**13
    edge = 0.0
    for split in SPLITS:
        edge += SPLIT_SHARES[split]
        if u < edge:
            return split
    return SPLITS[-1]


@dataclass(frozen=True)
class Proposes:
    """What a proposer family's accepted answers are: tasks of ``family``, each with the payload ``payload(answer)``
    gives (the discover stage derives the task: its split, level and answer are the family's own)."""

    family: str
    payload: Callable[[Any], dict[str, Any]]
    # hindsight: the proposer task an accepted ``answer`` answers (its ``asked`` payload rewritten to what the
    # answer is, e.g. the level it has): the proposer learns each proposal as the answer to a request for what it
    # wrote, not for what it was asked. None: the task it was asked.
    answers: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None


@dataclass(frozen=True)
class TaskFamily:
    """A verifiable task family: ``make(rng, level)`` draws (payload, answer); ``verify`` checks one answer.

    ``split_key(payload)`` names what makes two tasks the same problem for splitting (default: the
    payload itself); addition uses the unordered operand pair, so ``a + b`` and ``b + a`` share a split."""

    name: str
    version: str
    description: str
    make: Callable[[random.Random, int], tuple[dict[str, Any], Any]]
    verify: Callable[[Task, Any], bool]
    min_level: int = 1
    max_level: int = 10_000
    split_key: Callable[[dict[str, Any]], Any] | None = None
    solve: Callable[[dict[str, Any]], Any] | None = None  # the answer of any payload (derived tasks' gold)
    level_of: Callable[[dict[str, Any]], int] | None = None  # the level of any payload
    plans: dict[str, Plan] = field(default_factory=dict)  # decompositions a harness may name ([plan] name)
    # Each plan's parameters and the values a harness search may try (``rsi.proposers.plans``), e.g.
    # {"digit_chunks": {"chunk": (1, 2, ..., 8)}}: the family says what its plans take, the search picks.
    plan_params: dict[str, dict[str, tuple[Any, ...]]] = field(default_factory=dict)
    # The payloads a person's message may pose, in any harness's format (the family proposes, a harness that
    # renders one of them back to exactly the message confirms it): the serving proxy runs a plan harness's
    # plan on the task a message poses (``rsi.mol.proxy``).
    read: Callable[[str], list[dict[str, Any]]] | None = None
    # A tool-using family: the state its tasks act on and its tools (``rsi.substrate``). Its ``verify`` then
    # gets the episode's outcome, ``{"state": final state, "answer": parsed final reply}``.
    environment: Environment | None = None
    # A demonstration: the tool calls that solve a payload (the base model's pretraining episodes); called as
    # expert(payload, mistakes, rng): with mistakes > 0, at that rate per turn a wrong call the later ones mend.
    expert: Callable[[dict[str, Any], float, random.Random], list[Call]] | None = None
    # Rules of the family's own that a harness's contract may list as ``family:<name>``: each gets the task and
    # the parsed answer and returns (passed, detail); the auditor judges them like its own (``rsi.audit``).
    rules: dict[str, Callable[[Task, Any], tuple[bool, str]]] = field(default_factory=dict)
    # Jinja filters the family's harnesses' templates may use (an answer template that writes a worked answer,
    # say): each gets what the template passes it. They render answers; a harness never answers with them.
    filters: dict[str, Callable[..., str]] = field(default_factory=dict)
    # A proposer's family: its tasks ask for a task of another family, which its accepted answers are.
    proposes: Proposes | None = None

    def split_of(self, payload: dict[str, Any]) -> Split:
        return split_of_key(self.name, self.split_key(payload) if self.split_key else payload)

    def task(self, split: Split, seed: int, level: int, index: int) -> Task:
        """The task at (split, seed, level, index): the same on every machine and run, always in ``split``."""
        if not self.min_level <= level <= self.max_level:
            raise UserError(f"family {self.name!r} has levels {self.min_level}..{self.max_level}, not {level}")
        if split not in SPLITS:
            raise UserError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        rng = random.Random(int(digest([self.name, self.version, split, seed, level, index])[:16], 16))
        for _ in range(MAX_DRAWS):
            payload, answer = self.make(rng, level)
            if self.split_of(payload) == split:
                return Task(family=self.name, family_version=self.version, split=split, level=level, seed=seed,
                            index=index, payload=payload, answer=answer)
        raise UserError(f"family {self.name!r} has no {split} task at level {level} ({MAX_DRAWS} draws)")

    def derive(self, payload: dict[str, Any]) -> Task:
        """The task of ``payload`` as a plan poses it (a part of another task): in the split its payload hashes
        to, at the level of its payload, seed ``DERIVED_SEED``, so its id is its content's and the auditor can
        check it as it checks a drawn one."""
        if self.solve is None or self.level_of is None:
            raise UserError(f"family {self.name!r} cannot derive tasks (it declares no solve/level_of), so no plan "
                            "can pose parts of its tasks")
        return Task(family=self.name, family_version=self.version, split=self.split_of(payload),
                    level=self.level_of(payload), seed=DERIVED_SEED, index=0, payload=payload,
                    answer=self.solve(payload))

    def tasks(self, split: Split, seed: int, level: int, n: int) -> list[Task]:
        """Up to ``n`` distinct tasks of ``split`` (index order, repeats skipped). Fewer come back when the
        split holds fewer at this level (e.g. level 1 of addition): ``len()`` is the distinct count."""
        found: dict[str, Task] = {}
        index = 0
        while len(found) < n and index < n + 1000 + 4 * n:
            task = self.task(split, seed, level, index)
            found.setdefault(digest(task.payload), task)
            index += 1
        return list(found.values())


def family_names() -> list[str]:
    return plugins.names("family")


def get_family(name: str) -> TaskFamily:
    """Load a registered family; an unknown name is a user error listing the known ones."""
    family = plugins.get("family", name)
    if not isinstance(family, TaskFamily):
        raise UserError(f"task family {name!r} is a {type(family).__name__}, not a rsi.tasks.TaskFamily")
    return family
