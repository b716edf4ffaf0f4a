"""Opening the state DB and moving its schema with Alembic (configured in code, own version table)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

import rsi.migrations
from rsi.errors import RuntimeFailure, UserError
from rsi.store.schema import VERSION_TABLE

MIGRATIONS_DIR = Path(rsi.migrations.__file__).parent


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite gets foreign keys on and a busy timeout for concurrent writers."""
    try:
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            engine = create_engine(url, connect_args={"timeout": 30})
            event.listen(engine, "connect", _sqlite_pragmas)
            return engine
        return create_engine(url, pool_pre_ping=True)
    except (ArgumentError, NoSuchModuleError) as exc:
        raise UserError(
            f"RSI_DATABASE_URL {url!r} is not a usable database URL ({exc}); "
            "use sqlite:///PATH or postgresql+psycopg://USER@HOST:PORT/DB"
        ) from None


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA journal_mode=WAL")
    cur.close()


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


class Store:
    """The state DB: an engine, a session factory and the schema operations of ``rsi db``."""

    def __init__(self, url: str):
        self.url = url
        self.engine = make_engine(url)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session that commits on success and rolls back on any error: no partial writes."""
        with self.sessions() as session, session.begin():
            yield session

    def head(self) -> str:
        return ScriptDirectory.from_config(alembic_config()).get_current_head()

    def current(self) -> str | None:
        with self._connect() as conn:
            return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()

    def upgrade(self, revision: str = "head") -> None:
        self._run(command.upgrade, revision)

    def downgrade(self, revision: str) -> None:
        self._run(command.downgrade, revision)

    def ensure_schema(self) -> None:
        """Bring the schema to head; cheap when it is there already."""
        if self.current() != self.head():
            self.upgrade("head")

    def _run(self, fn, revision: str) -> None:
        cfg = alembic_config()
        try:
            with self._connect() as conn, conn.begin():
                cfg.attributes["connection"] = conn
                fn(cfg, revision)
        except CommandError as exc:
            raise UserError(f"revision {revision!r}: {exc}; see `rsi db current` and migrations/versions") from None

    @contextmanager
    def _connect(self):
        try:
            conn = self.engine.connect()
        except OperationalError as exc:
            reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
            raise RuntimeFailure(f"cannot connect to the state DB {self.engine.url!r}: {reason}") from None
        with conn:
            yield conn

    def dispose(self) -> None:
        self.engine.dispose()


def open_store(url: str | None = None, *, migrate: bool = True) -> Store:
    """Open the state DB named by ``url`` (default: the settings') with its schema at head."""
    if url is None:
        from rsi.config import get_settings

        url = get_settings().db_url
    store = Store(url)
    if migrate:
        store.ensure_schema()
    return store
