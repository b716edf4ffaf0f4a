"""Scheduled runs for real: `rsi stack up` (a Prefect server and an MLflow server), `rsi deploy`, `rsi worker`;
the flow run `<lineage>-gen-001` with its logs and artifacts in the Prefect API; both UIs driven in headless
Chromium (tests marked `browser`, screenshots written to test-output/screenshots); `rsi stack down` leaving no
process behind. One stack and one scheduled generation serve the whole module."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import REPO
from .test_cycle import children, seed_home

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # one real generation, scheduled
SCREENSHOTS = Path(os.environ.get("RSI_TEST_OUTPUT", REPO / "test-output")) / "screenshots"
# the tiny profile with enough training and held-out tasks that generation 1 is promoted on seed 0 (test_cycle's
# PROMOTING), so the registry has a champion alias to show
PROMOTING = ["train.steps=120", "train.batch_size=32", "train.warmup=4", "eval_n=256", "gate.margin=0.1",
             "curriculum.rule=accelerated",
             "curriculum.tasks_per_level=128", "curriculum.lookahead_tasks=32"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class Served:
    """A stack in its own RSI_HOME, and the CLI run against it."""

    def __init__(self, home: Path):
        self.home = home
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RSI_"))} | {"RSI_HOME": str(home)}
        self.stack: dict = {}
        self.run_id = ""

    def rsi(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rsi", *args], capture_output=True, text=True, cwd=REPO,
                              timeout=timeout, env=self.env)

    @property
    def api(self) -> str:
        return self.stack["prefect_api_url"]

    def call(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        """One Prefect API call, retried as Prefect's own client retries: a 503 is the server's word for a busy
        SQLite database (`is_client_retryable_exception`), which a loaded 2-core machine meets."""
        for attempt in range(8):
            reply = httpx.request(method, f"{self.api}{path}", json=body, timeout=30)
            if reply.status_code != 503:
                return reply
            time.sleep(0.5 * 2 ** attempt)
        return reply

    def get(self, path: str) -> dict:
        return self.call("GET", path).json()

    def post(self, path: str, body: dict) -> list | dict:
        return self.call("POST", path, body).json()


@pytest.fixture(scope="module")
def served(tiny_base, tmp_path_factory) -> Iterator[Served]:
    """`rsi stack up`, `rsi deploy climb` (hourly), one run due now, `rsi worker --run-once`."""
    s = Served(tmp_path_factory.mktemp("stack-home"))
    seed_home(s.home, tiny_base)
    up = s.rsi("stack", "up", "--prefect-port", str(free_port()), "--mlflow-port", str(free_port()))
    assert up.returncode == 0, up.stdout + up.stderr
    s.stack = json.loads((s.home / "stack" / "stack.json").read_text())
    try:
        deployed = s.rsi("deploy", "climb", "--family", "addition", "--interval", "3600", "--profile", "tiny",
                         *[arg for item in PROMOTING for arg in ("--set", item)])
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        deployment = s.get("/deployments/name/rsi-lineage/climb")
        # made as before flows/ installed as rsi.flows: `rsi worker` moves it on, and its run goes on
        moved = s.call("PATCH", f"/deployments/{deployment['id']}", {"entrypoint": "flows.cycle.rsi_lineage"})
        assert moved.status_code == 204, moved.text
        s.run_id = s.post(f"/deployments/{deployment['id']}/create_flow_run", {})["id"]  # due now
        worked = s.rsi("worker", "--run-once", timeout=1800)
        assert worked.returncode == 0, worked.stdout[-3000:] + worked.stderr[-3000:]
        assert "deployment rsi-lineage/climb: entrypoint moved to rsi.flows.cycle.rsi_lineage" in worked.stderr
        yield s
    finally:
        s.rsi("stack", "down")


def test_stack_is_healthy_and_rsi_uses_it(served: Served) -> None:
    status = served.rsi("stack", "status")
    assert status.returncode == 0 and all(row["healthy"] for row in json.loads(status.stdout)), status.stdout
    shown = json.loads(served.rsi("config", "show", "--json").stdout)
    assert shown["prefect_api_url"] == served.api
    assert shown["mlflow_tracking_uri"] == served.stack["mlflow_tracking_uri"]


def test_sigterm_to_rsi_worker_stops_its_prefect_worker(served: Served) -> None:
    """`kill <pid of rsi worker>` (a service manager's stop) stops the Prefect worker it started, too."""
    proc = subprocess.Popen([sys.executable, "-m", "rsi", "worker"], cwd=REPO, env=served.env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (kids := children(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert kids, "rsi worker started no Prefect worker"
        time.sleep(5)  # let it start polling
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)  # a generation the worker is running may have to finish first (slow on shared CPUs)
        deadline = time.monotonic() + 60
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any(_alive(k) for k in kids), "the Prefect worker outlived rsi worker"
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_deploy_refuses_bad_schedules(served: Served) -> None:
    bad = served.rsi("deploy", "climb", "--cron", "every two minutes", "--profile", "tiny")
    assert bad.returncode == 2 and "not a cron expression" in bad.stderr and "Traceback" not in bad.stderr
    both = served.rsi("deploy", "climb", "--cron", "*/5 * * * *", "--interval", "60")
    assert both.returncode == 2 and "exactly one schedule" in both.stderr
    typo = served.rsi("deploy", "climb", "--family", "addition", "--interval", "60", "--set", "trian.steps=3")
    assert typo.returncode == 2 and "'trian'" in typo.stderr and "Traceback" not in typo.stderr
    family = served.rsi("deploy", "climb", "--interval", "60")  # the family defaults to the lineage's name
    assert family.returncode == 2 and "climb" in family.stderr and "addition" in family.stderr


def test_deployment_has_schedule_concurrency_and_json_parameters(served: Served) -> None:
    deployment = served.get("/deployments/name/rsi-lineage/climb")
    assert deployment["work_pool_name"] == "rsi" and deployment["entrypoint"] == "rsi.flows.cycle.rsi_lineage"
    assert deployment["global_concurrency_limit"]["limit"] == 1
    assert deployment["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"
    assert deployment["schedules"][0]["schedule"]["interval"] == 3600
    params = deployment["parameters"]
    assert (params["family"], params["lineage"], params["profile"], params["generations"]) == ("addition", "climb", "tiny", 1)
    assert params["overrides"]["train"]["steps"] == 120
    assert deployment["job_variables"]["env"]["RSI_HOME"] == str(served.home)


def test_scheduled_run_is_named_by_generation_with_logs_and_artifacts(served: Served) -> None:
    parent = served.get(f"/flow_runs/{served.run_id}")
    assert parent["state_type"] == "COMPLETED" and parent["name"] == "climb-lineage", parent
    runs = served.post("/flow_runs/filter", {"flow_runs": {"name": {"any_": ["climb-gen-001"]}}})
    assert len(runs) == 1 and runs[0]["state_type"] == "COMPLETED"
    assert runs[0]["parameters"]["number"] == 1 and runs[0]["parameters"]["context"]["config"]["lineage"] == "climb"
    gen_run = runs[0]["id"]
    messages = [e["message"] for e in served.post("/logs/filter", {"logs": {"flow_run_id": {"any_": [gen_run]}}})]
    assert any(m.startswith("generation 1: champion base") for m in messages), messages
    assert any(m.startswith("generation 1: promoted") for m in messages), messages
    artifacts = {a["key"]: a for a in served.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [gen_run]}}})}
    assert artifacts["climb-gen-1"]["type"] == "table" and artifacts["climb-gen-1-summary"]["type"] == "markdown"
    link = artifacts["climb-gen-1-version"]["data"]  # a link artifact: markdown with the version's MLflow page
    assert f"{served.stack['mlflow_tracking_uri']}/#/models/rsi-climb/versions/1" in link, link
    tasks = served.post("/task_runs/filter", {"flow_runs": {"id": {"any_": [gen_run]}}})
    assert {t["name"] for t in tasks} == {f"{s}-gen-001" for s in
                                          ("discover", "execute", "audit", "select", "train", "evaluate", "register")}
    assert all(t["state_type"] == "COMPLETED" for t in tasks)


