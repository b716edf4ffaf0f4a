"""The promotion gate: candidate vs parent on the same held-out tasks at every level reached.

Promote only if (1) on the frontier levels the candidate solves significantly more tasks than the
parent — an exact one-sided McNemar (sign) test on the tasks where the two disagree, which is the
right test for paired outcomes — and (2) no earlier level drops by more than ``tolerance``.
"""

from __future__ import annotations

from math import comb

from pydantic import BaseModel, ConfigDict, Field

from rsi.evaluate import LevelScore


class GateSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    alpha: float = Field(0.05, gt=0, lt=1, description="one-sided significance level for the frontier gain")
    tolerance: float = Field(0.03, ge=0, le=1, description="largest accuracy drop allowed on earlier levels")


class GateDecision(BaseModel):
    model_config = ConfigDict(frozen=True)

    promote: bool
    p_value: float
    wins: int
    losses: int
    reasons: tuple[str, ...]


def sign_test_p(wins: int, losses: int) -> float:
    """P(X >= wins) for X ~ Binomial(wins + losses, 1/2): chance of this many wins if neither is better."""
    n = wins + losses
    if n == 0:
        return 1.0
    return sum(comb(n, i) for i in range(wins, n + 1)) / 2**n


def decide(
    parent: dict[int, LevelScore], candidate: dict[int, LevelScore], frontier: set[int], spec: GateSpec
) -> GateDecision:
    """The gate decision with the numbers behind it."""
    wins = losses = 0
    for level in sorted(frontier & parent.keys() & candidate.keys()):
        for p, c in zip(parent[level].outcomes, candidate[level].outcomes, strict=True):
            wins += c and not p
            losses += p and not c
    p_value = sign_test_p(wins, losses)
    reasons = []
    if p_value >= spec.alpha:
        reasons.append(f"frontier gain not significant: {wins} wins / {losses} losses, p={p_value:.3g} >= {spec.alpha}")
    for level in sorted(parent.keys() & candidate.keys() - frontier):
        drop = parent[level].accuracy - candidate[level].accuracy
        if level < min(frontier, default=level + 1) and drop > spec.tolerance:
            reasons.append(f"level {level} dropped {drop:.3f} > tolerance {spec.tolerance}")
    if not reasons:
        reasons.append(f"frontier improved: {wins} wins / {losses} losses, p={p_value:.3g}")
    promote = p_value < spec.alpha and len(reasons) == 1 and reasons[0].startswith("frontier improved")
    return GateDecision(promote=promote, p_value=p_value, wins=wins, losses=losses, reasons=tuple(reasons))
