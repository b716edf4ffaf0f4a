"""The candidate-harness stage on the tiny profile, with real Prefect, MLflow, PEFT and SQLite: the mechanics
(propose, store, migrate, judge, register), not improvement, which the tiny profile cannot show."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from rsi.run import Discovered
from rsi.curriculum import LevelPlan
from rsi.hcp import load_harness
from rsi.proposers import propose



def found(plan: list[int], unposable: dict[int, int]) -> Discovered:
    return Discovered(accuracy={1: 1.0}, frontier=1, plan=[LevelPlan(level=lvl, n_tasks=8) for lvl in plan],
                      task_ids=[], frontier_levels=plan, replay_levels=[], unposable=unposable)


@pytest.mark.parametrize(("plan", "unposable", "stalled", "every", "number", "wanted"), [
    ([], {11: 512}, False, 0, 7, True),  # the target level is beyond the harness: search
    ([10], {11: 128}, False, 0, 7, False),  # only the look-ahead is beyond it, and progress goes on: train
    ([10], {11: 128}, True, 0, 7, True),  # ... but the last candidate was rejected: the harness holds it back
    ([], {}, True, 0, 7, False),  # the curriculum's own top: nothing a harness could change
    ([5], {}, False, 3, 6, True), ([5], {}, False, 3, 7, False),  # every K generations
])
def test_the_search_runs_when_the_harness_holds_progress_back_or_every_k(plan, unposable, stalled, every, number,
                                                                          wanted):
    from rsi.flows.cycle import wants_search
    from rsi.run import HarnessSearchSpec

    spec = HarnessSearchSpec(every=every)
    assert wants_search(spec, found(plan, unposable), number, stalled) is wanted
    assert not wants_search(spec.model_copy(update={"enabled": False}), found(plan, unposable), number, stalled)


@pytest.mark.parametrize(("failed", "wanted"), [
    ({"limit_hit": 6, "wrong_answer": 4}, True),  # most failures are cut replies: an operator answers them
    ({"format_violation": 5, "wrong_answer": 5}, True),
    ({"format_violation": 2, "wrong_answer": 8}, False),  # mostly wrong answers: the weights' to mend
    ({"wrong_answer": 10}, False), ({}, False), (None, False),
])
def test_the_search_also_runs_when_the_last_audit_failed_mostly_for_causes_an_operator_answers(failed, wanted):
    from rsi.flows.cycle import wants_search
    from rsi.run import HarnessSearchSpec

    assert wants_search(HarnessSearchSpec(), found([5], {}), 7, False, failed) is wanted


def test_proposals_are_valid_distinct_and_never_the_harness_itself(tmp_path) -> None:
    from rsi.store import open_store
    from rsi.store.harnesses import store_new

    v2 = load_harness("addition/v2")
    proposals = propose(v2, ["addition"], {"width": [10, 12, 16, 12]})
    assert [p.document["prompt"]["vars"]["width"] for p in proposals] == [10, 12, 16]  # v2 + an answer template
    with open_store(f"sqlite:///{tmp_path}/rsi.db").session() as s:
        stored = [store_new(s, p.document, p.sources, tmp_path) for p in proposals]
    assert stored[2].prompt({"a": 5, "b": 7}) == "5" + "0" * 15 + "+7" + "0" * 15 + "="
    assert stored[2].render_answer({"a": 5, "b": 7}, 12) == "21" + "0" * 15
    assert len({h.id for h in stored}) == 3 and all(h.id.startswith("addition/v2.pad") for h in stored)


@pytest.mark.slow
def test_a_search_generation_migrates_judges_and_registers_every_candidate(prefect_api, tiny_base, rsi_home):
    """Generation 1 searches (every=1: the plan paired with the untrained base) and trains (promoted); generation 2
    searches two candidate widths and a plan: each is stored; a width is migrated from the champion on the
    lineage's verified answers, the plan (same format) keeps the champion's adapter as it is; each is judged and
    registered with its harness tags. The stored decisions of all candidates gated against one parent, search
    and ordinary ones alike, spend at most the gate's alpha."""
    from mlflow import MlflowClient
    from sqlalchemy import select

    from rsi.config import get_settings
    from rsi.store import open_store
    from rsi.store.schema import HarnessRow, PairRow

    from .test_cycle import run_tiny, seed_home

    from .test_cycle import PROMOTING

    seed_home(rsi_home, tiny_base)
    # (the family's own proposer only: which failures the tiny model shows, and so what the generic operators
    # propose, differs by machine; tests/test_mutations.py and bench/harness_repair.py cover those)
    search = {"every": 1, "space": {"width": [11, 12], "chunk": [1]}, "proposers": ["addition"],
              "gates": 3, "screen_margin": -1.0, "migration": {"steps": 4, "batch_size": 8, "warmup": 1}}
    summaries, _ = run_tiny(2, harness_search=search, **PROMOTING)
    assert summaries[0].gate == "promoted"
    searched = summaries[1]
    assert [c.harness.split(".")[1].split("-")[0] for c in searched.harness_candidates] == ["chunks1", "pad11", "pad12"]
    with open_store().session() as s:
        stored = set(s.scalars(select(HarnessRow.id)))
        pairs = {r.harness_id for r in s.scalars(select(PairRow))}
    assert {c.harness for c in searched.harness_candidates} <= stored & pairs
    spent = alpha_spent_per_parent()
    # generation 1 searches too (a plan paired with the untrained base) before its ordinary candidate, so the base
    # has 2 candidates, and a search of 3 follows: numbered apart (search 1, 2, 3 and ordinary 1), they would spend
    # more than alpha
    assert max(len(c) for c in spent.values()) >= 2 and sum(len(c) for c in spent.values()) >= 5, spent
    assert all(sum(c.values()) <= 0.05 for c in spent.values()), spent
    client = MlflowClient(get_settings().mlflow_uri)
    versions = [v for v in client.search_model_versions("name = 'rsi-addition'") if v.tags["generation"] == "2"]
    candidates = [v for v in versions if "harness_candidate" in v.tags]
    tried = sorted(c.harness for c in searched.harness_candidates)  # the screen only ranks: all three gated
    assert sorted(v.tags["harness_id"] for v in candidates) == tried
    champion = client.get_model_version("rsi-addition", summaries[0].version)
    for v in candidates:
        assert v.tags["harness_hash"] != v.tags["parent_harness_hash"] and v.tags["gate_reasons"]
        run = client.get_run(v.run_id)
        planned = ".chunks1-" in v.tags["harness_id"]  # the plan keeps the champion's adapter: nothing trained
        assert run.data.tags["candidate_harness"] == v.tags["harness_id"]
        assert ("train_loss" in run.data.metrics) is not planned
        assert (v.tags["adapter_hash"] == champion.tags["adapter_hash"]) is planned
    shown = subprocess.run([sys.executable, "-m", "rsi", "lineage", "show", "addition"], capture_output=True,
                           text=True, timeout=300)
    assert shown.returncode == 0 and len(re.findall(r"\(new\) *│", shown.stdout)) >= len(candidates), shown.stdout
    attributed = subprocess.run([sys.executable, "-m", "rsi", "harness", "attribute", "addition", "--generation", "1"],
                                capture_output=True, text=True, timeout=300)
    assert attributed.returncode == 0 and "generation 1" in attributed.stdout, attributed.stderr


def alpha_spent_per_parent() -> dict[str, dict[str, float]]:
    """From the stored decisions (every evaluate and search result of the lineage): per parent pair, the alpha
    each distinct candidate judged against it was given; and each candidate's number as the counter holds it."""
    from sqlalchemy import select

    from rsi.store import open_store
    from rsi.store.schema import GateAttempt, Generation, StageRun

    spent: dict[str, dict[str, float]] = {}
    with open_store().session() as s:
        numbers = {(a.parent_pair_id, a.candidate_pair_id): a.attempt for a in s.scalars(select(GateAttempt))}
        for gen in s.scalars(select(Generation).where(Generation.lineage == "addition")):
            for row in s.scalars(select(StageRun).where(StageRun.generation_id == gen.id, StageRun.status == "done")):
                judged = [row.result] if row.stage == "evaluate" else \
                    [c["judged"] for c in row.result["candidates"]] if row.stage == "search" else []
                for j in judged:
                    attempt = numbers[gen.parent_pair_id, j["candidate_pair_id"]]
                    assert j["decision"]["attempt"] == attempt
                    spent.setdefault(gen.parent_pair_id, {})[j["candidate_pair_id"]] = j["decision"]["alpha"]
    return spent
