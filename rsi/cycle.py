"""What one lineage run needs between stages: its config, the state DB, the champion, stage bookkeeping.

The stages themselves read top to bottom in ``flows/cycle.py``; this module holds the plumbing they share:
persisted stage results keyed by (lineage, generation, stage, inputs hash), the champion of a generation,
cached held-out evaluations, and the lease that keeps two runs off one lineage.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import delete, select, update

from rsi.config import Settings
from rsi.curriculum import CurriculumSpec
from rsi.errors import UserError
from rsi.evaluate import LevelScore, evaluate, expressible
from rsi.gate import GateSpec
from rsi.hashing import digest
from rsi.hcp import Harness, load_harness
from rsi.models import Pair
from rsi.select import SelectionSpec
from rsi.store import Store, open_store
from rsi.store.schema import EvaluationRow, Generation, Lease, Lineage, PairRow, StageRun, utcnow
from rsi.tasks import TaskFamily, get_family
from rsi.train import TrainSpec

log = logging.getLogger("rsi.cycle")
REPO = Path(__file__).resolve().parent.parent


class CycleConfig(BaseModel):
    """Every knob of a lineage run. Stored with the lineage; part of each stage's inputs hash."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lineage: str = Field("addition", pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")
    family: str = "addition"
    harness: str = "harness_versions/addition/v1"
    seed: int = 0
    backend: Literal["hf", "openai"] = "hf"
    warm_start: Literal["parent", "base"] = "parent"
    base_recipe: dict[str, Any] = Field(default_factory=dict, description="overrides of BaseRecipe's defaults")
    samples: int = Field(8, ge=1, description="k completions per task at the harness's temperature")
    replay_tasks_per_level: int = Field(64, ge=0, description="tasks per mastered level, verified, against forgetting")
    eval_n: int = Field(256, ge=1, description="held-out tasks per level")
    eval_headroom: int = Field(2, ge=1, description="levels evaluated beyond the highest one reached")
    curriculum: CurriculumSpec = CurriculumSpec(rule="accelerated")
    selection: SelectionSpec = SelectionSpec()
    train: TrainSpec = TrainSpec()
    gate: GateSpec = GateSpec()
    generations: int = Field(12, ge=1)
    target_level: int = Field(9, ge=1, description="stop once every level up to this one is mastered")
    plateau: int = Field(3, ge=1, description="stop after this many rejected candidates in a row")
    corrupt_training_data: bool = Field(False, description="TEST SWITCH: train on shuffled answers")

    @property
    def digest(self) -> str:
        return digest(self.model_dump(mode="json"))


PROFILES: dict[str, dict[str, Any]] = {
    "demo": {},
    # a whole cycle in a minute or two of CPU: for tests and smoke runs, not for measuring improvement
    "tiny": {
        "base_recipe": {"steps": 150, "d_model": 64, "n_heads": 2, "intermediate_size": 128, "warmup": 10},
        "samples": 2, "replay_tasks_per_level": 4, "eval_n": 16, "eval_headroom": 1,
        "curriculum": {"rule": "plus_one", "tasks_per_level": 16, "lookahead_tasks": 4, "max_level": 6},
        "train": {"steps": 4, "batch_size": 8, "warmup": 1},
        "generations": 2, "target_level": 6,
    },
}


def load_config(profile: str = "demo", **overrides: Any) -> CycleConfig:
    if profile not in PROFILES:
        raise UserError(f"unknown profile {profile!r}; known profiles: {', '.join(PROFILES)}")
    return CycleConfig.model_validate({**PROFILES[profile], **{k: v for k, v in overrides.items() if v is not None}})


class Champion(BaseModel):
    """The pair a generation starts from: the base (no adapter) or the latest promoted candidate."""

    model_config = ConfigDict(frozen=True)

    pair_id: str
    adapter_dir: str | None
    version: str  # MLflow model version, or "base"
    generation: int


