"""Each stage of a tiny generation runs in a spawned process from its ``RunContext`` JSON (``flows/stage.py``) and
gives the result it gives in process: no stage reaches state through a module global, a context variable or a
cached singleton."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from .conftest import REPO
from .test_cycle import seed_home

ORDER = ("discover", "execute", "audit", "select", "train", "evaluate", "register")
# where the two runs must differ: wall times, their homes' paths, MLflow's run ids
VOLATILE = {"seconds", "mlflow_run_id", "adapter_dir", "warm_start", "model_uri"}


def stable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [stable(v) for v in value]
    return value


def open_leased(home: Path):
    from rsi.config import Settings
    from rsi.run import Run, RunContext, load_config
    from rsi.store.leases import acquire_lease

    run = Run(RunContext.of(load_config("tiny", train={"steps": 8}), Settings(home=home)))
    run.fence.holder, run.fence.token = acquire_lease(run.store, run.config.lineage)
    return run


def stored(run, number: int) -> dict[str, Any]:
    gen = run.ledger.generation(number)
    return {stage: stable(run.ledger.result(gen, stage).model_dump(mode="json")) for stage in (*ORDER, "decompose")}


def test_every_stage_runs_in_a_spawned_process_from_its_context(tiny_base, tmp_path) -> None:
    from rsi.flows.cycle import generation

    in_process = tmp_path / "in-process"
    seed_home(in_process, tiny_base)
    run = open_leased(in_process)
    summary = generation(run, 1, direct=True)
    assert summary.gate in ("promoted", "rejected")
    expected = stored(run, 1)
    run.close()

    spawned = tmp_path / "spawned"
    seed_home(spawned, tiny_base)
    run = open_leased(spawned)
    context = run.context.leased(run.fence).model_dump(mode="json")
    assert json.loads(json.dumps(context)) == context  # the context is plain JSON
    results: dict[str, Any] = {"champ": run.champion(1).model_dump(mode="json")}
    names = {"discover": "found", "execute": "executed", "audit": "audited", "select": "selected", "train": "trained",
             "evaluate": "judged", "register": "registered"}
    pids = set()
    for stage in ORDER:
        request = tmp_path / f"{stage}.json"
        request.write_text(json.dumps({"context": context, "stage": stage, "number": 1, "inputs": results}))
        done = subprocess.run([sys.executable, "-c", "import os, runpy, sys; print(os.getpid(), file=sys.stderr); "
                               "sys.argv = ['rsi.flows.stage', sys.argv[1]]; runpy.run_module('rsi.flows.stage', "
                               "run_name='__main__')", str(request)],
                              capture_output=True, text=True, cwd=REPO, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        pids.add(done.stderr.split()[0])
        results[names[stage]] = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(pids) == len(ORDER)  # one process per stage
    assert stored(run, 1) == expected
    assert {stage: stable(results[names[stage]]) for stage in ORDER} == {s: expected[s] for s in ORDER}
    assert run.ledger.finished()[0].status == summary.gate  # the register stage finished the generation
    run.close()


def test_a_stage_request_that_cannot_be_read_is_named_not_a_traceback(tmp_path) -> None:
    bad = {"missing.json": None, "garbled.json": "{not json", "list.json": "[1]",
           "stage.json": '{"stage": "fly", "context": {}, "number": 1}',
           "context.json": '{"stage": "train", "context": {"config": 3}, "number": 1}'}
    for name, text in bad.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        done = subprocess.run([sys.executable, "-m", "rsi.flows.stage", str(tmp_path / name)], capture_output=True,
                              text=True, cwd=REPO, check=False)
        assert done.returncode == 2 and "Traceback" not in done.stderr, (name, done.stderr)
        assert f"error: stage request {tmp_path / name}:" in done.stderr, (name, done.stderr)
