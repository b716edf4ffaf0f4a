"""Curriculum, selection, gate, intervals and seed streams: the decisions of the cycle, on plain data."""

from __future__ import annotations

import pytest

from rsi.curriculum import CurriculumSpec, frontier, plan_levels
from rsi.evaluate import score, wilson
from rsi.gate import GateSpec, decide, sign_test_p
from rsi.select import Candidate, Example, SelectionSpec, select


def test_frontier_and_plus_one() -> None:
    acc = {1: 1.0, 2: 0.99, 3: 0.95, 4: 0.5, 5: 0.3, 6: 0.0}
    assert frontier(acc, 0.9) == 3
    plan = plan_levels(acc, CurriculumSpec(rule="plus_one", tasks_per_level=100, lookahead_tasks=10))
    assert [(p.level, p.n_tasks) for p in plan] == [(4, 100), (5, 10)]


def test_accelerated_admits_levels_above_threshold() -> None:
    acc = {1: 1.0, 2: 1.0, 3: 0.97, 4: 0.6, 5: 0.3, 6: 0.05}
    plan = plan_levels(acc, CurriculumSpec(rule="accelerated", admit=0.2, tasks_per_level=100, lookahead_tasks=10))
    assert [(p.level, p.n_tasks) for p in plan] == [(4, 100), (5, 100), (6, 10)]


def test_curriculum_stops_at_max_level() -> None:
    assert plan_levels({1: 1.0, 2: 1.0}, CurriculumSpec(max_level=2)) == []
    assert [p.level for p in plan_levels({1: 1.0}, CurriculumSpec(max_level=2))] == [2]


def cand(tid: str, task: str, level: int, completion: str, passed: bool) -> Candidate:
    return Candidate(trajectory_id=tid, task_id=task, level=level, prompt="p" + task, completion=completion, passed=passed)


def test_selection_keeps_passed_dedupes_caps_and_replays() -> None:
    cands = [
        cand("a1", "A", 4, "x", True), cand("a2", "A", 4, "x", True), cand("a3", "A", 4, "y", True),
        cand("b1", "B", 4, "z", False), cand("c1", "C", 2, "w", True),
    ]
    old = [Example(trajectory_id="o1", level=3, prompt="q", completion="r", source="frontier")]
    data = select(cands, old, SelectionSpec(cap_per_task=2), frontier_levels={4}, seed=0)
    assert [(e.trajectory_id, e.source) for e in data.examples] == [
        ("a1", "frontier"), ("a3", "frontier"), ("c1", "replay"), ("o1", "replay")]
    assert data.digest == select(list(reversed(cands)), old, SelectionSpec(cap_per_task=2),
                                 frontier_levels={4}, seed=0).digest
    capped = select(cands, old, SelectionSpec(cap_per_task=1), frontier_levels={4}, seed=0)
    assert [e.trajectory_id for e in capped.pool("frontier")] == ["a1"]
    banded = select(cands, [], SelectionSpec(band=(0.0, 0.9)), frontier_levels={4}, seed=0)
    assert [e.trajectory_id for e in banded.examples] == []  # A solved 3/3 and C 1/1 are outside the band


def test_wilson_interval() -> None:
    low, high = wilson(180, 200)
    assert 0.85 < low < 0.9 < high < 0.94
    assert wilson(0, 50)[0] == 0.0 and wilson(50, 50)[1] == 1.0


def test_sign_test() -> None:
    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(5, 0) == pytest.approx(1 / 32)
    assert sign_test_p(20, 5) < 0.01 < sign_test_p(8, 5)


def test_gate_promotes_significant_frontier_gain_without_regression() -> None:
    parent = {3: score(3, [True] * 250 + [False] * 6), 4: score(4, [False] * 156 + [True] * 100)}
    kw = dict(targets={4}, best=parent, mastered={3}, spec=GateSpec())
    decision = decide(parent, {3: parent[3], 4: score(4, [True] * 256)}, **kw)
    assert decision.promote and decision.wins == 156 and decision.losses == 0
    same = decide(parent, parent, **kw)
    assert not same.promote and "no targeted level improved" in same.reasons[0]
    forgot = {3: score(3, [True] * 230 + [False] * 26), 4: score(4, [True] * 256)}
    regress = decide(parent, forgot, **kw)
    assert not regress.promote and any("level 3 (mastered) may have regressed" in r for r in regress.reasons)
