"""A lineage's stage ledger in the state DB: its generations, each stage's finished result keyed by the inputs
it ran on, its pairs, and the gate's attempt counter. Every write goes through the run's lease ``Fence``."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel
from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from rsi.errors import UserError
from rsi.hashing import digest
from rsi.hcp import Harness
from rsi.models import Pair
from rsi.store.harnesses import lock_harness
from rsi.store.leases import Fence
from rsi.store.schema import GateAttempt, Generation, Lineage, PairRow, StageRun, utcnow

log = logging.getLogger("rsi.cycle")
Read = Callable[[str, int, dict[str, Any]], Any]


class Ledger:
    """One lineage's rows. ``read`` validates a stored stage result against this version's schema; ``kinds``
    names the result type each stage must return; ``config_digest`` is part of every stage's inputs key."""

    def __init__(self, fence: Fence, config_digest: str, read: Read, kinds: Mapping[str, type[BaseModel]]):
        self.fence, self.store, self.lineage = fence, fence.store, fence.lineage
        self.config_digest, self.read, self.kinds = config_digest, read, kinds

    def ensure_lineage(self, harness: Harness, family: str, spec: dict[str, Any]) -> None:
        """The lineage's row, made on its first run (a lineage name climbs one family only), and its starting
        harness locked: a used id@version never changes, so an edited one is refused here."""
        with self.store.session() as s:
            lock_harness(s, harness)
            row = s.get(Lineage, self.lineage)
            if row is None:
                s.add(Lineage(name=self.lineage, family=family, spec=spec))
            elif row.family != family:
                raise UserError(f"lineage {self.lineage!r} climbs {row.family!r}, not {family!r}; "
                                "pick another --lineage name")

    def generation(self, number: int) -> Generation:
        with self.fence.write() as s:
            row = s.scalars(select(Generation).where(Generation.lineage == self.lineage,
                                                     Generation.number == number)).one_or_none()
            if row is None:
                row = Generation(lineage=self.lineage, number=number, stages={})
                s.add(row)
                s.flush()
            return row

    def finished(self) -> list[Generation]:
        with self.store.session() as s:
            return list(s.scalars(select(Generation).where(
                Generation.lineage == self.lineage, Generation.status.in_(("promoted", "rejected"))
            ).order_by(Generation.number)))

    def result(self, generation: Generation, stage: str) -> Any:
        """The latest finished result of a stage of ``generation`` (None if it has none), validated."""
        return next(iter(self.results(generation, stage)), None)

    def results(self, generation: Generation, stage: str) -> list[Any]:
        """Every finished result of a stage of ``generation``, latest first (a search decomposes several
        candidates in one generation), validated."""
        with self.store.session() as s:
            rows = s.scalars(select(StageRun).where(StageRun.generation_id == generation.id, StageRun.stage == stage,
                                                    StageRun.status == "done").order_by(StageRun.id.desc()))
            return [self.read(stage, generation.number, row.result) for row in rows]

    def stage_results(self, stage: str) -> list[tuple[int, Any]]:
        """Every finished result of ``stage`` in this lineage, (generation number, result), oldest first."""
        return stage_results(self.store, self.lineage, stage, self.read)

    def run_stage(self, gen: Generation, stage: str, inputs: dict[str, Any], fn: Callable[[], Any],
                  finish: Callable[[Session, Any], None] | None = None) -> Any:
        """Return the stored result of (generation, stage, inputs) if it finished before; else run and store it.

        ``finish`` writes more rows in the transaction that stores the result, so they commit as one unit."""
        key = digest({"config": self.config_digest, "stage": stage, "inputs": inputs})
        with self.store.session() as s:
            done = s.scalars(select(StageRun).where(StageRun.generation_id == gen.id, StageRun.stage == stage,
                                                    StageRun.inputs_hash == key, StageRun.status == "done")).first()
        if done is not None:
            log.info("generation %d %s: skipped (finished earlier, inputs %s)", gen.number, stage, key[:12])
            return self.read(stage, gen.number, done.result)
        result = fn()
        if not isinstance(result, self.kinds[stage]):
            raise TypeError(f"stage {stage} returned {type(result).__name__}, not {self.kinds[stage].__name__}")
        fault_point(gen.number, stage)
        with self.fence.write() as s:
            s.execute(delete(StageRun).where(StageRun.generation_id == gen.id, StageRun.stage == stage,
                                             StageRun.inputs_hash == key))
            s.add(StageRun(generation_id=gen.id, stage=stage, inputs_hash=key, status="done",
                           result=result.model_dump(mode="json"), finished_at=utcnow()))
            row = s.get(Generation, gen.id)
            row.stages = {**row.stages, stage: "done"}
            if finish is not None:
                finish(s, result)
        return result

    def finisher(self, gen: Generation, parent_pair_id: str, candidate_pair_id: str,
                 promoted: bool) -> Callable[[Session, Any], None]:
        """What ends a generation, written in the transaction that stores its register result."""
        def finish(s: Session, result: Any) -> None:
            row = s.get(Generation, gen.id)
            row.parent_pair_id, row.candidate_pair_id = parent_pair_id, candidate_pair_id
            row.status, row.finished_at = ("promoted" if promoted else "rejected"), utcnow()
        return finish

    def save_pair(self, pair: Pair, adapter_dir: str | None, parent: str | None) -> None:
        with self.fence.write() as s:
            if s.get(PairRow, pair.id) is None:
                s.add(PairRow(id=pair.id, lineage=self.lineage, base_model_hash=pair.base_model_hash,
                              adapter_hash=pair.adapter_hash, adapter_uri=adapter_dir, harness_id=pair.harness_id,
                              harness_hash=pair.harness_hash, parent_pair_id=parent))

    def load_pair(self, pair_id: str) -> Pair:
        with self.store.session() as s:
            row = s.get(PairRow, pair_id)
            return Pair(base_model_hash=row.base_model_hash, adapter_hash=row.adapter_hash,
                        harness_id=row.harness_id, harness_hash=row.harness_hash)

    def attempt(self, parent_pair_id: str, candidate_pair_id: str, number: int) -> int:
        """The candidate's number among the distinct candidates gated against this parent, ordinary and
        harness-search ones alike (the r-th spends ``alpha_r`` of the gate's alpha). Persisted: a candidate
        judged again keeps its number, and a restarted run continues the count."""
        with self.fence.write() as s:
            mine = select(GateAttempt.attempt).where(GateAttempt.lineage == self.lineage,
                                                     GateAttempt.parent_pair_id == parent_pair_id)
            known = s.scalars(mine.where(GateAttempt.candidate_pair_id == candidate_pair_id)).first()
            if known is not None:
                return known
            attempt = 1 + (s.scalar(select(func.max(GateAttempt.attempt)).where(
                GateAttempt.lineage == self.lineage, GateAttempt.parent_pair_id == parent_pair_id)) or 0)
            s.add(GateAttempt(lineage=self.lineage, parent_pair_id=parent_pair_id,
                              candidate_pair_id=candidate_pair_id, attempt=attempt, generation=number))
            return attempt

    def rejections_in_a_row(self) -> int:
        """The plateau counter, from the stored generations (so it survives restarts)."""
        count = 0
        for g in reversed(self.finished()):
            if g.status == "promoted":
                break
            count += 1
        return count


def fault_point(generation: int, stage: str) -> None:
    """TEST HOOK: ``RSI_TEST_KILL_AT=<generation>:<stage>`` kills this process with SIGKILL after the stage's
    work and before its result is stored (``<generation>:start`` before the generation begins)."""
    target = os.environ.get("RSI_TEST_KILL_AT")
    if target and target == f"{generation}:{stage}":
        os.kill(os.getpid(), signal.SIGKILL)


def stage_results(store: Any, lineage: str, stage: str, read: Read) -> list[tuple[int, Any]]:
    """Every finished result of ``stage`` in ``lineage``, (generation number, result), oldest first."""
    with store.session() as s:
        rows = s.execute(select(Generation.number, StageRun.result).join(StageRun, StageRun.generation_id == Generation.id)
                         .where(Generation.lineage == lineage, StageRun.stage == stage, StageRun.status == "done")
                         .order_by(StageRun.id)).all()
    return [(number, read(stage, number, result)) for number, result in rows]
