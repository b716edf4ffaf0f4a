"""A local Prefect server and MLflow tracking server for scheduled runs: ``rsi stack up|down|status``.

Each server keeps its own database: on the PostgreSQL server of ``RSI_DATABASE_URL`` when that is one
(databases ``rsi_prefect`` and ``rsi_mlflow``, created if missing), else SQLite files (Prefect's in
``RSI_HOME/stack``, MLflow's the embedded default ``RSI_HOME/mlflow.db``, so a lineage begun without the
stack keeps its registry). Artifacts go to ``RSI_HOME/stack/mlartifacts``. Each server runs in its own
process group with its log and pid recorded in ``RSI_HOME/stack``; ``stack.json`` tells rsi's other
commands where the servers are (``Settings.prefect_api`` and ``Settings.mlflow_uri`` read it while the
servers live), and ``down`` stops the whole group, so no process is left behind.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from pydantic import BaseModel
from sqlalchemy.engine import make_url

from rsi.config import Settings, stack_file
from rsi.errors import RuntimeFailure, UserError

POSTGRES_DATABASES = {"prefect": "rsi_prefect", "mlflow": "rsi_mlflow"}


class Service(BaseModel):
    name: str
    pid: int
    url: str
    health: str
    log: str


class Stack(BaseModel):
    prefect_api_url: str
    mlflow_tracking_uri: str
    services: list[Service]


def read_stack(settings: Settings) -> Stack | None:
    path = stack_file(settings.home)
    try:
        return Stack.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def healthy(service: Service, timeout: float = 3.0) -> bool:
    try:
        return httpx.get(service.health, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def status(settings: Settings) -> list[dict]:
    """One row per recorded server: pid, whether its process lives and whether its health endpoint answers."""
    stack = read_stack(settings)
    if stack is None:
        return []
    return [{"name": s.name, "pid": s.pid, "url": s.url, "alive": _alive(s.pid),
             "healthy": _alive(s.pid) and healthy(s), "log": s.log} for s in stack.services]


def databases(settings: Settings) -> tuple[str, str]:
    """(Prefect's database URL, MLflow's backend store URI)."""
    url = make_url(settings.db_url)
    if url.get_backend_name() == "postgresql":
        _ensure_postgres_databases(settings.db_url)
        prefect = url.set(drivername="postgresql+asyncpg", database=POSTGRES_DATABASES["prefect"])
        mlflow = url.set(drivername="postgresql+psycopg", database=POSTGRES_DATABASES["mlflow"])
        return prefect.render_as_string(hide_password=False), mlflow.render_as_string(hide_password=False)
    mlflow = settings.mlflow_tracking_uri or f"sqlite:///{settings.home / 'mlflow.db'}"
    return f"sqlite+aiosqlite:///{settings.home / 'stack' / 'prefect.db'}", mlflow


def _ensure_postgres_databases(db_url: str) -> None:
    from sqlalchemy import create_engine, text

    admin = create_engine(db_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            existing = set(conn.scalars(text("SELECT datname FROM pg_database")))
            for name in POSTGRES_DATABASES.values():
                if name not in existing:
                    conn.execute(text(f'CREATE DATABASE "{name}"'))
        prefect_db = make_url(db_url).set(database=POSTGRES_DATABASES["prefect"])
        with create_engine(prefect_db, isolation_level="AUTOCOMMIT").connect() as conn:
            conn.execute(text("CREATE EXTENSION IF NOT EXISTS pg_trgm"))  # Prefect's server needs it
    except Exception as exc:  # noqa: BLE001 - any connection or permission problem, named
        raise RuntimeFailure(f"cannot create the stack's databases on {make_url(db_url).render_as_string()}: "
                             f"{str(exc).splitlines()[0]}") from None
    finally:
        admin.dispose()


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _bin(name: str) -> str:
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise UserError(f"the {name!r} command is not installed in this environment; reinstall rsi (pip install rsi)")
    return found


def up(settings: Settings, prefect_port: int = 4200, mlflow_port: int = 5000, timeout_s: float = 180.0) -> Stack:
    """Start both servers (or return the running stack), wait until both answer their health checks."""
    running = read_stack(settings)
    if running is not None and all(_alive(s.pid) and healthy(s) for s in running.services):
        return running
    if running is not None:
        down(settings)  # a half-dead stack: stop what is left, then start afresh
    for port, flag in ((prefect_port, "--prefect-port"), (mlflow_port, "--mlflow-port")):
        if not _port_free(port):
            raise UserError(f"port {port} on 127.0.0.1 is in use; stop what listens there or pick another with {flag}")
    folder = settings.home / "stack"
    folder.mkdir(parents=True, exist_ok=True)
    prefect_db, mlflow_db = databases(settings)
    prefect_api = f"http://127.0.0.1:{prefect_port}/api"
    mlflow_url = f"http://127.0.0.1:{mlflow_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    prefect_env = env | {"PREFECT_HOME": str(folder / "prefect-home"), "PREFECT_API_DATABASE_CONNECTION_URL": prefect_db,
                         "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_API_URL": prefect_api,
                         "PREFECT_API_URL": prefect_api}
    services = [
        _start("prefect", [_bin("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
               prefect_env, folder, url=prefect_api.removesuffix("/api"), health=f"{prefect_api}/health"),
        _start("mlflow", [_bin("mlflow"), "server", "--backend-store-uri", mlflow_db,
                          "--artifacts-destination", str(folder / "mlartifacts"), "--host", "127.0.0.1",
                          "--port", str(mlflow_port), "--workers", "1"],
               env, folder, url=mlflow_url, health=f"{mlflow_url}/health"),
    ]
    stack = Stack(prefect_api_url=prefect_api, mlflow_tracking_uri=mlflow_url, services=services)
    stack_file(settings.home).write_text(stack.model_dump_json(indent=2), encoding="utf-8")
    deadline = time.monotonic() + timeout_s
    for service in services:
        while not healthy(service):
            if not _alive(service.pid) or time.monotonic() > deadline:
                down(settings)
                raise RuntimeFailure(f"the {service.name} server did not become healthy at {service.health} "
                                     f"within {timeout_s:.0f} s; see its log {service.log}")
            time.sleep(1.0)
    return stack


def _start(name: str, command: list[str], env: dict[str, str], folder: Path, *, url: str, health: str) -> Service:
    log = folder / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=folder, start_new_session=True)  # its own process group: down stops it whole
    (folder / f"{name}.pid").write_text(str(proc.pid))
    return Service(name=name, pid=proc.pid, url=url, health=health, log=str(log))


def down(settings: Settings, grace_s: float = 20.0) -> list[str]:
    """Stop every recorded server's process group (SIGTERM, then SIGKILL after ``grace_s``); returns names."""
    from rsi.engine import kill_group

    stack = read_stack(settings)
    if stack is None:
        return []
    for service in stack.services:
        kill_group(service.pid, timeout_s=grace_s)
        (settings.home / "stack" / f"{service.name}.pid").unlink(missing_ok=True)
    stack_file(settings.home).unlink(missing_ok=True)
    return [service.name for service in stack.services]
