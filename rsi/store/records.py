"""Reading and writing domain objects in the state DB. Writes are idempotent: a row already there is kept."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from rsi.models import Task, Trajectory, Verdict
from rsi.store.schema import (
    AttributionRow, Base, DatasetItem, DatasetRow, EvaluationRow, Generation, Lineage, TaskRow, TrajectoryRow,
    VerdictRow,
)

CHUNK = 500


def _missing(session: Session, column: Any, keys: Sequence[Any]) -> set[Any]:
    """The keys not yet stored in ``column``, looked up in chunks."""
    present: set[Any] = set()
    for i in range(0, len(keys), CHUNK):
        present.update(session.scalars(select(column).where(column.in_(keys[i : i + CHUNK]))))
    return set(keys) - present


def _add_new(session: Session, rows: list[Base], key: Any, column: Any) -> int:
    new = _missing(session, column, [key(r) for r in rows])
    fresh = [r for r in rows if key(r) in new]
    seen: set[Any] = set()
    fresh = [r for r in fresh if not (key(r) in seen or seen.add(key(r)))]
    session.add_all(fresh)
    session.flush()
    return len(fresh)


def put_tasks(session: Session, tasks: Iterable[Task]) -> int:
    rows = [
        TaskRow(id=t.id, family=t.family, family_version=t.family_version, level=t.level, seed=t.seed,
                index=t.index, split=t.split, payload=t.payload, answer=t.answer)
        for t in tasks
    ]
    return _add_new(session, rows, lambda r: r.id, TaskRow.id)


def put_trajectories(session: Session, trajectories: Iterable[Trajectory], generation_id: int | None = None,
                     conversations: Mapping[str, str] | None = None) -> int:
    """Store trajectories new by id; ``conversations``: trajectory id -> the served conversation it was harvested
    from."""
    conversations = conversations or {}
    rows = [
        TrajectoryRow(id=t.id, task_id=t.task_id, pair_id=t.pair_id, generation_id=generation_id,
                      harness_id=t.harness_id, sample_index=t.sample_index, seed=t.seed,
                      messages=[m.model_dump(mode="json") for m in t.messages], finish_reason=t.finish_reason,
                      prompt_tokens=t.tokens.prompt, completion_tokens=t.tokens.completion,
                      timings=t.timings.model_dump(mode="json"),
                      tool_log=[r.model_dump(mode="json") for r in t.tool_log] or None,
                      conversation_id=conversations.get(t.id))
        for t in trajectories
    ]
    return _add_new(session, rows, lambda r: r.id, TrajectoryRow.id)


def put_verdicts(session: Session, verdicts: Iterable[Verdict]) -> int:
    """Store verdicts; one per (trajectory, contract version, harness hash), the first one kept."""
    verdicts = list(verdicts)
    if not verdicts:
        return 0
    existing = set()
    ids = [v.trajectory_id for v in verdicts]
    for i in range(0, len(ids), CHUNK):
        rows = session.execute(
            select(VerdictRow.trajectory_id, VerdictRow.contract_version, VerdictRow.harness_hash).where(
                VerdictRow.trajectory_id.in_(ids[i : i + CHUNK])
            )
        )
        existing.update(tuple(r) for r in rows)
    new = []
    for v in verdicts:
        key = (v.trajectory_id, v.contract_version, v.harness_hash)
        if key not in existing:
            existing.add(key)
            new.append(VerdictRow(trajectory_id=v.trajectory_id, contract_version=v.contract_version,
                                  harness_hash=v.harness_hash, passed=v.passed,
                                  rules=[r.model_dump(mode="json") for r in v.rules]))
    session.add_all(new)
    session.flush()
    return len(new)


def store_attribution(session: Session, generation_id: int, rows: Iterable[Any]) -> None:
    """A generation's failure attribution (``rsi.attribution.Attribution`` rows), replacing any earlier one."""
    session.execute(delete(AttributionRow).where(AttributionRow.generation_id == generation_id))
    session.add_all(AttributionRow(generation_id=generation_id, level=r.level, task_id=r.task_id, cause=r.cause,
                                   owner=r.owner, tasks=r.tasks, samples=dict(r.samples)) for r in rows)
    session.flush()


def load_attribution(session: Session, generation_id: int) -> list[Any]:
    """A generation's stored failure attribution, as ``rsi.attribution.Attribution`` rows."""
    from rsi.attribution import Attribution

    rows = session.scalars(select(AttributionRow).where(AttributionRow.generation_id == generation_id)
                           .order_by(AttributionRow.id))
    return [Attribution(level=r.level, task_id=r.task_id, cause=r.cause, owner=r.owner, tasks=r.tasks,
                        samples=r.samples) for r in rows]


def task_from_row(row: TaskRow) -> Task:
    return Task(family=row.family, family_version=row.family_version, split=row.split, level=row.level, seed=row.seed,
                index=row.index, payload=row.payload, answer=row.answer)


def trajectory_from_row(row: TrajectoryRow) -> Trajectory:
    return Trajectory(id=row.id, task_id=row.task_id, pair_id=row.pair_id, harness_id=row.harness_id,
                      sample_index=row.sample_index, seed=row.seed, messages=row.messages,
                      finish_reason=row.finish_reason,
                      tokens={"prompt": row.prompt_tokens, "completion": row.completion_tokens},
                      timings=row.timings, tool_log=row.tool_log or (), created_at=row.created_at)


