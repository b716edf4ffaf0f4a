"""Shared fixtures. DB tests run on SQLite and on the PostgreSQL server (a fresh database per session)."""

from __future__ import annotations

import os
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parent.parent
PG_ADMIN_URL = os.environ.get("RSI_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
_backends_used: Counter[str] = Counter()


@pytest.fixture(autouse=True)
def rsi_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own RSI_HOME and no inherited RSI_* settings."""
    for key in list(os.environ):
        if key.startswith("RSI_") and not key.startswith("RSI_TEST_"):
            monkeypatch.delenv(key)
    home = tmp_path / "rsi-home"
    monkeypatch.setenv("RSI_HOME", str(home))
    return home


# Session fixtures of the cycle's tests (test_cycle, test_ray, test_stack) live here: a fixture imported
# from another test module is a second fixture, and its session would train the base again.
@pytest.fixture(scope="session")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny profile's base model, trained once per test session (or found in RSI_TEST_BASE_CACHE, an
    RSI_HOME kept between sessions: the base is cached there by recipe digest)."""
    from rsi.basemodel import BaseRecipe, ensure_base
    from rsi.config import Settings
    from rsi.run import load_config

    home = Path(os.environ.get("RSI_TEST_BASE_CACHE") or tmp_path_factory.mktemp("base-home"))
    return ensure_base(Settings(home=home), BaseRecipe(**load_config("tiny").base_recipe))


@pytest.fixture(scope="session")
def postgres_server_url() -> Iterator[str]:
    """URL of a database created for this test session on the PostgreSQL server, dropped at the end."""
    name = f"rsi_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # the suite must not silently skip PostgreSQL
        pytest.fail(f"PostgreSQL at {PG_ADMIN_URL} is needed for the DB tests ({exc}); start it or set RSI_TEST_POSTGRES_URL")
    url = make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    yield url

    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def fresh_postgres_url(postgres_server_url: str) -> Iterator[str]:
    """An empty schema-less PostgreSQL database for one test (rsi tables dropped afterwards)."""
    yield postgres_server_url
    engine = create_engine(postgres_server_url)
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database URL for each backend; tests using it run once on SQLite and once on PostgreSQL."""
    _backends_used[request.param] += 1
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state.db'}"
    return request.getfixturevalue("fresh_postgres_url")


def pytest_terminal_summary(terminalreporter) -> None:
    if _backends_used:
        runs = ", ".join(f"{name}: {count} tests" for name, count in sorted(_backends_used.items()))
        terminalreporter.write_line(f"state DB backends exercised: {runs}")
