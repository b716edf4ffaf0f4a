"""The promotion gate: a candidate replaces its parent only with a significant gain and no regression.

Every check is paired: candidate, parent and the lineage's best records are scored on the same held-out
tasks of a level, so per task there are *wins* (candidate right, reference wrong) and *losses* (the
reverse). With ``alpha_r = alpha * 6 / (pi**2 * r**2)`` for the r-th candidate gated against the same
parent (``attempt = r``), the candidate is promoted if and only if

1. **gain**: at least one targeted level improves — an exact one-sided sign (McNemar) test per targeted
   level, ``p = P(Binomial(wins + losses, 1/2) >= wins)``, Holm-adjusted across the targeted levels, is
   ``<= alpha_r``;
2. **no regression vs the parent**: every other evaluated level — targeted ones that did not improve
   included — has an upper ``1 - alpha_r`` confidence bound on ``p_parent - p_candidate`` below
   ``margin``;
3. **no drift vs the lineage**: every mastered level has the same bound, against the lineage's best
   record at that level, below ``margin`` — so small losses cannot compound over generations. A level where
   the candidate answers every task as the parent does (a candidate harness that keeps the parent's adapter
   and poses that level the same way) changes nothing there: it adds no drift and is not checked again;
4. every targeted and mastered level was evaluated for both parent and candidate.

A level whose held-out split holds fewer tasks than ``eval_n`` (level 1 of addition has 9) is evaluated on
*every* task of the split (``LevelScore.exhaustive``): its accuracies are exact, not estimates, so its
gain is ``wins > losses`` and its drop is ``(losses - wins) / n``, without sampling error.

Why this holds the error rates at ``alpha`` per parent: the gain test is an exact test with Holm's
family-wise control, and each non-regression check is a separate exact-size test that must pass on its
own (an intersection-union test, so no correction across levels is needed). Summed over every retry of
one parent, ``sum_r alpha_r <= alpha * 6/pi**2 * sum_r 1/r**2 = alpha``: whatever the number of
attempts, the chance of promoting a candidate with no real gain, or one that is worse by ``margin`` at
any one level than its parent (or, at a mastered level, than the lineage's best), is at most ``alpha``.
The ``1/r**2`` schedule (rather than ``alpha/2**r``) gives the first attempt — the common case — 61 %
of ``alpha`` instead of 50 %, and decays polynomially, so long runs of retries (r >= 6) keep more power;
attempts 2-5 get less than under ``alpha/2**r`` (0.0076 against 0.0125 at r = 2 with alpha = 0.05).

The bound (``regression_bound``) is Tango's score bound for a difference of paired proportions, with a
continuity correction of one task. Its simpler conditional relative — a Clopper-Pearson bound on the
share of losses among the discordant tasks, scaled by their observed number — is *not* sound: when the
candidate only loses (7 losses, 0 wins in 256) it treats the number of discordant tasks as known and
accepts a true drop of 0.045 four times in ten. The score bound uses the variance of wins minus losses
at the restricted maximum-likelihood estimate under each hypothesised drop, so the uncertainty in how
many tasks disagree is counted. Its exact size, computed by enumerating every (wins, losses) outcome
over a grid of the nuisance parameter, stays below ``alpha`` for n in {16, 64, 256}, margins 0.02-0.08
and alpha 0.003-0.05 (tests/test_gate.py repeats this for n = 64). Identical outcomes give a small
positive bound (about ``z**2 / n``): agreeing on n sampled tasks does not prove agreement everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rsi.evaluate import LevelScore

Role = Literal["target", "mastered", "other"]


class GateSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    alpha: float = Field(0.05, gt=0, lt=1, description="false-promotion risk per parent, over all its retries")
    margin: float = Field(0.04, gt=0, lt=1, description="largest accuracy drop at any level the gate tolerates")


class LevelCheck(BaseModel):
    """One level's numbers: the gain test (targets only) and the non-regression bounds."""

    model_config = ConfigDict(frozen=True)

    level: int
    roles: tuple[Role, ...]
    wins: int
    losses: int
    p: float | None = Field(description="one-sided sign-test p-value of the gain vs the parent (targets)")
    p_holm: float | None = Field(description="p Holm-adjusted across the targeted levels")
    improved: bool
    bound_parent: float = Field(description="upper bound of p_parent - p_candidate")
    bound_best: float | None = Field(description="upper bound of p_best - p_candidate (mastered levels)")
    passed: bool


