"""Selection: a query over audited trajectories that yields the next training set.

Only trajectories with a passed verdict are eligible. Filters: one copy of each (task, completion),
at most ``cap_per_task`` per task, an optional learnability band on the per-task pass rate. Replay
keeps earlier generations' selected examples (and the champion's verified answers at mastered levels)
in the set against forgetting. The result is content-addressed by its ordered examples.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rsi import plugins
from rsi.hashing import digest


class SelectionSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: str = Field("distinct_passed", description=(
        "which of a task's attempts become examples: distinct_passed (its distinct passed completions, shortest "
        "episode first, up to cap_per_task), or another package's (rsi.plugins kind 'selection', entry point "
        "group rsi.selections)"))
    cap_per_task: int = Field(1, ge=1)
    band: tuple[float, float] = Field((0.0, 1.0), description="keep tasks whose pass rate lies in [lo, hi]")
    replay_generations: int = Field(3, ge=0, description="earlier generations whose selections are replayed")
    replay_cap: int = Field(4096, ge=0, description="at most this many replayed examples")

    @field_validator("policy")
    @classmethod
    def _registered(cls, name: str) -> str:
        return plugins.known("selection", name)


class Candidate(BaseModel):
    """One audited trajectory, flattened for selection."""

    model_config = ConfigDict(frozen=True)

    trajectory_id: str
    task_id: str
    level: int
    prompt: str
    completion: str
    passed: bool
    turns: tuple[tuple[str, bool], ...] = Field((), description=(
        "an episode of more than one turn: what follows the prompt, as (text, trained) pieces (assistant turns "
        "trained, each followed by EOS; tool messages not); empty for one reply, the completion"))


class Example(BaseModel):
    """One training example: the prompt the model saw and the completion it produced (and passed)."""

    model_config = ConfigDict(frozen=True)

    trajectory_id: str
    level: int
    prompt: str
    completion: str
    source: Literal["frontier", "replay"]
    turns: tuple[tuple[str, bool], ...] = Field((), description=(
        "an episode of more than one turn: what follows the prompt, as (text, trained) pieces (assistant turns "
        "trained, each followed by EOS; tool messages not); empty for one reply, the completion"))
    chat: bool = Field(False, description=(
        "chat mode: the prompt is a chat template's text, which writes its own special tokens (the trainer "
        "adds none)"))


class Dataset(BaseModel):
    model_config = ConfigDict(frozen=True)

    examples: tuple[Example, ...]
    corrupted: bool = Field(False, description="TEST SWITCH: trained on shuffled answers (a different dataset)")

    @property
    def digest(self) -> str:
        items = [[e.trajectory_id, e.source] for e in self.examples]
        return digest({"items": items, "corrupted": True} if self.corrupted else items)

    def pool(self, source: str) -> list[Example]:
        return [e for e in self.examples if e.source == source]


def select(
    candidates: Iterable[Candidate],
    replay: Sequence[Example],
    spec: SelectionSpec,
    *,
    frontier_levels: set[int],
    seed: int,
) -> Dataset:
    """Build the dataset: filtered passed candidates plus replay, in a deterministic order."""
    by_task: dict[str, list[Candidate]] = defaultdict(list)
    for c in candidates:
        by_task[c.task_id].append(c)
    chosen: list[Example] = []
    lo, hi = spec.band
    policy = plugins.get("selection", spec.policy)
    for task_id in sorted(by_task):
        # the shortest passed episodes first (fewest turns); one-reply attempts keep their id order
        attempts = sorted(by_task[task_id], key=lambda c: (len(c.turns), c.trajectory_id))
        rate = sum(c.passed for c in attempts) / len(attempts)
        if not lo <= rate <= hi:
            continue
        chosen += [Example(trajectory_id=c.trajectory_id, level=c.level, prompt=c.prompt, completion=c.completion,
                           source="frontier" if c.level in frontier_levels else "replay", turns=c.turns)
                   for c in policy(attempts, spec)]
    have = {e.trajectory_id for e in chosen}
    old = sorted({e.trajectory_id: e for e in replay if e.trajectory_id not in have}.values(),
                 key=lambda e: e.trajectory_id)
    rng = random.Random(seed)
    if len(old) > spec.replay_cap:
        old = sorted(rng.sample(old, spec.replay_cap), key=lambda e: e.trajectory_id)
    chosen += [e.model_copy(update={"source": "replay"}) for e in old]
    return Dataset(examples=tuple(chosen))


@plugins.plugin("selection", "distinct_passed")
def distinct_passed(attempts: Sequence[Candidate], spec: SelectionSpec) -> list[Candidate]:
    """A task's passed attempts with distinct completions, in the order given (shortest episode first), at most
    ``spec.cap_per_task``. A selection policy takes one task's attempts in that order (passed or not: the audit's
    verdict is ``passed``) and returns those that become examples; it never sees another task's."""
    kept: list[Candidate] = []
    for c in attempts:
        if c.passed and c.completion not in {k.completion for k in kept}:
            kept.append(c)
            if len(kept) >= spec.cap_per_task:
                break
    return kept
