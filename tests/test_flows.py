"""What crosses a flow or task boundary: JSON parameters that rebuild exactly the config, `--set` overrides,
and typed stage results validated when read back (no Prefect run, no model)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("profile", ["demo", "tiny"])
def test_flow_parameters_rebuild_exactly_the_config(profile) -> None:
    from rsi.flows.cycle import flow_parameters
    from rsi.run import load_config, parse_sets

    config = load_config(profile, lineage="x", seed=3, **parse_sets(["train.steps=7", "gate.alpha=0.1"]))
    params = json.loads(json.dumps(flow_parameters(config)))  # what a deployment stores and hands back
    named = {k: params[k] for k in ("family", "lineage", "harness")}
    again = load_config(params["profile"], **{**params["overrides"], **named})
    assert again == config and again.digest == config.digest


def test_set_overrides_merge_into_the_profile_key_by_key() -> None:
    from rsi.run import load_config, parse_sets

    tiny = load_config("tiny")
    config = load_config("tiny", **parse_sets(["train.steps=60", "curriculum.rule=accelerated", "eval_n=256"]))
    assert config.train.steps == 60 and config.train.batch_size == tiny.train.batch_size  # the rest kept
    assert config.curriculum.rule == "accelerated" and config.curriculum.max_level == tiny.curriculum.max_level
    assert config.eval_n == 256


@pytest.mark.parametrize("sets, named", [
    (["trian.steps=3"], "trian"),
    (["train.steps=-1"], "train.steps"),
    (["train.steps"], "KEY=VALUE"),
    (["gate=1", "gate.alpha=0.1"], "gate"),
])
def test_bad_overrides_name_the_field(sets, named) -> None:
    from rsi.run import load_config, parse_sets
    from rsi.errors import UserError

    with pytest.raises(UserError, match=named):
        load_config("tiny", **parse_sets(sets))


def test_stage_results_are_validated_when_read_back() -> None:
    from rsi.run import Registered, Selected, read_result
    from rsi.errors import RuntimeFailure

    stored = Selected(digest="d" * 64, size=3, corrupted=False, frontier=2, replay=1).model_dump(mode="json")
    assert read_result("select", 4, stored) == Selected.model_validate(stored)
    assert read_result("register", 4, {"version": "2", "promoted": True}) == Registered(version="2", promoted=True)
    with pytest.raises(RuntimeFailure, match=r"select result of generation 4 .*size"):
        read_result("select", 4, {**stored, "size": "many"})
    with pytest.raises(RuntimeFailure, match=r"register result of generation 4 .*promote"):
        read_result("register", 4, {"version": "2", "promote": True})  # a renamed key fails at once


def test_a_supervised_child_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path) -> None:
    """`rsi worker` passes a SIGTERM on to the Prefect worker; one that does not stop (its API server gone, it
    retries for minutes) is killed with its process group once the grace period is over."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pids = tmp_path / "pids"
    stubborn = ("import os, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
                f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{kid.pid}}'); time.sleep(600)")
    supervisor = subprocess.Popen([sys.executable, "-c", "import sys; from rsi.flows.deploy import supervise; "
                                   f"sys.exit(supervise([sys.executable, '-c', {stubborn!r}], None, 'the stub', 3))"],
                                  stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (pids.exists() and pids.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    child, grandchild = map(int, pids.read_text().split())
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=30) == -signal.SIGKILL % 256  # the stub's status: killed
    assert "the stub did not stop within 3 s; killing it and its process group" in supervisor.stderr.read()
    time.sleep(0.5)
    for pid in (child, grandchild):
        stat = f"/proc/{pid}/stat"
        state = open(stat).read().rsplit(")", 1)[1].split()[0] if os.path.exists(stat) else "gone"
        assert state in ("gone", "Z"), f"pid {pid} outlived the supervisor ({state})"


def test_every_profile_is_a_valid_config() -> None:
    """The shipped profiles (rsi/run/profiles.toml) each load into a CycleConfig; ``extends`` takes the other
    profile's fields, its own tables replacing the other's."""
    from rsi.run import PROFILES, load_config

    assert {"demo", "tiny", "sorting", "smollm2", "mol-addition", "mol-sorting"} <= set(PROFILES)
    configs = {name: load_config(name) for name in PROFILES}
    assert configs["mol-addition"].harness_search == configs["demo"].harness_search
    assert configs["mol-addition"].base_recipe["also"][0]["family"] == "sorting"
    assert configs["mol-sorting"].family == "sorting" and configs["mol-sorting"].target_level == 8
    assert configs["mol-addition"].base_recipe == configs["mol-sorting"].base_recipe  # one base for both


def test_names_moved_out_of_rsi_cycle_still_import_from_it() -> None:
    """Code written before the run package (rsi.run, rsi.store.ledger/leases) keeps importing from rsi.cycle."""
    import rsi.cycle as old
    import rsi.run as run
    import rsi.store.leases as leases

    assert old.load_config is run.load_config and old.Discovered is run.Discovered
    assert old.CycleConfig is run.CycleConfig and old.read_result is run.read_result
    assert old.acquire_lease is leases.acquire_lease and old.release_lease is leases.release_lease


def test_a_run_context_carries_no_secret(monkeypatch) -> None:
    """A flow's parameters are stored and shown by Prefect: the context leaves out the engine's API key and any
    URL with a password, and the process that runs a stage reads them from its own environment."""
    import json

    from rsi.config import Settings
    from rsi.run import RunContext, load_config

    url = "postgresql://rsi:s3cret@db.example:5432/rsi"
    context = RunContext.of(load_config("tiny"), Settings(database_url=url, engine_api_key="k3y",
                                                          mlflow_tracking_uri="http://mlflow:5000"))
    text = json.dumps(context.model_dump(mode="json"))
    assert "s3cret" not in text and "k3y" not in text and "http://mlflow:5000" in text
    monkeypatch.setenv("RSI_DATABASE_URL", url)
    monkeypatch.setenv("RSI_ENGINE_API_KEY", "k3y")
    settings = Settings(**RunContext.model_validate_json(text).settings)
    assert "s3cret" in settings.db_url and settings.engine_api_key == "k3y"