class GateDecision(BaseModel):
    model_config = ConfigDict(frozen=True)

    promote: bool
    p_value: float = Field(description="smallest Holm-adjusted gain p-value over the targets; 1.0 if none")
    wins: int = Field(description="wins over the targeted levels")
    losses: int = Field(description="losses over the targeted levels")
    reasons: tuple[str, ...]
    alpha: float = Field(description="this attempt's share of GateSpec.alpha")
    attempt: int
    levels: tuple[LevelCheck, ...] = ()


def attempt_alpha(alpha: float, attempt: int) -> float:
    """The r-th attempt's level, ``alpha * 6/(pi^2 r^2)``: it sums to ``alpha`` over r = 1, 2, ..."""
    if attempt < 1:
        raise ValueError(f"attempt counts candidates gated against one parent from 1, got {attempt}")
    return alpha * 6 / (math.pi**2 * attempt**2)


def sign_test_p(wins: int, losses: int) -> float:
    """P(X >= wins) for X ~ Binomial(wins + losses, 1/2): chance of this many wins if neither is better."""
    n = wins + losses
    if n == 0:
        return 1.0
    return sum(math.comb(n, i) for i in range(wins, n + 1)) / 2**n


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm step-down adjusted p-values, in the input order (family-wise error control)."""
    k = len(p_values)
    adjusted, running = [1.0] * k, 0.0
    for rank, i in enumerate(sorted(range(k), key=lambda j: p_values[j])):
        running = max(running, min(1.0, (k - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def _score_z(losses: int, wins: int, n: int, drop: float) -> float:
    """Tango's score statistic for H0: p_ref - p_cand = drop, continuity-corrected by one task."""
    # q: restricted MLE of P(candidate right, reference wrong) under H0, root of 2n q^2 + linear q + constant
    linear = -(losses + wins) + (2 * n - losses + wins) * drop
    constant = -wins * drop * (1 - drop)
    q = (-linear + math.sqrt(linear * linear - 8 * n * constant)) / (4 * n)
    variance = n * (2 * q + drop - drop * drop)
    gap = losses - wins - n * drop
    # one task toward 0: uncorrected, the exact size overshoots alpha (by up to 10 % at n=256, 50 % at n=16)
    gap = min(gap + 1, 0.0) if gap < 0 else gap
    if variance <= 0:
        return -math.inf if gap < 0 else 0.0
    return gap / math.sqrt(variance)


def regression_bound(losses: int, wins: int, n: int, alpha: float) -> float:
    """Upper ``1 - alpha`` confidence bound of ``p_ref - p_cand`` from n paired tasks (see module doc).

    ``losses``: tasks the reference solved and the candidate did not; ``wins``: the reverse.
    """
    if n == 0:
        return 1.0
    z = NormalDist().inv_cdf(1 - alpha)
    low, high = (losses - wins) / n, 1.0  # the statistic is 0 at the point estimate and falls with drop
    if _score_z(losses, wins, n, high) >= -z:
        return 1.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if _score_z(losses, wins, n, mid) >= -z else (low, mid)
    return high


def paired_counts(reference: LevelScore, candidate: LevelScore) -> tuple[int, int]:
    """(wins, losses) of the candidate against the reference on the same tasks."""
    if len(reference.outcomes) != len(candidate.outcomes) or len(candidate.outcomes) != candidate.n:
        raise ValueError(f"level {candidate.level}: {len(reference.outcomes)} vs {len(candidate.outcomes)} "
                         f"per-task outcomes (n={candidate.n}); the gate pairs scores of the same held-out "
                         "tasks, so evaluate both with the same eval_n and keep their outcomes")
    wins = sum(c and not r for r, c in zip(reference.outcomes, candidate.outcomes, strict=True))
    losses = sum(r and not c for r, c in zip(reference.outcomes, candidate.outcomes, strict=True))
    return wins, losses