def test_no_credential_of_a_deployment_reaches_the_prefect_api(served: Served) -> None:
    """`rsi deploy` from a shell whose state DB URL and MLflow URI carry passwords and whose engine key is set:
    no deployment, flow run, variable or block document the Prefect API returns holds any of them; a scheduled
    run reads them back from the Secret block its job variables name (``secret_environment``)."""
    secrets = {"RSI_DATABASE_URL": "postgresql+psycopg://rsi:hunter2-db@127.0.0.1:5432/test",
               "RSI_MLFLOW_TRACKING_URI": "http://rsi:hunter2-ml@127.0.0.1:5999",
               "RSI_ENGINE_API_KEY": "sk-hunter2-engine"}
    env = served.env | secrets | {"RSI_PREFECT_API_URL": served.api}
    deployed = subprocess.run([sys.executable, "-m", "rsi", "deploy", "secretive", "--family", "addition", "--cron",
                               "0 0 1 1 *", "--profile", "tiny"], capture_output=True, text=True, cwd=REPO,
                              timeout=600, env=env)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    deployment = served.get("/deployments/name/rsi-lineage/secretive")
    assert deployment["job_variables"]["env"]["RSI_SECRET_BLOCK"] == "rsi-secretive-env"
    assert deployment["job_variables"]["env"]["RSI_HOME"] == str(served.home)
    returned = [served.post(path, {}) for path in ("/deployments/filter", "/flow_runs/filter", "/variables/filter",
                                                   "/block_documents/filter", "/work_pools/filter")]
    text = json.dumps(returned)
    assert "secretive" in text  # the search sees the new deployment
    for value in ("hunter2", "sk-hunter2-engine", "rsi:hunter2"):
        assert value not in text
    read_back = subprocess.run(
        [sys.executable, "-c", "import json, os; from rsi.flows.runtime import secret_environment; "
         "secret_environment(); print(json.dumps({k: os.environ.get(k) for k in "
         f"{sorted(secrets)!r}}}))"], capture_output=True, text=True, cwd=REPO, timeout=300,
        env=served.env | {"RSI_SECRET_BLOCK": "rsi-secretive-env", "PREFECT_API_URL": served.api})
    assert read_back.returncode == 0, read_back.stderr[-2000:]
    assert json.loads(read_back.stdout.strip().splitlines()[-1]) == secrets


