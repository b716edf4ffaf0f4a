"""Scheduled lineages: ``rsi deploy`` registers ``rsi-lineage`` as a deployment on a Prefect server, served
by ``rsi worker`` (a Prefect process worker on the work pool ``rsi``).

A deployment is one lineage: its name is the lineage's, its parameters are the flow's JSON parameters,
its concurrency limit is 1 (a scheduled run that comes while the last one still runs is cancelled, so runs
never pile up behind a slow generation), and its
runs get the deploying shell's rsi settings (RSI_HOME, the state DB, MLflow) as environment, so the worker
climbs the same lineage ``rsi run`` would; credentials among them travel in a Prefect Secret block, never in the
deployment's job variables (``run_environment``). The flow is found by module path (``rsi.flows.cycle:rsi_lineage``),
so any machine with rsi installed can run it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from typing import Any

from rsi.flows.cycle import rsi_lineage
from rsi.flows.runtime import SECRET_BLOCK
from rsi.config import Settings
from rsi.run import latest_harness, load_config
from rsi.errors import UserError

POOL = "rsi"
# What deployments made before flows/ installed as rsi.flows name as their entrypoint (`rsi worker` moves them on)
OLD_ENTRYPOINTS = ("flows.cycle.rsi_lineage", "flows.cycle:rsi_lineage")
STOP_GRACE_S = 60  # how long `rsi worker` waits for the Prefect worker to stop before it kills it


def require_server(settings: Settings, command: str) -> str:
    url = settings.prefect_api()
    if not url:
        raise UserError(f"rsi {command} needs a Prefect server, and none is configured: start one with `rsi stack up`, "
                        "or set PREFECT_API_URL (or RSI_PREFECT_API_URL, or a Prefect profile with one)")
    return url


def ensure_pool() -> None:
    """The process work pool ``rsi``, created with Prefect's default process job template if missing."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(POOL)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=POOL, type="process",
                                                   base_job_template=ProcessWorker.get_default_base_job_template()))


def run_environment(settings: Settings, api_url: str, lineage: str) -> dict[str, str]:
    """What a scheduled run needs to find this lineage's state: the settings in effect where it was deployed.
    A deployment's job variables are shown by the Prefect UI and API, so a value that is a credential (an API key,
    a URL with a password) is not among them: it goes into the Prefect Secret block ``rsi-<lineage>-env`` (its
    value is never returned unless asked for), which the run reads back when it starts (``secret_environment``),
    and the variable ``RSI_SECRET_BLOCK`` names that block."""
    from urllib.parse import urlsplit

    from prefect.blocks.system import Secret

    env = {"RSI_HOME": str(settings.home), "RSI_DATABASE_URL": settings.db_url,
           "RSI_MLFLOW_TRACKING_URI": settings.mlflow_uri, "PREFECT_API_URL": api_url,
           "PREFECT_LOGGING_EXTRA_LOGGERS": "rsi"}
    env |= {key: os.environ[key] for key in ("RSI_ENGINE_URL", "RSI_ENGINE_API_KEY", "RSI_ENGINE_MODEL")
            if os.environ.get(key)}
    secret = {k: v for k, v in env.items() if k.endswith("_KEY") or (k.endswith(("_URL", "_URI"))
                                                                      and urlsplit(v).password)}
    if secret:
        name = f"rsi-{lineage.lower().replace('_', '-').replace('.', '-')}-env"
        # as JSON text: a Secret block masks a string in every API reply (its dict value would be shown)
        Secret(value=json.dumps(secret)).save(name, overwrite=True)
        env = {k: v for k, v in env.items() if k not in secret} | {SECRET_BLOCK: name}
    return env


