"""The state DB: migrations up and down, schema equal to the models, writes that are all-or-nothing."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, select, text

from rsi.errors import RuntimeFailure, UserError
from rsi.store import Store, open_store
from rsi.store.schema import VERSION_TABLE, Base, Generation, Lineage, PairRow, StageRun, TaskRow, TrajectoryRow, VerdictRow

RSI_TABLES = set(Base.metadata.tables)


def test_upgrade_downgrade_upgrade(db_url: str) -> None:
    store = Store(db_url)
    assert store.current() is None
    store.upgrade()
    assert store.current() == store.head()
    assert RSI_TABLES <= set(inspect(store.engine).get_table_names())
    store.downgrade("base")
    assert store.current() is None
    assert not RSI_TABLES & set(inspect(store.engine).get_table_names())
    store.upgrade()
    assert store.current() == store.head()
    store.dispose()


def test_specialists_admitted_before_0008_stay_public(db_url: str) -> None:
    """0008 adds the key a specialist is private to: a specialist admitted before it keeps its row and serves every
    key (no owner); going back to 0007 keeps the row too."""
    from rsi.mol.registry import list_specialists

    store = Store(db_url)
    store.upgrade("0007")
    with store.engine.begin() as conn:
        conn.execute(text("INSERT INTO rsi_lineages (name, family, spec, created_at) "
                          "VALUES ('add', 'addition', '{}', CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO rsi_specialists (name, lineage, description, levels, created_at) "
                          "VALUES ('add', 'add', 'adds', '[1, 2]', CURRENT_TIMESTAMP)"))
    store.upgrade()
    [spec] = list_specialists(store)
    assert (spec.name, spec.levels, spec.owner_key) == ("add", (1, 2), None)
    store.downgrade("0007")
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT name, description FROM rsi_specialists")).all() == [("add", "adds")]
    store.dispose()


def test_migrations_match_models(db_url: str) -> None:
    store = open_store(db_url)
    with store.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE, "compare_type": True})
        diff = [d for d in compare_metadata(ctx, Base.metadata) if not _foreign_table(d)]
    assert diff == []
    store.dispose()


def _foreign_table(diff) -> bool:
    """Tables of other tools sharing the database (and our own version table) are not ours to compare."""
    return diff[0] == "remove_table" and not diff[1].name.startswith("rsi_") or getattr(diff[1], "name", "") == VERSION_TABLE


def test_own_version_table_leaves_other_tools_alone(db_url: str) -> None:
    """Prefect and MLflow keep `alembic_version`; rsi must neither read nor drop it."""
    store = Store(db_url)
    with store.engine.begin() as conn:
        conn.execute(text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)"))
        conn.execute(text("INSERT INTO alembic_version VALUES ('someone-elses')"))
    store.upgrade()
    store.downgrade("base")
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == "someone-elses"
    assert VERSION_TABLE in inspect(store.engine).get_table_names()
    store.dispose()


def test_rows_round_trip_and_failed_writes_leave_nothing(db_url: str) -> None:
    store = open_store(db_url)
    with store.session() as s:
        s.add(Lineage(name="add", family="addition", spec={"seed": 0}))
        s.add(TaskRow(id="t1", family="addition", family_version="1", level=3, seed=0, index=0,
                      payload={"a": 123, "b": 456}, answer=579))
        s.add(PairRow(id="p1", lineage="add", base_model_hash="b" * 64, adapter_hash=None,
                      harness_id="addition/v1", harness_hash="h" * 64))
        s.flush()
        gen = Generation(lineage="add", number=1, parent_pair_id="p1", stages={"discover": "done"})
        s.add(gen)
        s.flush()
        s.add(StageRun(generation_id=gen.id, stage="discover", inputs_hash="x", status="done", result={"n": 1}))
        s.add(TrajectoryRow(id="tr1", task_id="t1", pair_id="p1", generation_id=gen.id, harness_id="addition/v1",
                            sample_index=0, seed=0, messages=[{"role": "assistant", "content": "975"}],
                            finish_reason="stop", prompt_tokens=8, completion_tokens=4, timings={"generate_s": 0.1}))
        s.add(VerdictRow(trajectory_id="tr1", contract_version="1", harness_hash="h" * 64, passed=True,
                         rules=[{"rule": "answer_correct", "passed": True}]))
    with pytest.raises(Exception):
        with store.session() as s:
            s.add(TaskRow(id="t2", family="addition", family_version="1", level=1, seed=0, index=1,
                          payload={}, answer=1))
            s.add(VerdictRow(trajectory_id="tr1", contract_version="1", harness_hash="h" * 64, passed=False, rules=[]))
    with store.session() as s:
        assert s.scalars(select(TaskRow.id)).all() == ["t1"]  # t2 rolled back with the duplicate verdict
        verdict = s.scalars(select(VerdictRow)).one()
        assert verdict.passed and verdict.rules[0]["rule"] == "answer_correct"
        assert s.scalars(select(TrajectoryRow)).one().messages[0]["content"] == "975"
    store.dispose()


def test_unknown_revision_is_a_user_error(db_url: str) -> None:
    store = open_store(db_url)
    with pytest.raises(UserError, match="nope"):
        store.downgrade("nope")
    store.dispose()


def test_unreachable_database_is_a_runtime_failure() -> None:
    store = Store("postgresql+psycopg://nobody@127.0.0.1:1/none")
    with pytest.raises(RuntimeFailure, match="cannot connect"):
        store.current()


def test_bad_url_is_a_user_error() -> None:
    with pytest.raises(UserError, match="RSI_DATABASE_URL"):
        Store("notadb://x")