# -- the UIs, seen -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests need playwright (dev extra)")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.fail("the browser tests need Chromium: apt-get install chromium (.ci/run installs it)")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--headless=new", "--no-sandbox"])
        yield browser
        browser.close()


def shoot(page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


@pytest.mark.browser
def test_prefect_ui_shows_the_generation_run_its_logs_artifact_and_the_schedule(served: Served, browser) -> None:
    ui = served.api.removesuffix("/api")
    gen_run = served.post("/flow_runs/filter", {"flow_runs": {"name": {"any_": ["climb-gen-001"]}}})[0]["id"]
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{ui}/runs")
    page.get_by_text("climb-gen-001").first.wait_for(timeout=60_000)
    shoot(page, "prefect-runs")
    page.goto(f"{ui}/runs/flow-run/{gen_run}")
    page.get_by_text("climb-gen-001").first.wait_for(timeout=60_000)
    page.get_by_text("Completed").first.wait_for(timeout=30_000)
    page.get_by_text("generation 1: champion base").first.wait_for(timeout=60_000)  # the Logs tab opens first
    shoot(page, "prefect-flow-run-logs")
    page.get_by_text("Artifacts", exact=True).first.click()
    page.get_by_text("climb-gen-1-version").first.wait_for(timeout=30_000)
    shoot(page, "prefect-flow-run-artifacts")
    page.get_by_text("climb-gen-1", exact=True).first.click()  # the generation's accuracy table
    page.get_by_text("candidate", exact=True).first.wait_for(timeout=30_000)
    page.get_by_text("promoted", exact=True).first.wait_for(timeout=30_000)
    shoot(page, "prefect-generation-table")
    deployment = served.get("/deployments/name/rsi-lineage/climb")
    page.goto(f"{ui}/deployments/deployment/{deployment['id']}")
    page.get_by_text("rsi-lineage", exact=False).first.wait_for(timeout=60_000)
    page.wait_for_timeout(3000)
    shoot(page, "prefect-deployment")
    page.get_by_text("Hourly", exact=True).first.wait_for(timeout=30_000)  # the schedule, as the UI words 3600 s
    page.get_by_text("Concurrency Limit", exact=True).first.wait_for(timeout=30_000)
    page.close()


@pytest.mark.browser
def test_mlflow_ui_shows_the_model_its_champion_alias_and_the_climb(served: Served, browser) -> None:
    ui = served.stack["mlflow_tracking_uri"]
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{ui}/#/models/rsi-climb")
    page.get_by_text("rsi-climb").first.wait_for(timeout=60_000)
    page.get_by_text("@ champion", exact=False).first.wait_for(timeout=60_000)
    shoot(page, "mlflow-registered-model")
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=ui)
    experiment = client.get_experiment_by_name("rsi/climb").experiment_id
    lineage_run = client.search_runs([experiment], "tags.`rsi.role` = 'lineage'")[0].info.run_id
    assert [m.step for m in client.get_metric_history(lineage_run, "acc_level_1")] == [1]
    page.goto(f"{ui}/#/experiments/{experiment}/runs/{lineage_run}/model-metrics")
    page.get_by_text("acc_level_1").first.wait_for(timeout=60_000)  # one chart per level, x = generation
    page.wait_for_timeout(2000)
    shoot(page, "mlflow-lineage-metrics")
    page.close()


def test_champion_loads_as_a_pyfunc_from_the_server_in_a_new_process(served: Served, tmp_path) -> None:
    """Only MLFLOW_TRACKING_URI is set: the model, its adapter and the referenced base come from the server."""
    code = ("import json, mlflow; m = mlflow.pyfunc.load_model('models:/rsi-climb@champion'); "
            "print(json.dumps(m.predict([{'a': 1, 'b': 2}, {'a': 3, 'b': 4}])))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RSI_", "MLFLOW_"))}
    env |= {"MLFLOW_TRACKING_URI": served.stack["mlflow_tracking_uri"], "RSI_HOME": str(tmp_path / "elsewhere")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    predictions = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(predictions) == 2 and all({"completion", "answer"} <= set(p) for p in predictions)
    assert not (tmp_path / "elsewhere").exists()  # nothing was read from or written to a local rsi home


def test_stack_down_leaves_no_process(served: Served) -> None:
    pids = [s["pid"] for s in served.stack["services"]]
    down = served.rsi("stack", "down")
    assert down.returncode == 0 and "stopped prefect, mlflow" in down.stdout, down.stderr
    assert not any(group_alive(pid) for pid in pids), "a server process outlived `rsi stack down`"
    assert served.rsi("stack", "status").returncode == 1
    assert not (served.home / "stack" / "stack.json").exists()