def decide(
    parent: dict[int, LevelScore],
    candidate: dict[int, LevelScore],
    *,
    targets: set[int],
    best: dict[int, LevelScore],
    mastered: set[int],
    spec: GateSpec,
    attempt: int = 1,
) -> GateDecision:
    """The gate decision with the numbers behind it (the rule is in the module docstring)."""
    alpha = attempt_alpha(spec.alpha, attempt)
    evaluated = sorted(parent.keys() & candidate.keys())
    reasons = [f"level {lvl} ({', '.join(_roles(lvl, targets, mastered))}) was not evaluated for both parent "
               "and candidate" for lvl in sorted((targets | mastered) - set(evaluated))]
    counts = {lvl: paired_counts(parent[lvl], candidate[lvl]) for lvl in evaluated}
    tested = [lvl for lvl in evaluated if lvl in targets]
    exact = {lvl for lvl in evaluated if candidate[lvl].exhaustive and parent[lvl].exhaustive}
    raw = {lvl: (float(counts[lvl][0] <= counts[lvl][1]) if lvl in exact else sign_test_p(*counts[lvl]))
           for lvl in tested}
    adjusted = dict(zip(tested, holm([raw[lvl] for lvl in tested]), strict=True))
    checks = [_check(lvl, _roles(lvl, targets, mastered), counts[lvl], raw.get(lvl), adjusted.get(lvl),
                     paired_counts(best[lvl], candidate[lvl]) if lvl in mastered and lvl in best
                     and candidate[lvl].outcomes != parent[lvl].outcomes else None,
                     candidate[lvl].n, alpha, spec.margin, lvl in exact)
              for lvl in evaluated]
    gains = [ch for ch in checks if ch.improved]
    if not gains:
        tried = "; ".join(f"level {ch.level}: {ch.wins} wins / {ch.losses} losses, p_holm={ch.p_holm:.3g}"
                          for ch in checks if ch.p_holm is not None) or "no targeted level evaluated"
        reasons.append(f"no targeted level improved significantly at alpha={alpha:.3g} (attempt {attempt}): {tried}")
    reasons += [r for ch in checks for r in _failures(ch, best, spec)]
    promote = not reasons
    if promote:
        reasons.append(f"improved at alpha={alpha:.3g} (attempt {attempt}): " + "; ".join(
            f"level {ch.level} {ch.wins} wins / {ch.losses} losses, p_holm={ch.p_holm:.3g}" for ch in gains)
            + f"; every level within {spec.margin} of the parent, mastered ones within it of the lineage's best")
    return GateDecision(promote=promote, p_value=min(adjusted.values(), default=1.0),
                        wins=sum(counts[lvl][0] for lvl in tested), losses=sum(counts[lvl][1] for lvl in tested),
                        reasons=tuple(reasons), alpha=alpha, attempt=attempt, levels=tuple(checks))


def _roles(level: int, targets: set[int], mastered: set[int]) -> tuple[Role, ...]:
    roles: tuple[Role, ...] = (("target",) if level in targets else ()) + (("mastered",) if level in mastered else ())
    return roles or ("other",)


def _check(level: int, roles: tuple[Role, ...], counts: tuple[int, int], p: float | None, p_holm: float | None,
           vs_best: tuple[int, int] | None, n: int, alpha: float, margin: float, exact: bool) -> LevelCheck:
    wins, losses = counts
    improved = p_holm is not None and p_holm <= alpha
    bound = (lambda lost, won: (lost - won) / n) if exact else (lambda lost, won: regression_bound(lost, won, n, alpha))
    bound_parent = bound(losses, wins)
    bound_best = None if vs_best is None else bound(vs_best[1], vs_best[0])
    # a significant gain vs the parent needs no non-inferiority check against it; the lineage check stays
    passed = (improved or bound_parent < margin) and (bound_best is None or bound_best < margin)
    return LevelCheck(level=level, roles=roles, wins=wins, losses=losses, p=p, p_holm=p_holm, improved=improved,
                      bound_parent=bound_parent, bound_best=bound_best, passed=passed)


def _failures(check: LevelCheck, best: dict[int, LevelScore], spec: GateSpec) -> list[str]:
    out = []
    where = f"level {check.level} ({', '.join(check.roles)})"
    if not check.improved and check.bound_parent >= spec.margin:
        out.append(f"{where} may have regressed vs the parent: {check.wins} wins / {check.losses} losses, "
                   f"drop bound {check.bound_parent:.3f} >= margin {spec.margin}")
    if check.bound_best is not None and check.bound_best >= spec.margin:
        out.append(f"{where} may have drifted below the lineage's best record (accuracy "
                   f"{best[check.level].accuracy:.3f}): drop bound {check.bound_best:.3f} >= margin {spec.margin}")
    return out
