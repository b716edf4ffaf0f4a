"""The whole RSI cycle on the tiny profile, with real Prefect, MLflow, PEFT, SQLite and PostgreSQL.

The tiny profile is for exercising every stage, not for measuring improvement (``bench/improvement.py``
and ``make demo`` do that): its candidates are usually rejected, which the gate must decide and store.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from .conftest import REPO

pytestmark = pytest.mark.slow

TAGS = ("generation", "parent_version", "pair_id", "harness_id", "harness_hash", "contract_version",
        "base_model_hash", "dataset_digest", "gate")


@pytest.fixture(scope="session")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny profile's base model, trained once per test session."""
    from rsi.basemodel import BaseRecipe, ensure_base
    from rsi.config import Settings
    from rsi.cycle import load_config

    home = tmp_path_factory.mktemp("base-home")
    return ensure_base(Settings(home=home), BaseRecipe(**load_config("tiny").base_recipe))


def seed_home(home: Path, base: Path) -> None:
    """Give an RSI_HOME the already-built tiny base (it is cached by recipe hash)."""
    target = home / "models" / base.name
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        shutil.copytree(base, target)


def run_tiny(generations: int, **overrides):
    from flows.cycle import run_lineage
    from rsi.cycle import load_config

    events: list[str] = []
    summaries = run_lineage(load_config("tiny", **overrides), generations, events.append)
    return summaries, events


@pytest.mark.parametrize("backend_db", ["sqlite", "postgresql"])
def test_tiny_lineage_end_to_end(backend_db, prefect_api, tiny_base, rsi_home, monkeypatch, request) -> None:
    from mlflow import MlflowClient

    from rsi.config import get_settings
    from rsi.cycle import CycleConfig
    from rsi.store import open_store
    from rsi.store.schema import DatasetRow, Generation, StageRun, TrajectoryRow, VerdictRow

    if backend_db == "postgresql":
        monkeypatch.setenv("RSI_DATABASE_URL", request.getfixturevalue("fresh_postgres_url"))
    seed_home(rsi_home, tiny_base)
    summaries, events = run_tiny(2)
    assert [s["generation"] for s in summaries] == [1, 2]
    for s in summaries:
        assert s["gate"] in ("promoted", "rejected") and s["trajectories"] > 0 and s["reasons"]

    settings = get_settings()
    store = open_store(settings.db_url)
    with store.session() as db:
        gens = list(db.scalars(select(Generation).order_by(Generation.number)))
        assert [g.status for g in gens] == [s["gate"] for s in summaries]
        stages = {(r.generation_id, r.stage) for r in db.scalars(select(StageRun).where(StageRun.status == "done"))}
        assert {st for _, st in stages} == {"discover", "execute", "audit", "select", "train", "evaluate", "register"}
        n_traj = len(db.scalars(select(TrajectoryRow.id)).all())
        assert n_traj == sum(s["trajectories"] for s in summaries)
        assert len(db.scalars(select(VerdictRow.id)).all()) == n_traj  # one verdict per trajectory
        assert len(db.scalars(select(DatasetRow.digest)).all()) >= 1
    store.dispose()

    client = MlflowClient(tracking_uri=settings.mlflow_uri, registry_uri=settings.mlflow_uri)
    versions = sorted(client.search_model_versions("name = 'rsi-addition'"), key=lambda v: int(v.version))
    assert len(versions) == 2
    for v, s in zip(versions, summaries):
        assert all(tag in v.tags for tag in TAGS), v.tags
        assert v.tags["gate"] == s["gate"] and v.tags["generation"] == str(s["generation"])
        assert any(k.startswith("acc_level_") for k in v.tags)
        files = {f.path for f in client.list_artifacts(v.run_id, "candidate/adapter")}
        assert "candidate/adapter/adapter_model.safetensors" in files
    assert client.get_model_version_by_alias("rsi-addition", "challenger").version == versions[-1].version
    promoted = [v for v in versions if v.tags["gate"] == "promoted"]
    if promoted:
        assert client.get_model_version_by_alias("rsi-addition", "champion").version == promoted[-1].version
    assert versions[1].tags["parent_version"] == (promoted[0].version if promoted and promoted[0].tags["generation"] == "1" else "base")

    # started again, the lineage continues at generation 3 instead of redoing 1 and 2
    more, _ = run_tiny(1)
    assert [s["generation"] for s in more] == [3]


