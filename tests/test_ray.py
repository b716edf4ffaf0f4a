"""The ray runner: the same lineage as the local runner, byte for byte, with the work in Ray shards."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from .test_cycle import run_tiny, seed_home


def stored_lineage(home: Path) -> dict:
    """What a runner must not change: every stored trajectory, verdict, evaluation and stage result."""
    from rsi.store import open_store
    from rsi.store.schema import EvaluationRow, Generation, StageRun, TrajectoryRow, VerdictRow

    store = open_store(f"sqlite:///{home / 'rsi.db'}")
    with store.session() as db:
        trajectories = [(r.id, r.task_id, r.pair_id, r.sample_index, r.seed, r.messages, r.finish_reason,
                         r.prompt_tokens, r.completion_tokens)
                        for r in db.scalars(select(TrajectoryRow).order_by(TrajectoryRow.id))]
        verdicts = [(r.trajectory_id, r.harness_hash, r.passed, r.rules)
                    for r in db.scalars(select(VerdictRow).order_by(VerdictRow.trajectory_id))]
        evaluations = [(r.pair_id, r.level, r.split, r.n, r.correct, r.outcomes)
                       for r in db.scalars(select(EvaluationRow).order_by(EvaluationRow.pair_id, EvaluationRow.level))]
        stages = {(g.number, r.stage): r.result for g in db.scalars(select(Generation))
                  for r in db.scalars(select(StageRun).where(StageRun.generation_id == g.id))}
        generations = [(g.number, g.status, g.candidate_pair_id)
                       for g in db.scalars(select(Generation).order_by(Generation.number))]
    store.dispose()
    for (_, stage), result in stages.items():  # wall times and run-specific paths/ids are not results
        for key in ("seconds", "mlflow_run_id", "adapter_dir", "warm_start", "version", "model_uri"):
            result.pop(key, None)
    return {"trajectories": trajectories, "verdicts": verdicts, "evaluations": evaluations, "stages": stages,
            "generations": generations}


def ray_processes() -> list[str]:
    import psutil

    names = ("raylet", "gcs_server", "ray::")
    return [p.name() for p in psutil.Process().children(recursive=True) if p.name().startswith(names)]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ray_runner_gives_the_local_lineage(prefect_api, tiny_base, tmp_path, monkeypatch) -> None:
    """Two tiny generations with runner local, then ray (3 shards, a Ray instance started for the run), from
    the same base and seed in separate RSI_HOMEs: identical trajectories (ids and texts), verdicts (every rule),
    held-out outcomes, adapter hashes and gate decisions; the run's Ray instance is gone afterwards."""
    ray = pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    lineages = {}
    for runner in ("local", "ray"):
        home = tmp_path / runner
        seed_home(home, tiny_base)
        monkeypatch.setenv("RSI_HOME", str(home))
        summaries, events = run_tiny(2, runner=runner, shards=3)
        assert [s.generation for s in summaries] == [1, 2]
        lineages[runner] = stored_lineage(home), [(s.gate, s.p_value, s.candidate) for s in summaries]
        if runner == "ray":
            assert any("started a Ray instance for this run" in e for e in events), events
    (local, local_gates), (sharded, ray_gates) = lineages["local"], lineages["ray"]
    assert local["trajectories"] and local["verdicts"] and local["evaluations"]
    for key in ("trajectories", "verdicts", "evaluations", "generations", "stages"):
        assert sharded[key] == local[key], key
    assert sharded["stages"][(1, "train")]["adapter_hash"] == local["stages"][(1, "train")]["adapter_hash"]
    assert ray_gates == local_gates
    assert not ray.is_initialized() and ray_processes() == []  # shut down with the run, raylet included


def test_ray_runner_needs_ray_installed_and_the_hf_backend(monkeypatch) -> None:
    import importlib.util

    from rsi.config import get_settings
    from rsi.run import Run, RunContext, load_config
    from rsi.errors import UserError

    find_spec = importlib.util.find_spec
    with monkeypatch.context() as m:
        m.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
        with pytest.raises(UserError, match=r"needs Ray, which is not installed: pip install 'rsi\[ray\]'"):
            Run(RunContext.of(load_config("tiny", runner="ray"), get_settings()))
    if find_spec("ray") is not None:
        with pytest.raises(UserError, match="use --runner local"):
            Run(RunContext.of(load_config("tiny", runner="ray", backend="openai"), get_settings()))


def test_runner_is_not_part_of_the_results_key() -> None:
    """A lineage started with one runner continues under another: its stored stage results stay valid."""
    from rsi.run import load_config

    assert load_config("tiny", runner="ray", shards=4).digest == load_config("tiny").digest