def deploy(settings: Settings, lineage: str, *, family: str, profile: str, generations: int, harness: str | None,
           cron: str | None, interval: int | None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Create or update the lineage's deployment; returns its name, id and schedule."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.types.entrypoint import EntrypointType

    from rsi.hcp import load_harness
    from rsi.tasks import get_family

    if (cron is None) == (interval is None):
        raise UserError("give exactly one schedule: --cron EXPR (e.g. \"*/30 * * * *\") or --interval SECONDS")
    if cron is not None:
        _check_cron(cron)
    api = require_server(settings, "deploy")
    get_family(family)  # an unknown family is named before anything is looked up for it
    harness = harness or latest_harness(family)
    config = load_config(profile, **{**(overrides or {}), "lineage": lineage, "family": family, "harness": harness})
    loaded = load_harness(config.harness)
    if loaded.document.family != family:
        raise UserError(f"harness {loaded.id} is for family {loaded.document.family!r}, not {family!r}")
    ensure_pool()
    parameters = {"family": family, "lineage": lineage, "harness": harness, "profile": profile,
                  "generations": generations, "overrides": overrides or {}}
    deployment = rsi_lineage.to_deployment(
        name=lineage, parameters=parameters, cron=cron, interval=interval,
        concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW),
        entrypoint_type=EntrypointType.MODULE_PATH, job_variables={"env": run_environment(settings, api, lineage)},
        tags=["rsi", f"lineage:{lineage}"], description=f"rsi lineage {lineage}: {generations} generation(s) per run")
    deployment_id = deployment.apply(work_pool_name=POOL)
    return {"deployment": f"rsi-lineage/{lineage}", "id": str(deployment_id), "work_pool": POOL,
            "schedule": f"cron {cron}" if cron else f"every {interval} s", "parameters": parameters}


def _check_cron(expr: str) -> None:
    from prefect.client.schemas.schedules import CronSchedule

    try:
        CronSchedule(cron=expr)
    except ValueError:
        raise UserError(f"--cron {expr!r} is not a cron expression; e.g. \"*/30 * * * *\" (every 30 minutes)") from None


def worker(settings: Settings, *, run_once: bool = False, limit: int | None = None) -> int:
    """Run a Prefect process worker on the pool ``rsi`` until stopped; returns its exit status."""
    api = require_server(settings, "worker")
    ensure_pool()
    for name in upgrade_deployments():
        print(f"deployment rsi-lineage/{name}: entrypoint moved to {entrypoint()} (flows/ installs as rsi.flows)",
              file=sys.stderr)
    command = [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type", "process"]
    command += ["--run-once"] if run_once else []
    command += ["--limit", str(limit)] if limit else []
    env = os.environ | {"PREFECT_API_URL": api, "PREFECT_LOGGING_EXTRA_LOGGERS": "rsi"}
    return supervise(command, env, "the Prefect worker")


def entrypoint() -> str:
    """The lineage flow's module path, as ``rsi deploy`` stores it."""
    return f"{rsi_lineage.fn.__module__}.{rsi_lineage.fn.__name__}"


def upgrade_deployments() -> list[str]:
    """Point the ``rsi-lineage`` deployments made before flows/ moved under the rsi namespace (entrypoint
    ``flows.cycle.rsi_lineage``, a module an installed rsi no longer has) at the flow's module path now, so their
    scheduled runs go on; returns their names."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        found = client.read_deployments(flow_filter=FlowFilter(name=FlowFilterName(any_=[rsi_lineage.name])))
        old = [d for d in found if d.entrypoint in OLD_ENTRYPOINTS]
        for d in old:
            client.update_deployment(d.id, DeploymentUpdate(entrypoint=entrypoint()))
    return [d.name for d in old]


def supervise(command: list[str], env: dict[str, str], what: str, grace_s: float = STOP_GRACE_S) -> int:
    """Run ``command`` until it exits and return its status; a SIGTERM or Ctrl-C is passed on to it, and if it
    has not stopped ``grace_s`` later (or a second signal comes) it is killed with its process group."""
    # Its own process group, so a kill reaches what it started too (the flow runs of a Prefect worker); a
    # terminal's Ctrl-C reaches only this process, which passes it on.
    child = subprocess.Popen(command, env=env, start_new_session=True)

    def stop(signum: int, frame: Any) -> None:
        raise _Stop(signum)

    # A SIGTERM sent to `rsi worker` alone (kill, a service manager) must stop the Prefect worker too: before
    # this, `kill` on rsi's pid left the worker polling and running flows (seen in the issue 9 acceptance run).
    signal.signal(signal.SIGTERM, stop)
    try:
        return child.wait()
    except (KeyboardInterrupt, _Stop) as exc:
        child.send_signal(signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM)
    try:
        return child.wait(timeout=grace_s)
    except (subprocess.TimeoutExpired, KeyboardInterrupt, _Stop):
        # It did not stop in time (a Prefect worker whose API server is gone retries for minutes), or a second
        # signal came: kill it and its flow runs. A generation cut short resumes from its last finished stage.
        print(f"{what} did not stop within {grace_s:g} s; killing it and its process group", file=sys.stderr)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        return child.wait()


class _Stop(Exception):
    """SIGTERM reached `rsi worker`."""