def test_resume_skips_finished_stages(prefect_api, tiny_base, rsi_home) -> None:
    """A generation whose later stages were lost is finished from where it stopped, with the same result."""
    from rsi.config import get_settings
    from rsi.store import open_store
    from rsi.store.schema import Generation, StageRun

    seed_home(rsi_home, tiny_base)
    first, _ = run_tiny(1)
    store = open_store(get_settings().db_url)
    with store.session() as db:
        gen = db.scalars(select(Generation)).one()
        train = db.scalars(select(StageRun).where(StageRun.stage == "train")).one().result
        for row in db.scalars(select(StageRun).where(StageRun.stage.in_(("train", "evaluate", "register")))):
            db.delete(row)
        gen.status = "running"
    shutil.rmtree(train["adapter_dir"])
    again, events = run_tiny(1)
    assert [s["generation"] for s in again] == [1]
    skipped = [e for e in events if "skipped" in e]  # "generation 1 discover: skipped (finished earlier, ...)"
    assert [e.split()[2].rstrip(":") for e in skipped] == ["discover", "execute", "audit", "select"]
    with store.session() as db:
        retrained = db.scalars(select(StageRun).where(StageRun.stage == "train")).one().result
    assert retrained["adapter_hash"] == train["adapter_hash"]  # deterministic training
    assert again[0]["gate"] == first[0]["gate"]
    store.dispose()


def test_second_run_on_a_leased_lineage_exits_2(tiny_base, rsi_home) -> None:
    from rsi.config import get_settings
    from rsi.cycle import acquire_lease, release_lease
    from rsi.store import open_store

    store = open_store(get_settings().db_url)
    holder = acquire_lease(store, "addition")
    try:
        result = subprocess.run([sys.executable, "-m", "rsi", "run", "addition", "--profile", "tiny"],
                                capture_output=True, text=True, cwd=REPO, timeout=300)
        assert result.returncode == 2, result.stderr
        assert "is being run by" in result.stderr and "Traceback" not in result.stderr
    finally:
        release_lease(store, "addition", holder)
        store.dispose()


def _rsi_run(home: Path, generations: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {"RSI_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "rsi", "run", "addition", "--profile", "tiny",
                             "--generations", str(generations)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _final_adapter_hash(home: Path) -> str:
    from mlflow import MlflowClient

    uri = f"sqlite:///{home / 'mlflow.db'}"
    versions = MlflowClient(tracking_uri=uri, registry_uri=uri).search_model_versions("name = 'rsi-addition'")
    return max(versions, key=lambda v: int(v.version)).tags["adapter_hash"]


def test_kill_9_during_generation_2_then_rerun(tiny_base, tmp_path) -> None:
    """kill -9 while generation 2 trains; the rerun skips finished stages and ends where an uninterrupted run does."""
    killed_home, clean_home = tmp_path / "killed", tmp_path / "clean"
    for home in (killed_home, clean_home):
        seed_home(home, tiny_base)
    proc = _rsi_run(killed_home, 2)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "generation 2: train" in line:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)

    rerun = _rsi_run(killed_home, 1)
    out, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, out
    for stage in ("discover", "execute", "audit", "select"):
        assert f"generation 2 {stage}: skipped (finished earlier" in out, out

    clean = _rsi_run(clean_home, 2)
    clean_out, _ = clean.communicate(timeout=600)
    assert clean.returncode == 0, clean_out
    assert _final_adapter_hash(killed_home) == _final_adapter_hash(clean_home)


def test_corrupted_training_data_is_not_promoted(prefect_api, tiny_base, rsi_home) -> None:
    """The documented test switch shuffles answers; the gate rejects and the decision is stored."""
    from rsi.config import get_settings
    from rsi.store import open_store
    from rsi.store.schema import DatasetRow, Generation, StageRun

    seed_home(rsi_home, tiny_base)
    summaries, _ = run_tiny(1, corrupt_training_data=True)
    assert summaries[0]["gate"] == "rejected"
    store = open_store(get_settings().db_url)
    with store.session() as db:
        assert db.scalars(select(Generation)).one().status == "rejected"
        assert db.scalars(select(DatasetRow)).one().filters["corrupted"] is True
        decision = db.scalars(select(StageRun).where(StageRun.stage == "evaluate")).one().result["decision"]
        assert decision["promote"] is False and decision["reasons"]
    store.dispose()


@pytest.mark.vllm
@pytest.mark.timeout(3600)  # the first run on a machine installs the engine venv
def test_one_generation_through_vllm(prefect_api, tiny_base, rsi_home) -> None:
    """--backend openai: rollouts and evaluation through a real vLLM server, training still PEFT."""
    from rsi import engine
    from rsi.config import get_settings
    from rsi.store import open_store
    from rsi.store.schema import StageRun, VerdictRow

    seed_home(rsi_home, tiny_base)
    engine.install()
    try:
        summaries, events = run_tiny(1, backend="openai")
        status = engine.status(rsi_home)
        assert status["healthy"] and status["models"] == ["base"]
    finally:
        engine.stop(rsi_home)
    assert summaries[0]["gate"] in ("promoted", "rejected") and summaries[0]["trajectories"] > 0
    store = open_store(get_settings().db_url)
    with store.session() as db:
        stages = {r.stage for r in db.scalars(select(StageRun).where(StageRun.status == "done"))}
        assert {"audit", "evaluate", "register"} <= stages
        assert len(db.scalars(select(VerdictRow.id)).all()) == summaries[0]["trajectories"]
    store.dispose()
    assert not engine.status(rsi_home)["running"]