class LineageRun:
    """A run of one lineage: config, settings, store and the objects stages share (built once)."""

    def __init__(self, config: CycleConfig, settings: Settings, store: Store | None = None):
        self.config = config
        self.settings = settings
        self.store = store or open_store(settings.db_url)
        harness_path = Path(config.harness)
        self.harness: Harness = load_harness(harness_path if harness_path.is_absolute() else REPO / harness_path)
        self.family: TaskFamily = get_family(config.family)
        if self.harness.document.family != self.family.name:
            raise UserError(f"harness {self.harness.id} is for family {self.harness.document.family!r}, "
                            f"not {self.family.name!r}")
        self._ensure_lineage_row()

    # -- the base model and the objects built from it -------------------------------------------------
    @cached_property
    def recipe(self):
        from rsi.basemodel import BaseRecipe

        return BaseRecipe(**self.config.base_recipe)

    @cached_property
    def base_dir(self) -> Path:
        from rsi.basemodel import ensure_base

        return ensure_base(self.settings, self.recipe)

    @cached_property
    def base_hash(self) -> str:
        from rsi.basemodel import model_hash

        return model_hash(self.base_dir)

    @cached_property
    def backend(self):
        """The generation backend; ``openai`` serves the base from the engine (started if it is not running)."""
        from rsi.backends import get_backend

        if self.config.backend == "openai":
            from rsi import engine

            state = engine.start(self.base_dir, self.settings.home)
            return get_backend("openai", base_url=state.base_url, tokenizer_dir=self.base_dir)
        return get_backend(self.config.backend, model_dir=self.base_dir)

    @cached_property
    def registry(self):
        from rsi.lineage import LineageRegistry

        return LineageRegistry(self.settings, self.config.lineage)

    @cached_property
    def max_level(self) -> int:
        """The highest level both the curriculum allows and the harness can render (its format has a width)."""
        level = 0
        while level < self.config.curriculum.max_level and expressible(self.harness, self.family, level + 1):
            level += 1
        return level

    @property
    def curriculum(self) -> CurriculumSpec:
        return self.config.curriculum.model_copy(update={"max_level": self.max_level})

    def adapters_dir(self) -> Path:
        return self.settings.home / "adapters" / self.config.lineage

    # -- pairs and generations ----------------------------------------------------------------------------
    def pair(self, adapter_hash: str | None) -> Pair:
        return Pair(base_model_hash=self.base_hash, adapter_hash=adapter_hash, harness_id=self.harness.id,
                    harness_hash=self.harness.hash)

    def save_pair(self, pair: Pair, adapter_dir: str | None, parent: str | None) -> None:
        with self.store.session() as s:
            if s.get(PairRow, pair.id) is None:
                s.add(PairRow(id=pair.id, lineage=self.config.lineage, base_model_hash=pair.base_model_hash,
                              adapter_hash=pair.adapter_hash, adapter_uri=adapter_dir, harness_id=pair.harness_id,
                              harness_hash=pair.harness_hash, parent_pair_id=parent))

    def load_pair(self, pair_id: str) -> Pair:
        with self.store.session() as s:
            row = s.get(PairRow, pair_id)
            return Pair(base_model_hash=row.base_model_hash, adapter_hash=row.adapter_hash,
                        harness_id=row.harness_id, harness_hash=row.harness_hash)

    def _ensure_lineage_row(self) -> None:
        with self.store.session() as s:
            row = s.get(Lineage, self.config.lineage)
            if row is None:
                s.add(Lineage(name=self.config.lineage, family=self.config.family,
                              spec=self.config.model_dump(mode="json")))
            elif row.family != self.config.family:
                raise UserError(f"lineage {self.config.lineage!r} climbs {row.family!r}, not {self.config.family!r}; "
                                "pick another --lineage name")

    def generation_row(self, number: int) -> Generation:
        with self.store.session() as s:
            row = s.scalars(select(Generation).where(Generation.lineage == self.config.lineage,
                                                     Generation.number == number)).one_or_none()
            if row is None:
                row = Generation(lineage=self.config.lineage, number=number, stages={})
                s.add(row)
                s.flush()
            return row

    def finished_generations(self) -> list[Generation]:
        with self.store.session() as s:
            return list(s.scalars(select(Generation).where(
                Generation.lineage == self.config.lineage, Generation.status.in_(("promoted", "rejected"))
            ).order_by(Generation.number)))

    def champion_before(self, number: int) -> Champion:
        """The latest promoted candidate of a generation before ``number``, else the base."""
        for row in reversed(self.finished_generations()):
            if row.number < number and row.status == "promoted":
                result = self.stage_result(row.id, "register") or {}
                train = self.stage_result(row.id, "train") or {}
                return Champion(pair_id=row.candidate_pair_id, adapter_dir=train.get("adapter_dir"),
                                version=str(result.get("version", "?")), generation=row.number)
        base = self.pair(None)
        self.save_pair(base, None, None)
        return Champion(pair_id=base.id, adapter_dir=None, version="base", generation=0)

    # -- stage results --------------------------------------------------------------------------------------
    def stage_result(self, generation_id: int, stage: str) -> dict[str, Any] | None:
        with self.store.session() as s:
            row = s.scalars(select(StageRun).where(StageRun.generation_id == generation_id, StageRun.stage == stage,
                                                   StageRun.status == "done").order_by(StageRun.id.desc())).first()
            return row.result if row else None

    def run_stage(self, gen: Generation, stage: str, inputs: dict[str, Any],
                  fn: Callable[[], dict[str, Any]], on_event: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Return the stored result of (generation, stage, inputs) if it finished before; else run and store it."""
        key = digest({"config": self.config.digest, "stage": stage, "inputs": inputs})
        with self.store.session() as s:
            done = s.scalars(select(StageRun).where(StageRun.generation_id == gen.id, StageRun.stage == stage,
                                                    StageRun.inputs_hash == key, StageRun.status == "done")).first()
        if done is not None:
            message = f"generation {gen.number} {stage}: skipped (finished earlier, inputs {key[:12]})"
            log.info(message)
            if on_event:
                on_event(message)
            return done.result
        result = fn()
        with self.store.session() as s:
            s.execute(delete(StageRun).where(StageRun.generation_id == gen.id, StageRun.stage == stage,
                                             StageRun.inputs_hash == key))
            s.add(StageRun(generation_id=gen.id, stage=stage, inputs_hash=key, status="done", result=result,
                           finished_at=utcnow()))
            row = s.get(Generation, gen.id)
            row.stages = {**row.stages, stage: "done"}
        return result

    # -- held-out evaluation, cached per pair and level --------------------------------------------------
    def scores(self, pair_id: str, adapter_dir: str | None, levels: list[int],
               generation_id: int | None = None) -> dict[int, LevelScore]:
        """Greedy held-out scores of a pair; levels measured before are read from the state DB."""
        seed, n = self.config.seed, self.config.eval_n
        found: dict[int, LevelScore] = {}
        with self.store.session() as s:
            for row in s.scalars(select(EvaluationRow).where(
                EvaluationRow.pair_id == pair_id, EvaluationRow.level.in_(levels), EvaluationRow.seed == seed,
                EvaluationRow.n == n, EvaluationRow.decoding == "greedy", EvaluationRow.split == "heldout",
            )):
                found[row.level] = LevelScore(level=row.level, n=row.n, correct=row.correct, accuracy=row.accuracy,
                                              ci_low=row.ci_low, ci_high=row.ci_high, outcomes=tuple(row.outcomes))
        missing = [lvl for lvl in levels if lvl not in found]
        if missing:
            new = evaluate(self.harness, self.family, self.backend, pair_id, missing, n, lineage_seed=seed,
                           adapter=adapter_dir)
            with self.store.session() as s:
                for sc in new:
                    s.add(EvaluationRow(pair_id=pair_id, generation_id=generation_id, level=sc.level, split="heldout",
                                        seed=seed, n=sc.n, correct=sc.correct, accuracy=sc.accuracy,
                                        ci_low=sc.ci_low, ci_high=sc.ci_high, decoding="greedy",
                                        outcomes=list(sc.outcomes)))
                    found[sc.level] = sc
        return {lvl: found[lvl] for lvl in levels}

    def close(self) -> None:
        if "backend" in self.__dict__:
            self.backend.close()
        self.store.dispose()


class LeaseHeld(UserError):
    """Another live run holds the lineage."""


def holder_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _alive(holder: str) -> bool:
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname():
        return True  # cannot see another machine's processes: trust the heartbeat
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    return True


def acquire_lease(store: Store, lineage: str, ttl_s: int = 120) -> str:
    """Take the lineage's lease, or raise ``LeaseHeld`` naming the live holder.

    A lease is free when its holder's process is gone (same host) or its heartbeat is older than its ttl,
    so a run killed with -9 can be started again at once."""
    me = holder_id()
    now = utcnow()
    with store.session() as s:
        lease = s.get(Lease, lineage, with_for_update=True)
        if lease is None:
            s.add(Lease(lineage=lineage, holder=me, acquired_at=now, heartbeat_at=now, ttl_s=ttl_s))
            return me
        beat = lease.heartbeat_at if lease.heartbeat_at.tzinfo else lease.heartbeat_at.replace(tzinfo=timezone.utc)
        fresh = now - beat < timedelta(seconds=lease.ttl_s)
        if lease.holder != me and fresh and _alive(lease.holder):
            raise LeaseHeld(f"lineage {lineage!r} is being run by {lease.holder} (since "
                            f"{lease.acquired_at:%Y-%m-%d %H:%M:%S} UTC); wait for it to finish or stop it first")
        lease.holder, lease.acquired_at, lease.heartbeat_at, lease.ttl_s = me, now, now, ttl_s
    return me


def heartbeat(store: Store, lineage: str, holder: str) -> None:
    with store.session() as s:
        s.execute(update(Lease).where(Lease.lineage == lineage, Lease.holder == holder).values(heartbeat_at=utcnow()))


def release_lease(store: Store, lineage: str, holder: str) -> None:
    with store.session() as s:
        s.execute(delete(Lease).where(Lease.lineage == lineage, Lease.holder == holder))


def since(start: datetime) -> float:
    return (utcnow() - start).total_seconds()
