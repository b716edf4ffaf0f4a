"""The promotion gate on plain data: gains per level with Holm, alpha spent over retries, no regression."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from rsi.evaluate import LevelScore, score
from rsi.gate import GateSpec, attempt_alpha, decide, holm, regression_bound, sign_test_p

N = 256


def paired(level: int, both: int, ref_only: int, cand_only: int, n: int = N) -> tuple[LevelScore, LevelScore]:
    """Reference and candidate scores on the same n tasks with the given agreement counts."""
    ref = [True] * both + [True] * ref_only + [False] * cand_only
    cand = [True] * both + [False] * ref_only + [True] * cand_only
    rest = [False] * (n - len(ref))
    return score(level, ref + rest), score(level, cand + rest)


def gate(parent: dict[int, LevelScore], candidate: dict[int, LevelScore], targets: set[int],
         mastered: frozenset[int] = frozenset(), best: dict[int, LevelScore] | None = None, attempt: int = 1):
    return decide(parent, candidate, targets=targets, best=best if best is not None else dict(parent),
                  mastered=set(mastered), spec=GateSpec(), attempt=attempt)


def test_pooled_gain_cannot_hide_a_regression() -> None:
    """Issue 8: level 4 falls 0.85 -> 0.60 while level 5 rises 0.30 -> 0.70; pooled, that passed (p=2e-3)."""
    p4, c4 = paired(4, both=154, ref_only=64, cand_only=0)
    p5, c5 = paired(5, both=77, ref_only=0, cand_only=102)
    assert sign_test_p(102, 64) < 0.01  # the old pooled test
    decision = gate({4: p4, 5: p5}, {4: c4, 5: c5}, targets={4, 5})
    assert not decision.promote
    assert any(r.startswith("level 4 (target) may have regressed") for r in decision.reasons), decision.reasons
    by_level = {ch.level: ch for ch in decision.levels}
    assert by_level[5].improved and by_level[5].passed
    assert not by_level[4].improved and not by_level[4].passed and by_level[4].bound_parent > 0.2


def test_genuine_improvement_is_promoted() -> None:
    levels = [paired(lvl, both=N - lvl, ref_only=0, cand_only=0) for lvl in (1, 2, 3)]
    parent = {lvl: p for lvl, (p, _) in zip((1, 2, 3), levels)} | {4: score(4, [i < 40 for i in range(N)])}
    candidate = {lvl: c for lvl, (_, c) in zip((1, 2, 3), levels)} | {4: parent[4]}
    parent[5], candidate[5] = paired(5, both=77, ref_only=0, cand_only=102)
    decision = gate(parent, candidate, targets={5}, mastered=frozenset({1, 2, 3}))
    assert decision.promote, decision.reasons
    assert (decision.wins, decision.losses, decision.attempt) == (102, 0, 1)
    assert decision.p_value == pytest.approx(sign_test_p(102, 0)) and decision.alpha == attempt_alpha(0.05, 1)
    assert len(decision.reasons) == 1 and decision.reasons[0].startswith("improved")
    roles = {ch.level: ch.roles for ch in decision.levels}
    assert roles == {1: ("mastered",), 2: ("mastered",), 3: ("mastered",), 4: ("other",), 5: ("target",)}
    stored = json.loads(json.dumps(decision.model_dump()))
    assert {"promote", "p_value", "reasons", "wins", "losses", "alpha", "attempt", "levels"} <= stored.keys()
    # levels 1-3 are answered exactly as the parent answers them: nothing changed there, no drift check
    assert [lv["bound_best"] for lv in stored["levels"]] == [None] * 5


def test_drift_is_checked_where_the_candidate_changes_something_only() -> None:
    """The parent sits below the lineage's best at mastered level 3 (a drift it was promoted with). A candidate
    that answers level 3 exactly as the parent (a harness candidate keeping the parent's adapter) adds no
    drift and passes; one that changes a single answer there is checked against the best again."""
    best3, parent3 = paired(3, both=244, ref_only=12, cand_only=0)  # best 1.00, parent .953
    gain = paired(5, both=77, ref_only=0, cand_only=102)
    parent = {3: parent3, 5: gain[0]}
    same = gate(parent, {3: parent3, 5: gain[1]}, targets={5}, mastered=frozenset({3}), best={3: best3})
    assert same.promote, same.reasons
    changed3 = score(3, [i < 244 or i == 255 for i in range(N)])  # one task differs: one more right answer
    changed = gate(parent, {3: changed3, 5: gain[1]}, targets={5}, mastered=frozenset({3}), best={3: best3})
    assert not changed.promote and "drifted below the lineage's best" in " ".join(changed.reasons)


def drift_lineage(lost_per_step: int, steps: int = 7) -> tuple[list, list[float], list[float]]:
    """Candidates that each lose ``lost_per_step`` tasks at mastered level 3 and gain 30 at targeted level 5.

    ``best`` is kept as the flow keeps it: per level, the promoted pair (base included) with the highest
    accuracy. Returns the decisions and, after each step, the champion's and the best level-3 accuracy.
    """
    champion = {3: score(3, [i != 0 for i in range(N)]), 5: score(5, [i < 26 for i in range(N)])}
    best, attempt, decisions, champ_acc, best_acc = dict(champion), 1, [], [], []
    for _ in range(steps):
        kept = [i for i, ok in enumerate(champion[3].outcomes) if ok][lost_per_step:]
        right5 = champion[5].correct + 30
        candidate = {3: score(3, [i in kept for i in range(N)]), 5: score(5, [i < right5 for i in range(N)])}
        decision = decide(champion, candidate, targets={5}, best=best, mastered={3}, spec=GateSpec(), attempt=attempt)
        decisions.append(decision)
        if decision.promote:
            champion, attempt = candidate, 1
            best = {lvl: max(best[lvl], candidate[lvl], key=lambda s: s.accuracy) for lvl in best}
        else:
            attempt += 1
        champ_acc.append(champion[3].accuracy)
        best_acc.append(best[3].accuracy)
    return decisions, champ_acc, best_acc


@pytest.mark.parametrize("lost", [7, 3])
def test_drift_at_a_mastered_level_cannot_compound(lost: int) -> None:
    decisions, champ_acc, best_acc = drift_lineage(lost)
    first_rejection = next(i for i, d in enumerate(decisions) if not d.promote)
    assert first_rejection <= 2
    assert all(c >= b - GateSpec().margin for c, b in zip(champ_acc, best_acc, strict=True))
    assert not any(d.promote for d in decisions[first_rejection:])
    assert any("level 3 (mastered)" in r for r in decisions[first_rejection].reasons)
    if lost == 3:
        # each step alone is within the margin of its parent: only the lineage's best record stops the drift
        assert decisions[0].promote and first_rejection == 1
        check = decisions[1].levels[0]
        assert check.bound_parent < GateSpec().margin <= check.bound_best
        assert any("lineage's best" in r for r in decisions[1].reasons)


def test_holm_adjusts_across_targeted_levels() -> None:
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([]) == [] and holm([0.7]) == [0.7]
    alpha = attempt_alpha(0.05, 1)
    pairs = [paired(lvl, both=100, ref_only=3, cand_only=12) for lvl in (4, 5)]
    parent, candidate = {4: pairs[0][0], 5: pairs[1][0]}, {4: pairs[0][1], 5: pairs[1][1]}
    decision = gate(parent, candidate, targets={4, 5})
    assert all(ch.p < alpha < ch.p_holm for ch in decision.levels)  # each passes alone, not as a family
    assert not decision.promote and decision.reasons[0].startswith("no targeted level improved")
    parent[5], candidate[5] = paired(5, both=100, ref_only=2, cand_only=30)
    decision = gate(parent, candidate, targets={4, 5})
    assert decision.promote, decision.reasons
    assert decision.p_value == pytest.approx(2 * sign_test_p(30, 2))


def test_alpha_is_spent_across_retries_of_one_parent() -> None:
    spec = GateSpec()
    assert sum(attempt_alpha(spec.alpha, r) for r in range(1, 1001)) <= spec.alpha
    assert attempt_alpha(spec.alpha, 1) > spec.alpha / 2 > attempt_alpha(spec.alpha, 2)
    with pytest.raises(ValueError, match="attempt"):
        attempt_alpha(spec.alpha, 0)
    parent, candidate = paired(5, both=50, ref_only=0, cand_only=6)  # p = 1/64
    first = gate({5: parent}, {5: candidate}, targets={5}, attempt=1)
    later = gate({5: parent}, {5: candidate}, targets={5}, attempt=2)
    assert first.promote and (first.attempt, first.alpha) == (1, attempt_alpha(spec.alpha, 1))
    assert not later.promote and later.alpha == attempt_alpha(spec.alpha, 2) and later.attempt == 2


def binomial_cdf(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def clopper_pearson_upper(k: int, n: int, alpha: float) -> float:
    low, high = k / n, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if binomial_cdf(k, n, mid) > alpha else (low, mid)
    return high


def test_bound_on_known_values() -> None:
    alpha, z = 0.05, 1.6448536269514722
    # identical outcomes: positive (n agreeing tasks do not prove agreement everywhere), in closed form
    # (with no wins the restricted MLE is 0, so the bound solves (n d - 1)^2 = z^2 n d (1 - d))
    a, b = N * N + z * z * N, 2 * N + z * z * N
    assert regression_bound(0, 0, N, alpha) == pytest.approx((b + math.sqrt(b * b - 4 * a)) / (2 * a), abs=1e-9)
    assert 1 - alpha ** (1 / N) <= regression_bound(0, 0, N, alpha) < 0.02
    # only losses: any sound bound is at least the exact binomial (Clopper-Pearson) bound, since with no
    # wins possible the drop is P(loss) itself; the conditional plug-in bound (k/n) is far below it
    for k in (1, 3, 7, 20):
        exact = clopper_pearson_upper(k, N, alpha)
        assert exact <= regression_bound(k, 0, N, alpha) < exact + 0.015
    # estimate inside, order in losses and wins, candidate clearly better
    assert (7 - 2) / N < regression_bound(7, 2, N, alpha) < regression_bound(8, 2, N, alpha)
    assert regression_bound(7, 3, N, alpha) < regression_bound(7, 2, N, alpha)
    assert regression_bound(0, 102, N, alpha) < -0.3
    assert regression_bound(N, 0, N, alpha) == 1.0 and regression_bound(0, 0, 0, alpha) == 1.0


@pytest.mark.parametrize("alpha", [0.05, 0.0076])
def test_bound_has_exact_size_at_most_alpha(alpha: float) -> None:
    """Brute force: at a true drop equal to the margin, P(bound < margin) <= alpha for every nuisance value.

    Enumerates every (losses, wins) for n = 64 under p_ref - p_cand = margin, with q = P(win) on a grid.
    """
    n, margin = 64, 0.04
    passing = [(b, c) for b in range(n + 1) for c in range(n + 1 - b) if regression_bound(b, c, n, alpha) < margin]
    worst = 0.0
    for q in [(1 - margin) / 2 * (k / 30) ** 2 for k in range(30)]:
        log_p = (math.log(q + margin), math.log(q) if q else -math.inf, math.log(1 - 2 * q - margin))
        size = sum(math.exp(math.lgamma(n + 1) - math.lgamma(b + 1) - math.lgamma(c + 1) - math.lgamma(n - b - c + 1)
                            + b * log_p[0] + (c * log_p[1] if c else 0.0) + (n - b - c) * log_p[2])
                   for b, c in passing)
        worst = max(worst, size)
    assert 0.3 * alpha < worst <= alpha


def test_unevaluated_or_unpaired_levels_block_promotion() -> None:
    parent, candidate = paired(5, both=77, ref_only=0, cand_only=102)
    missing = gate({5: parent}, {5: candidate}, targets={5}, mastered=frozenset({3}))
    assert not missing.promote and "level 3 (mastered) was not evaluated" in missing.reasons[0]
    nothing = gate({5: parent}, {5: candidate}, targets=set())
    assert not nothing.promote and "no targeted level evaluated" in nothing.reasons[0] and nothing.p_value == 1.0
    with pytest.raises(ValueError, match="same held-out tasks"):
        gate({5: parent}, {5: score(5, [True] * 10)}, targets={5})


def test_spec_has_no_tolerance() -> None:
    assert GateSpec().margin == 0.04 and GateSpec().alpha == 0.05
    with pytest.raises(ValidationError):
        GateSpec(tolerance=0.03)


def test_a_level_evaluated_on_its_whole_split_is_judged_exactly() -> None:
    """Level 1 of addition has 9 held-out tasks: all of them are scored, so there is no sampling error to
    bound. The same 9 outcomes as a sample would need a huge bound and could never pass the margin."""
    same = [True] * 9
    exact = {1: score(1, same, exhaustive=True), 4: score(4, [False] * 128 + [True] * 128)}
    better = {1: score(1, same, exhaustive=True), 4: score(4, [True] * 256)}
    kw = dict(targets={4}, best=exact, mastered={1}, spec=GateSpec())
    assert decide(exact, better, **kw).promote
    sampled = {lvl: sc.model_copy(update={"exhaustive": False}) for lvl, sc in exact.items()}
    assert not decide(sampled, {1: sampled[1], 4: better[4]}, **{**kw, "best": sampled}).promote
    worse = {1: score(1, [False] + same[1:], exhaustive=True), 4: better[4]}
    rejected = decide(exact, worse, **kw)  # one task of nine lost: an exact drop of 0.111 > margin
    assert not rejected.promote and any("level 1" in r for r in rejected.reasons)
