"""The rsi state DB: SQLAlchemy 2 tables, all prefixed ``rsi_`` so the database can be shared.

Migrations in ``migrations/versions`` create exactly these tables; a test compares the two.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Integer, MetaData, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.sql.expression import true

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
VERSION_TABLE = "rsi_alembic_version"


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, datetime: DateTime(timezone=True)}


class Lineage(Base):
    __tablename__ = "rsi_lineages"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    family: Mapped[str] = mapped_column(String(64))
    spec: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Generation(Base):
    """One generation of a lineage; ``stages`` maps stage name -> status for a quick overview."""

    __tablename__ = "rsi_generations"
    __table_args__ = (UniqueConstraint("lineage", "number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    lineage: Mapped[str] = mapped_column(ForeignKey("rsi_lineages.name", ondelete="CASCADE"), index=True)
    number: Mapped[int]
    parent_pair_id: Mapped[str | None] = mapped_column(String(64))
    candidate_pair_id: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default="running")
    stages: Mapped[dict[str, Any]] = mapped_column(default=dict)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]


class StageRun(Base):
    """A stage's persisted result, keyed by what it was computed from, not by a flow-run id."""

    __tablename__ = "rsi_stage_runs"
    __table_args__ = (UniqueConstraint("generation_id", "stage", "inputs_hash"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    generation_id: Mapped[int] = mapped_column(ForeignKey("rsi_generations.id", ondelete="CASCADE"), index=True)
    stage: Mapped[str] = mapped_column(String(32))
    inputs_hash: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]


class TaskRow(Base):
    __tablename__ = "rsi_tasks"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    family: Mapped[str] = mapped_column(String(64), index=True)
    family_version: Mapped[str] = mapped_column(String(16))
    level: Mapped[int] = mapped_column(index=True)
    seed: Mapped[int] = mapped_column(BigInteger)
    index: Mapped[int]
    split: Mapped[str] = mapped_column(String(16), default="train")
    payload: Mapped[dict[str, Any]]
    answer: Mapped[Any] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class PairRow(Base):
    __tablename__ = "rsi_pairs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    lineage: Mapped[str | None] = mapped_column(ForeignKey("rsi_lineages.name", ondelete="SET NULL"), index=True)
    base_model_hash: Mapped[str] = mapped_column(String(64))
    adapter_hash: Mapped[str | None] = mapped_column(String(64))
    adapter_uri: Mapped[str | None] = mapped_column(Text)
    harness_id: Mapped[str] = mapped_column(String(128))
    harness_hash: Mapped[str] = mapped_column(String(64))
    parent_pair_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class TrajectoryRow(Base):
    __tablename__ = "rsi_trajectories"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("rsi_tasks.id"), index=True)
    # No foreign key: trajectories produced elsewhere can be audited and stored before their pair is known.
    pair_id: Mapped[str] = mapped_column(String(64), index=True)
    generation_id: Mapped[int | None] = mapped_column(ForeignKey("rsi_generations.id", ondelete="CASCADE"), index=True)
    harness_id: Mapped[str] = mapped_column(String(128))
    sample_index: Mapped[int]
    seed: Mapped[int] = mapped_column(BigInteger)
    messages: Mapped[list[Any]]
    finish_reason: Mapped[str] = mapped_column(String(16))
    prompt_tokens: Mapped[int]
    completion_tokens: Mapped[int]
    timings: Mapped[dict[str, Any]]
    tool_log: Mapped[list[Any] | None]  # episodes only: every tool call with the state hashes around it
    # harvested from served traffic (``rsi.mol.harvest``): the conversation it came from; None: a rollout
    conversation_id: Mapped[str | None] = mapped_column(String(64), index=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class VerdictRow(Base):
    __tablename__ = "rsi_verdicts"
    __table_args__ = (UniqueConstraint("trajectory_id", "contract_version", "harness_hash"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    trajectory_id: Mapped[str] = mapped_column(ForeignKey("rsi_trajectories.id", ondelete="CASCADE"), index=True)
    contract_version: Mapped[str] = mapped_column(String(32))
    harness_hash: Mapped[str] = mapped_column(String(64))
    passed: Mapped[bool] = mapped_column(Boolean, index=True)
    rules: Mapped[list[Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class DatasetRow(Base):
    """A selected training set: its digest is over the ordered trajectory ids."""

    __tablename__ = "rsi_datasets"

    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    lineage: Mapped[str | None] = mapped_column(ForeignKey("rsi_lineages.name", ondelete="SET NULL"), index=True)
    generation_id: Mapped[int | None] = mapped_column(ForeignKey("rsi_generations.id", ondelete="SET NULL"))
    size: Mapped[int]
    filters: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class DatasetItem(Base):
    __tablename__ = "rsi_dataset_items"

    dataset_digest: Mapped[str] = mapped_column(
        ForeignKey("rsi_datasets.digest", ondelete="CASCADE"), primary_key=True
    )
    position: Mapped[int] = mapped_column(primary_key=True)
    trajectory_id: Mapped[str] = mapped_column(ForeignKey("rsi_trajectories.id"), index=True)


class EvaluationRow(Base):
    """Exact-match accuracy of one pair at one level on one held-out task set."""

    __tablename__ = "rsi_evaluations"
    __table_args__ = (UniqueConstraint("pair_id", "level", "split", "seed", "n", "decoding"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    pair_id: Mapped[str] = mapped_column(ForeignKey("rsi_pairs.id"), index=True)
    generation_id: Mapped[int | None] = mapped_column(ForeignKey("rsi_generations.id", ondelete="SET NULL"))
    level: Mapped[int]
    split: Mapped[str] = mapped_column(String(16), default="heldout")
    seed: Mapped[int] = mapped_column(BigInteger)
    n: Mapped[int]
    correct: Mapped[int]
    accuracy: Mapped[float] = mapped_column(Float)
    ci_low: Mapped[float] = mapped_column(Float)
    ci_high: Mapped[float] = mapped_column(Float)
    decoding: Mapped[str] = mapped_column(String(32), default="greedy")
    outcomes: Mapped[list[Any]] = mapped_column(default=list)  # per task, by index: paired tests need them
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class AttributionRow(Base):
    """Why a task of a generation was failed or not posed, and whose it is: model, harness or task
    (``rsi.attribution``). One row per failed task; one per level the harness could not pose."""

    __tablename__ = "rsi_attributions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    generation_id: Mapped[int] = mapped_column(ForeignKey("rsi_generations.id", ondelete="CASCADE"), index=True)
    level: Mapped[int]
    task_id: Mapped[str | None] = mapped_column(String(64))  # None: a level not posable, no task was drawn
    cause: Mapped[str] = mapped_column(String(32))
    owner: Mapped[str] = mapped_column(String(16))
    tasks: Mapped[int] = mapped_column(default=1)  # 1 per failed task; the tasks wanted at a level not posable
    samples: Mapped[dict[str, Any]]  # cause -> samples of the task with that cause
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class GateAttempt(Base):
    """The gate's alpha-spending counter: the r-th distinct candidate judged against a parent pair spends
    ``alpha_r`` (``rsi.gate.attempt_alpha``), whether a harness search or an ordinary generation made it. A
    candidate judged again (a restarted run) keeps its number, so a restart spends nothing more."""

    __tablename__ = "rsi_gate_attempts"
    __table_args__ = (UniqueConstraint("lineage", "parent_pair_id", "candidate_pair_id"),
                      UniqueConstraint("attempt", "parent_pair_id", "lineage"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    lineage: Mapped[str] = mapped_column(ForeignKey("rsi_lineages.name", ondelete="CASCADE"), index=True)
    parent_pair_id: Mapped[str] = mapped_column(String(64))
    candidate_pair_id: Mapped[str] = mapped_column(String(64))
    attempt: Mapped[int]
    generation: Mapped[int]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class HarnessRow(Base):
    """A harness version locked to its content hash at first use: the same id@version never changes."""

    __tablename__ = "rsi_harnesses"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)  # "<id>/<version>"
    hash: Mapped[str] = mapped_column(String(64))
    document: Mapped[dict[str, Any]]
    sources: Mapped[dict[str, Any]]
    path: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Lease(Base):
    """Who runs a lineage now. A lease whose heartbeat is older than its ttl may be taken over.

    ``token`` is a fencing token: it grows by one with every acquisition, and every stage write checks it,
    so a run that lost its lease (its heartbeat stalled and another run took over) cannot write again.
    The row stays after release (holder '') so the token keeps growing."""

    __tablename__ = "rsi_leases"

    lineage: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    token: Mapped[int] = mapped_column(default=0, server_default="0")
    acquired_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    ttl_s: Mapped[int] = mapped_column(default=120)


class SpecialistRow(Base):
    """A lineage admitted to Mixture-of-LoRA serving (``rsi.mol``): its champion answers the turns routed to it."""

    __tablename__ = "rsi_specialists"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    lineage: Mapped[str] = mapped_column(ForeignKey("rsi_lineages.name", ondelete="CASCADE"), index=True)
    description: Mapped[str] = mapped_column(Text, default="")
    levels: Mapped[list[Any]]  # the family's levels its routing examples are drawn from
    owner_key: Mapped[str | None] = mapped_column(String(64))  # the API key's name it is private to; None: every key's
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKeyRow(Base):
    """A bearer key of the serving proxy, stored as its SHA-256 (the key itself is shown once)."""

    __tablename__ = "rsi_api_keys"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]
    harvest: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())  # False: opted out


class ConversationRow(Base):
    """A conversation of the serving proxy; its messages outlive the proxy process."""

    __tablename__ = "rsi_conversations"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    api_key: Mapped[str] = mapped_column(String(64), index=True)  # the key's name: a key sees its own only
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ConversationMessageRow(Base):
    """One message of a conversation, in order; an assistant message names the specialist that wrote it."""

    __tablename__ = "rsi_conversation_messages"
    __table_args__ = (UniqueConstraint("conversation_id", "position"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    conversation_id: Mapped[str] = mapped_column(ForeignKey("rsi_conversations.id", ondelete="CASCADE"), index=True)
    position: Mapped[int]
    message: Mapped[dict[str, Any]]
    specialist: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class RateLimitRow(Base):
    """A key's token bucket, shared by every proxy worker on the state DB: ``tokens`` left at ``updated``
    (seconds since the epoch)."""

    __tablename__ = "rsi_rate_limits"

    api_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    tokens: Mapped[float] = mapped_column(Float)
    updated: Mapped[float] = mapped_column(Float)
