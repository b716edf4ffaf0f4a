"""Curriculum controller: which levels the next generation samples, from the champion's measured accuracy.

- ``plus_one`` (Lee et al. 2025): target the first level not yet mastered, plus a small look-ahead at the
  level after it.
- ``accelerated``: also admit every higher level whose accuracy is already above ``admit``; the model is
  partly there, so its verified samples are a learning signal now rather than a generation later.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rsi import plugins


class CurriculumSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    rule: str = Field("plus_one", description=(
        "plus_one: the lowest level not mastered; accelerated: also every higher level at or above ``admit``; or "
        "another package's (rsi.plugins kind 'curriculum', entry point group rsi.curricula)"))
    mastery: float = Field(0.9, gt=0, le=1, description="greedy accuracy at which a level counts as mastered")
    admit: float = Field(0.2, ge=0, le=1, description="accelerated: admit higher levels at or above this")
    tasks_per_level: int = Field(512, ge=1)
    lookahead_tasks: int = Field(128, ge=0)
    max_level: int = Field(100, ge=1)

    @field_validator("rule")
    @classmethod
    def _registered(cls, name: str) -> str:
        return plugins.known("curriculum", name)


class LevelPlan(BaseModel):
    model_config = ConfigDict(frozen=True)

    level: int
    n_tasks: int


def frontier(accuracy: dict[int, float], mastery: float) -> int:
    """The highest level L such that every level 1..L is mastered (0 when level 1 is not)."""
    level = 0
    while accuracy.get(level + 1, 0.0) >= mastery:
        level += 1
    return level


def plan_levels(accuracy: dict[int, float], spec: CurriculumSpec) -> list[LevelPlan]:
    """Levels and task counts for the next generation's discover stage (empty when the top is reached)."""
    target = frontier(accuracy, spec.mastery) + 1
    if target > spec.max_level:
        return []
    top = min(plugins.get("curriculum", spec.rule)(accuracy, spec, target), spec.max_level)
    plan = [LevelPlan(level=lvl, n_tasks=spec.tasks_per_level) for lvl in range(target, top + 1)]
    if spec.lookahead_tasks and top + 1 <= spec.max_level:
        plan.append(LevelPlan(level=top + 1, n_tasks=spec.lookahead_tasks))
    return plan


# ---- the rules: (held-out accuracy per level, spec, the lowest level not mastered) -> the top level to train ----


@plugins.plugin("curriculum", "plus_one")
def plus_one(accuracy: dict[int, float], spec: CurriculumSpec, target: int) -> int:
    return target


@plugins.plugin("curriculum", "accelerated")
def accelerated(accuracy: dict[int, float], spec: CurriculumSpec, target: int) -> int:
    admitted = [lvl for lvl, acc in accuracy.items() if lvl > target and acc >= spec.admit]
    return max([target, *admitted])
