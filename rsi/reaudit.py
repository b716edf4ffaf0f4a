"""Re-audit: judge a lineage's stored trajectories under another contract and say what changed.

Every stored trajectory is audited again under the given harness (``rsi.audit.audit`` with ``recorded`` = the
harness it was produced under, so only the ids rule looks at where it came from). The new verdicts are stored
beside the old ones (a verdict is keyed by trajectory, contract version and harness hash) and compared with the
verdict each trajectory got under its own harness: how many passed before and fail now, and which rules of the
new contract reject them.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from pydantic import BaseModel, ConfigDict
from sqlalchemy import select

from rsi.audit import audit
from rsi.errors import UserError
from rsi.hcp import Harness
from rsi.models import Pair, Verdict
from rsi.store.db import Store
from rsi.store.harnesses import lock_harness, stored_harness
from rsi.store.records import CHUNK, put_verdicts, task_from_row, trajectory_from_row
from rsi.store.schema import Generation, Lineage, PairRow, TaskRow, TrajectoryRow, VerdictRow
from rsi.tasks import get_family


class RuleChange(BaseModel):
    model_config = ConfigDict(frozen=True)

    rule: str
    newly_failing: int  # trajectories that passed under their own harness and fail this rule now
    failing: int  # trajectories that fail this rule now, in all
    example: str = ""  # one newly failing trajectory id and the rule's detail


class Reaudit(BaseModel):
    """What a re-audit found: counts before and after, and the rules that changed verdicts."""

    model_config = ConfigDict(frozen=True)

    lineage: str
    harness_id: str
    harness_hash: str
    contract_version: str
    audited: int
    passed_before: int
    passed_now: int
    newly_failed: int
    newly_passed: int
    not_audited_before: int  # trajectories with no stored verdict under their own harness
    rules: tuple[RuleChange, ...]
    stored: int


def reaudit_lineage(store: Store, lineage: str, harness: Harness, home: Path) -> Reaudit:
    """Audit every trajectory of ``lineage`` under ``harness``, store the verdicts, and compare."""
    with store.session() as s:
        row = s.get(Lineage, lineage)
        if row is None:
            known = sorted(s.scalars(select(Lineage.name)))
            raise UserError(f"no lineage {lineage!r} in the state DB (known: {', '.join(known) or 'none'}); "
                            "pass one `rsi lineage show` knows")
        if row.family != harness.document.family:
            raise UserError(f"harness {harness.id} is for family {harness.document.family!r}, lineage {lineage!r} "
                            f"climbs {row.family!r}; pass a harness of that family")
        gen_ids = list(s.scalars(select(Generation.id).where(Generation.lineage == lineage)))
        trajectories = [trajectory_from_row(r) for r in s.scalars(
            select(TrajectoryRow).where(TrajectoryRow.generation_id.in_(gen_ids)).order_by(TrajectoryRow.id))]
        task_ids = sorted({t.task_id for t in trajectories})
        tasks = {}
        for i in range(0, len(task_ids), CHUNK):
            rows = s.scalars(select(TaskRow).where(TaskRow.id.in_(task_ids[i:i + CHUNK])))
            tasks |= {r.id: task_from_row(r) for r in rows}
        pairs = {r.id: Pair(base_model_hash=r.base_model_hash, adapter_hash=r.adapter_hash, harness_id=r.harness_id,
                            harness_hash=r.harness_hash)
                 for r in s.scalars(select(PairRow).where(PairRow.id.in_({t.pair_id for t in trajectories})))}
        recorded = {hid: stored_harness(s, hid, home) for hid in {t.harness_id for t in trajectories}}
        # another role's trajectories (a proposer's, under its own family's harness) keep their own verdicts
        trajectories = [t for t in trajectories if recorded[t.harness_id].document.family == row.family]
        before = _verdicts(s, trajectories, recorded)
    family = get_family(harness.document.family)
    verdicts = [audit(t, tasks[t.task_id], harness, family, pairs.get(t.pair_id), recorded[t.harness_id])
                for t in trajectories]
    with store.session() as s:
        lock_harness(s, harness)  # the new verdicts name this hash: an edited used version is refused
        stored = put_verdicts(s, verdicts)
    return _compare(lineage, harness, verdicts, before, stored)


def _verdicts(s, trajectories, recorded: dict[str, Harness]) -> dict[str, VerdictRow]:
    """Each trajectory's stored verdict under the harness it was produced under."""
    ids, found = [t.id for t in trajectories], {}
    own = {t.id: recorded[t.harness_id].hash for t in trajectories}
    for i in range(0, len(ids), CHUNK):
        for row in s.scalars(select(VerdictRow).where(VerdictRow.trajectory_id.in_(ids[i:i + CHUNK]))):
            if row.harness_hash == own[row.trajectory_id]:
                found[row.trajectory_id] = row
    return found


def _compare(lineage: str, harness: Harness, verdicts: list[Verdict], before: dict[str, VerdictRow],
             stored: int) -> Reaudit:
    newly_failing, failing, examples = Counter(), Counter(), {}
    newly_failed = newly_passed = 0
    for v in verdicts:
        old = before.get(v.trajectory_id)
        for r in v.rules:
            if not r.passed:
                failing[r.rule] += 1
                if old is not None and old.passed:
                    newly_failing[r.rule] += 1
                    examples.setdefault(r.rule, f"{v.trajectory_id}: {r.detail}")
        if old is not None and old.passed and not v.passed:
            newly_failed += 1
        if old is not None and not old.passed and v.passed:
            newly_passed += 1
    rules = tuple(RuleChange(rule=rule, newly_failing=newly_failing[rule], failing=failing[rule],
                             example=examples.get(rule, "")) for rule in harness.document.contract.rules)
    return Reaudit(lineage=lineage, harness_id=harness.id, harness_hash=harness.hash,
                   contract_version=harness.contract_version, audited=len(verdicts),
                   passed_before=sum(1 for v in verdicts if (o := before.get(v.trajectory_id)) and o.passed),
                   passed_now=sum(v.passed for v in verdicts), newly_failed=newly_failed, newly_passed=newly_passed,
                   not_audited_before=sum(1 for v in verdicts if v.trajectory_id not in before),
                   rules=rules, stored=stored)
