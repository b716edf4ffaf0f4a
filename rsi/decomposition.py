"""Gain decomposition: how much of a candidate's accuracy its weights made, its harness made, or neither.

A candidate pair (adapter C, harness H) replaces a parent (adapter P, harness h). Both adapters are scored
under both harnesses, and the base (no adapter: no training anywhere) under H, all on the same tasks of a
level. Per level:

- weights' gain     = acc(C, h) - acc(P, h)     (the new adapter, the parent's harness held fixed)
- harness's gain    = acc(P, H) - acc(P, h)     (the new harness, the parent's adapter held fixed)
- interaction       = acc(C, H) - acc(C, h) - acc(P, H) + acc(P, h)
- the no-training reference acc(base, H), beside acc(C, H)

The three add up to acc(C, H) - acc(P, h). Every score is paired (the same tasks, by index), so each gain is
the mean of a per-task contrast (values in {-1, 0, 1}; {-2..2} for the interaction) and its interval is the
normal 95 % interval of that mean, ``mean +- 1.96 * sd / sqrt(n)``. A level whose split holds fewer tasks
than asked for is scored on every task of it (``LevelScore.exhaustive``): its gains are exact, the interval
a point. Held-out scores decided the gate; the same decomposition on the test split is what is reported.

For a plan harness, the test split's tasks are not all clean: a plan poses a long task as calls, and a call
whose problem lies in the train split is one the model may have trained on. ``clean`` scores the candidate
on the test tasks none of whose calls lie in the train split.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from rsi.evaluate import LevelScore

Z95 = 1.959963984540054


class Gain(BaseModel):
    model_config = ConfigDict(frozen=True)

    value: float
    low: float
    high: float


class LevelGain(BaseModel):
    """One level: the five pairs' accuracies and the gains they imply, on one split."""

    model_config = ConfigDict(frozen=True)

    level: int
    n: int
    exact: bool = Field(description="every task of the split at this level was scored: no sampling error")
    parent: float = Field(description="acc(P, h): the parent pair")
    adapter_only: float = Field(description="acc(C, h): the candidate's adapter under the parent's harness")
    harness_only: float = Field(description="acc(P, H): the parent's adapter under the candidate's harness")
    candidate: float = Field(description="acc(C, H): the candidate pair")
    base: float = Field(description="acc(base, H): no training anywhere, the candidate's harness")
    weights: Gain
    harness: Gain
    interaction: Gain
    clean_n: int | None = Field(None, description="plan harness, test split: tasks none of whose calls lie in "
                                "the train split")
    clean_candidate: float | None = Field(None, description="acc(C, H) on those tasks")


class Decomposition(BaseModel):
    """A candidate's gains over its parent, per level, on the held-out split (what the gate saw) and the test
    split (what is reported). Stored as the ``decompose`` stage result of its generation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    parent_pair_id: str
    candidate_pair_id: str
    parent_harness: str
    harness: str
    splits: dict[str, tuple[LevelGain, ...]]

    def level(self, split: str, level: int) -> LevelGain | None:
        return next((g for g in self.splits.get(split, ()) if g.level == level), None)


def contrast(values: Sequence[float], exact: bool) -> Gain:
    """The mean of per-task contrasts with its normal 95 % interval (a point when ``exact``)."""
    n = len(values)
    if n == 0:
        return Gain(value=0.0, low=0.0, high=0.0)
    mean = sum(values) / n
    if exact or n == 1:
        return Gain(value=mean, low=mean, high=mean)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = Z95 * sd / math.sqrt(n)
    return Gain(value=mean, low=mean - half, high=mean + half)


def level_gain(parent: LevelScore, adapter_only: LevelScore, harness_only: LevelScore, candidate: LevelScore,
               base: LevelScore, clean: Sequence[bool] | None = None) -> LevelGain:
    """The decomposition of one level from five scores of the same tasks. ``clean``: per task, whether none of
    the plan's calls for it lies in the train split (None: not a plan harness, or not the test split)."""
    scores = (parent, adapter_only, harness_only, candidate, base)
    n = len(candidate.outcomes)
    if any(len(s.outcomes) != n for s in scores):
        raise ValueError(f"level {candidate.level}: the five scores hold {[len(s.outcomes) for s in scores]} "
                         "per-task outcomes; a decomposition pairs the same tasks, so score them with one eval_n")
    p, c_h, p_h, c = ([float(x) for x in s.outcomes] for s in scores[:4])
    exact = all(s.exhaustive for s in scores)
    clean_n = clean_acc = None
    if clean is not None:
        kept = [ok for ok, keep in zip(candidate.outcomes, clean, strict=True) if keep]
        clean_n, clean_acc = len(kept), (sum(kept) / len(kept) if kept else 0.0)
    return LevelGain(
        level=candidate.level, n=n, exact=exact, parent=parent.accuracy, adapter_only=adapter_only.accuracy,
        harness_only=harness_only.accuracy, candidate=candidate.accuracy, base=base.accuracy,
        weights=contrast([a - b for a, b in zip(c_h, p)], exact),
        harness=contrast([a - b for a, b in zip(p_h, p)], exact),
        interaction=contrast([w - x - y + z for w, x, y, z in zip(c, c_h, p_h, p)], exact),
        clean_n=clean_n, clean_candidate=clean_acc)