def load_tasks(session: Session, ids: Sequence[str]) -> list[Task]:
    """Stored tasks in the order of ``ids``."""
    rows = {r.id: r for r in session.scalars(select(TaskRow).where(TaskRow.id.in_(ids)))}
    return [task_from_row(rows[i]) for i in ids]


def load_trajectories(session: Session, ids: Sequence[str]) -> tuple[list[Trajectory], dict[str, Task]]:
    """Stored trajectories in the order of ``ids``, and their tasks by id."""
    rows = list(session.scalars(select(TrajectoryRow).where(TrajectoryRow.id.in_(ids))))
    task_ids = {r.task_id for r in rows}
    tasks = {r.id: task_from_row(r) for r in session.scalars(select(TaskRow).where(TaskRow.id.in_(task_ids)))}
    order = {tid: i for i, tid in enumerate(ids)}
    return sorted((trajectory_from_row(r) for r in rows), key=lambda t: order[t.id]), tasks


def passed_under(session: Session, trajectory_ids: Sequence[str], harness_hash: str) -> set[str]:
    """The trajectories among ``trajectory_ids`` the auditor passed under the contract of ``harness_hash``."""
    return set(session.scalars(select(VerdictRow.trajectory_id).where(
        VerdictRow.trajectory_id.in_(trajectory_ids), VerdictRow.passed, VerdictRow.harness_hash == harness_hash)))


def put_dataset(session: Session, key: str, lineage: str, generation_id: int, filters: dict[str, Any],
                trajectory_ids: Sequence[str]) -> None:
    """A selection (or migration set) by its digest, its items in order; kept as is when stored before."""
    if session.get(DatasetRow, key) is None:
        session.add(DatasetRow(digest=key, lineage=lineage, generation_id=generation_id, size=len(trajectory_ids),
                               filters=filters))
        session.flush()
        session.add_all(DatasetItem(dataset_digest=key, position=i, trajectory_id=t)
                        for i, t in enumerate(trajectory_ids))


def load_dataset_rows(session: Session, key: str) -> tuple[dict[str, Any], list[str]]:
    """A stored selection's filters and its trajectory ids in order."""
    row = session.get(DatasetRow, key)
    items = session.scalars(select(DatasetItem.trajectory_id).where(DatasetItem.dataset_digest == key)
                            .order_by(DatasetItem.position))
    return dict(row.filters), list(items)


def verified_answers(session: Session, lineage: str) -> list[Any]:
    """Every passed trajectory of the lineage as (id, task id, harness id, level, verdict's harness hash), by
    level, task and id."""
    gen_ids = list(session.scalars(select(Generation.id).where(Generation.lineage == lineage)))
    return list(session.execute(
        select(TrajectoryRow.id, TrajectoryRow.task_id, TrajectoryRow.harness_id, TaskRow.level, VerdictRow.harness_hash)
        .join(VerdictRow, VerdictRow.trajectory_id == TrajectoryRow.id).join(TaskRow, TaskRow.id == TrajectoryRow.task_id)
        .where(TrajectoryRow.generation_id.in_(gen_ids), VerdictRow.passed)
        .order_by(TaskRow.level, TrajectoryRow.task_id, TrajectoryRow.id)).all())


def longest_passed(session: Session, generation_id: int) -> Trajectory | None:
    """The generation's passed trajectory of its lineage's family (not a proposer's) with the most completion
    tokens (None when nothing passed)."""
    family = select(Lineage.family).join(Generation, Generation.lineage == Lineage.name).where(
        Generation.id == generation_id).scalar_subquery()
    row = session.scalars(select(TrajectoryRow).join(VerdictRow, VerdictRow.trajectory_id == TrajectoryRow.id)
                          .join(TaskRow, TaskRow.id == TrajectoryRow.task_id)
                          .where(TrajectoryRow.generation_id == generation_id, VerdictRow.passed,
                                 TaskRow.family == family)
                          .order_by(TrajectoryRow.completion_tokens.desc(), TrajectoryRow.id).limit(1)).first()
    return trajectory_from_row(row) if row is not None else None


def put_scores(session: Session, pair_id: str, generation_id: int | None, split: str, seed: int, n: int,
               decoding: str, scores: Iterable[Any]) -> None:
    """Evaluations of a pair (``rsi.evaluate.LevelScore`` each) as requested: ``n`` tasks a level, ``seed``."""
    for sc in scores:
        session.add(EvaluationRow(pair_id=pair_id, generation_id=generation_id, level=sc.level, split=split, seed=seed,
                                  n=n, correct=sc.correct, accuracy=sc.accuracy, ci_low=sc.ci_low,
                                  ci_high=sc.ci_high, decoding=decoding, outcomes=list(sc.outcomes)))


def stored_evaluations(session: Session, pair_ids: Sequence[str], levels: Sequence[int], split: str, seed: int,
                       n: int, decoding: str) -> list[EvaluationRow]:
    return list(session.scalars(select(EvaluationRow).where(
        EvaluationRow.pair_id.in_(pair_ids), EvaluationRow.level.in_(levels), EvaluationRow.split == split,
        EvaluationRow.seed == seed, EvaluationRow.n == n, EvaluationRow.decoding == decoding)))