def decompose_levels(parent: Mapping[int, LevelScore], adapter_only: Mapping[int, LevelScore],
                     harness_only: Mapping[int, LevelScore], candidate: Mapping[int, LevelScore],
                     base: Mapping[int, LevelScore], clean: Mapping[int, Sequence[bool]] | None = None,
                     ) -> tuple[LevelGain, ...]:
    return tuple(level_gain(parent[lvl], adapter_only[lvl], harness_only[lvl], candidate[lvl], base[lvl],
                            (clean or {}).get(lvl)) for lvl in sorted(candidate))


def metrics(decomposition: Decomposition) -> dict[str, float]:
    """Flat MLflow metrics: ``<split>_<quantity>_level_<L>`` for the three gains and the base reference."""
    out: dict[str, float] = {}
    for split, rows in decomposition.splits.items():
        for g in rows:
            out |= {f"{split}_gain_weights_level_{g.level}": g.weights.value,
                    f"{split}_gain_harness_level_{g.level}": g.harness.value,
                    f"{split}_gain_interaction_level_{g.level}": g.interaction.value,
                    f"{split}_acc_base_level_{g.level}": g.base,
                    f"{split}_acc_candidate_level_{g.level}": g.candidate}
            if g.clean_candidate is not None:
                out[f"{split}_acc_clean_level_{g.level}"] = g.clean_candidate
    return out


def rows(decomposition: Decomposition, split: str) -> list[dict[str, object]]:
    """One row per level for a table (CLI, MLflow table artifact, Prefect artifact)."""
    def fmt(g: Gain) -> str:
        return f"{g.value:+.3f}" if g.low == g.high else f"{g.value:+.3f} [{g.low:+.3f}, {g.high:+.3f}]"

    out = []
    for g in decomposition.splits.get(split, ()):
        row: dict[str, object] = {
            "level": g.level, "n": g.n, "no training (base, H)": round(g.base, 3), "parent (P, h)": round(g.parent, 3),
            "candidate (C, H)": round(g.candidate, 3), "weights": fmt(g.weights), "harness": fmt(g.harness),
            "interaction": fmt(g.interaction)}
        if g.clean_n is not None:
            row["clean tasks"] = f"{g.clean_candidate:.3f} of {g.clean_n}" if g.clean_n else "none"
        out.append(row)
    return out


def over_no_training(decomposition: Decomposition, split: str = "test") -> float | None:
    """Mean over the levels of acc(C, H) - acc(base, H): what the candidate's training adds to its harness."""
    levels = decomposition.splits.get(split, ())
    return sum(g.candidate - g.base for g in levels) / len(levels) if levels else None
