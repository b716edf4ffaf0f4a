"""Lineage versions as MLflow 3 models, with real MLflow (SQLite), PEFT and torch on a tiny rsi base.

A candidate registered as ``rsi-<lineage>`` loads by alias in a fresh process that knows only the tracking
URI, and predicts what the hf backend predicts in-process for the same pair.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rsi.config import Settings
from rsi.hcp import load_harness, resolve_harness
from rsi.lineage import LineageRegistry

HARNESS = "addition/v2"
PAYLOADS = [{"a": 1, "b": 2}, {"a": 12, "b": 34}, {"a": 305, "b": 17}, {"a": 8, "b": 9}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny rsi base (60 steps: it writes digits, not sums) and a LoRA trained on it hard enough to change
    its greedy replies (so a pair served without its adapter would show)."""
    from rsi.basemodel import BaseRecipe, train_base
    from rsi.parsers import digits_lsb
    from rsi.select import Dataset, Example
    from rsi.tasks import get_family
    from rsi.train import TrainSpec, train_adapter

    root = tmp_path_factory.mktemp("pair")
    recipe = BaseRecipe(steps=60, warmup=5, lr=5e-3, batch_size=32, d_model=64, n_heads=2, intermediate_size=128,
                        train_levels=(1, 2), level_weights=(1.0, 1.0))
    train_base(recipe, root / "base", eval_n=8)
    harness = load_harness(HARNESS)
    tasks = get_family("addition").tasks("train", 0, 2, 16)
    examples = tuple(Example(trajectory_id=t.id, level=t.level, prompt=harness.prompt(t.payload),
                             completion=digits_lsb(t.answer, 11), source="frontier") for t in tasks)
    spec = TrainSpec(steps=8, batch_size=8, lr=3e-2, warmup=0, lora_r=8, lora_alpha=32)
    train_adapter(root / "base", None, Dataset(examples=examples), spec, root / "adapter", seed=0)
    return {"base": root / "base", "adapter": root / "adapter", "recipe": recipe}


@pytest.fixture(scope="module")
def lineage(pair: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Base logged, two candidates (the adapter pair and the base pair) logged and registered; champion set."""
    from rsi.basemodel import model_hash
    from rsi.mlmodel import log_base, log_candidate
    from rsi.models import Pair
    from rsi.train import adapter_hash

    settings = Settings(home=tmp_path_factory.mktemp("home"))
    registry = LineageRegistry(settings, "mm")
    base_hash = model_hash(pair["base"])
    harness_dir, harness = resolve_harness(HARNESS), load_harness(HARNESS)
    uris, versions, run_ids, pair_ids = [], [], [], []
    for generation, adapter in ((1, pair["adapter"]), (2, None)):
        base_uri = log_base(registry, pair["base"], base_hash)
        with registry.start_run(f"gen-{generation:03d}", {"lineage": "mm", "generation": str(generation)}) as run:
            run_id = run.info.run_id
        pair_id = Pair(base_model_hash=base_hash, adapter_hash=adapter_hash(adapter) if adapter else None,
                       harness_id=harness.id, harness_hash=harness.hash).id
        pair_ids.append(pair_id)
        uri = log_candidate(registry, run_id, base_uri, adapter, harness_dir, pair_id=pair_id, base_hash=base_hash)
        tags = {"generation": generation, "pair_id": pair_id, "base_model_hash": base_hash, "gate": "promoted"}
        uris.append(uri)
        run_ids.append(run_id)
        versions.append(registry.create_version(run_id, uri, tags))
    registry.set_aliases(challenger=versions[1], champion=versions[0])
    return {"settings": settings, "registry": registry, "base_uri": base_uri, "base_hash": base_hash,
            "uris": uris, "versions": versions, "run_ids": run_ids, "pair_ids": pair_ids}


def hf_predictions(base: Path, adapter: Path | None, prompts: list[str]) -> list[tuple[str, Any]]:
    """(completion, parsed answer) per prompt from the hf backend in this process: the cycle's own path."""
    from rsi.backends import get_backend
    from rsi.pair import sampling_params
    from rsi.parsers import get_parser

    harness = load_harness(HARNESS)
    backend = get_backend("hf", model_dir=base)
    outputs = backend.generate(prompts, sampling_params(harness, seed=0, greedy=True),
                               adapter=str(adapter) if adapter else None)
    backend.close()
    answer = harness.document.answer
    parsed = [get_parser(answer.parser)(out[0].text, **answer.params) for out in outputs]
    return [(out[0].text, p.value if p.ok else None) for out, p in zip(outputs, parsed, strict=True)]


LOAD_AND_PREDICT = """
import json, sys
import mlflow
import pandas as pd
payloads = json.loads(sys.argv[2])
model = mlflow.pyfunc.load_model(sys.argv[1])
prompts = [p["prompt"] for p in model.predict(payloads)]
try:
    bare = model.predict(prompts)  # bare strings: the signature drops them
except Exception as exc:
    bare = str(exc)
print(json.dumps({"payloads": model.predict(payloads), "prompts": model.predict([{"prompt": p} for p in prompts]),
                  "frame": model.predict(pd.DataFrame(payloads)),
                  "prompt_frame": model.predict(pd.DataFrame({"prompt": prompts})), "bare": bare}))
"""


@pytest.mark.slow
def test_champion_loads_in_a_fresh_process_and_predicts_like_the_hf_backend(pair, lineage, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RSI_", "MLFLOW_"))}
    env |= {"MLFLOW_TRACKING_URI": lineage["settings"].mlflow_uri, "RSI_HOME": str(tmp_path / "elsewhere")}
    done = subprocess.run([sys.executable, "-c", LOAD_AND_PREDICT, "models:/rsi-mm@champion", json.dumps(PAYLOADS)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    harness = load_harness(HARNESS)
    prompts = [harness.prompt(p) for p in PAYLOADS]
    expected = hf_predictions(pair["base"], pair["adapter"], prompts)
    for key in ("payloads", "prompts", "frame", "prompt_frame"):
        assert [p["prompt"] for p in got[key]] == prompts, key
        assert [(p["completion"], p["answer"]) for p in got[key]] == expected, key
    assert "no payload field and no prompt" in got["bare"], got["bare"]  # an error that says how, not []
    assert all(completion for completion, _ in expected)  # the base writes something for it to be a check
    assert expected != hf_predictions(pair["base"], None, prompts)  # and the champion's adapter is in use


def uv_indexes() -> dict[str, str]:
    """pip's configured indexes as uv's settings (uv reads no pip.conf): where the pinned CPU torch wheel lies."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    config = {line.partition("=")[0].rsplit(".", 1)[-1]: line.partition("=")[2].strip("'")
              for line in listed.splitlines()}
    env = {"UV_INDEX_STRATEGY": "unsafe-best-match", "UV_PYTHON_DOWNLOADS": "never"}  # pip's rule: best version
    for pip_key, uv_key in (("index-url", "UV_INDEX_URL"), ("extra-index-url", "UV_EXTRA_INDEX_URL"),
                            ("find-links", "UV_FIND_LINKS")):
        if config.get(pip_key):
            env[uv_key] = config[pip_key] if uv_key != "UV_FIND_LINKS" else ",".join(config[pip_key].split())
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_champion_is_served_by_mlflow_from_an_environment_built_without_the_checkout(pair, lineage, tmp_path) -> None:
    """`mlflow models serve -m models:/rsi-mm@champion --env-manager uv` builds a fresh environment from the
    model's own requirements (rsi's wheel from the model's artifacts, torch's CPU build pinned) and answers 50
    plain payloads of levels 1-10 (the family's test tasks) over HTTP as the pair answers in this process."""
    import httpx

    from rsi.tasks import get_family

    bin_dir = Path(sys.executable).parent  # uv is a dev dependency: it lies beside this Python
    if shutil.which("uv", path=f"{bin_dir}{os.pathsep}{os.environ['PATH']}") is None:
        pytest.fail("uv is missing: pip install uv (rsi's dev extra has it)")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RSI_", "MLFLOW_")) and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= uv_indexes() | {"PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "RSI_HOME": str(tmp_path / "elsewhere"),
                           "MLFLOW_TRACKING_URI": lineage["settings"].mlflow_uri,
                           "MLFLOW_ENV_ROOT": str(tmp_path / "envs")}  # fresh: no environment built before
    port, log = free_port(), tmp_path / "serve.log"
    tasks = [t for level in range(1, 11) for t in get_family("addition").tasks("test", 0, level, 5)]
    start = time.monotonic()
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", "models:/rsi-mm@champion",
                                   "--env-manager", "uv", "-h", "127.0.0.1", "-p", str(port)],
                                  env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while not _pings(port):
            assert server.poll() is None, log.read_text()[-5000:]
            assert time.monotonic() - start < 600, f"not serving after 600 s:\n{log.read_text()[-5000:]}"
            time.sleep(2)
        print(f"environment built and model served in {time.monotonic() - start:.0f} s")
        reply = httpx.post(f"http://127.0.0.1:{port}/invocations", json={"inputs": [t.payload for t in tasks]},
                           timeout=300)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    assert reply.status_code == 200, reply.text[-3000:]
    served = reply.json()["predictions"]
    harness = load_harness(HARNESS)
    expected = hf_predictions(pair["base"], pair["adapter"], [harness.prompt(t.payload) for t in tasks])
    assert [(p["completion"], p["answer"]) for p in served] == expected
    (site,) = (tmp_path / "envs").glob("*/lib/python*/site-packages")  # rsi from the model's wheel, CPU torch
    assert (site / "rsi" / "__init__.py").is_file() and not list(site.glob("__editable__*"))
    assert list(site.glob("torch-*+cpu.dist-info")), sorted(p.name for p in site.glob("torch-*"))


def _pings(port: int) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/ping", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
def test_base_is_logged_once_and_referenced_not_copied(lineage, tmp_path: Path) -> None:
    import mlflow

    from rsi.mlmodel import log_base

    registry = lineage["registry"]
    bases = registry.client.search_runs([registry.experiment_id], "tags.`rsi.role` = 'base'")
    assert [f"runs:/{r.info.run_id}/base" for r in bases] == [lineage["base_uri"]]
    assert log_base(registry, Path("/nonexistent"), lineage["base_hash"]) == lineage["base_uri"]  # found, not logged
    for i, uri in enumerate(lineage["uris"]):
        local = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / str(i))))
        files = sorted(f.name for f in local.rglob("*") if f.is_file())
        assert "MLmodel" in files and "hcp.toml" in files and "model.safetensors" not in files, files
        config = mlflow.models.Model.load(str(local)).flavors["python_function"]["config"]
        assert config == {"base_uri": lineage["base_uri"], "base_model_hash": lineage["base_hash"]}


@pytest.mark.slow
def test_logged_adapter_names_no_local_path_and_is_the_same_adapter(pair, lineage, tmp_path: Path) -> None:
    import mlflow

    from rsi.train import adapter_hash

    local = Path(mlflow.artifacts.download_artifacts(lineage["uris"][0], dst_path=str(tmp_path))) / "artifacts/adapter"
    config = json.loads((local / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == lineage["base_uri"]
    assert str(pair["base"]) not in json.dumps(config)
    assert adapter_hash(local) == adapter_hash(pair["adapter"])


@pytest.mark.slow
def test_versions_are_registered_from_the_model_uri_once_per_pair(pair, lineage) -> None:
    from rsi.mlmodel import log_candidate

    registry = lineage["registry"]
    logged = log_candidate(registry, lineage["run_ids"][0], lineage["base_uri"], pair["adapter"],
                           resolve_harness(HARNESS), pair_id=lineage["pair_ids"][0], base_hash=lineage["base_hash"])
    assert logged == lineage["uris"][0]  # a rerun finds the pair's model instead of logging it again
    versions = registry.versions()
    assert [v.source for v in versions] == lineage["uris"]
    assert [v.run_id for v in versions] == lineage["run_ids"]
    assert versions[0].tags["pair_id"] == lineage["pair_ids"][0] and versions[0].tags["gate"] == "promoted"
    again = registry.create_version(lineage["run_ids"][0], lineage["uris"][0], {"pair_id": lineage["pair_ids"][0]})
    assert again == lineage["versions"][0] and len(registry.versions()) == 2
    assert registry.alias("champion").version == versions[0].version


def champion_in_state_db(pair: dict[str, Any], lineage: dict[str, Any]) -> None:
    """The state DB rows `rsi eval --lineage mm` reads (generation 1 promoted with the fixture's adapter, the spec
    naming the fixture's base recipe) and that base where `rsi eval` looks for it (RSI_HOME/models)."""
    from rsi.basemodel import base_dir_for
    from rsi.run import load_config
    from rsi.store import open_store
    from rsi.store.harnesses import lock_harness
    from rsi.store.schema import Generation, Lineage, PairRow
    from rsi.train import adapter_hash

    settings, harness, pair_id = lineage["settings"], load_harness(HARNESS), lineage["pair_ids"][0]
    shutil.copytree(pair["base"], base_dir_for(settings, pair["recipe"]), dirs_exist_ok=True)
    spec = load_config("tiny", family="addition", lineage="mm", harness=HARNESS).model_dump(mode="json")
    store = open_store(settings.db_url)
    with store.session() as s:
        lock_harness(s, harness)
        spec |= {"base_recipe": pair["recipe"].model_dump(mode="json")}
        s.merge(Lineage(name="mm", family="addition", spec=spec))
        s.merge(PairRow(id=pair_id, lineage="mm", base_model_hash=lineage["base_hash"],
                        adapter_hash=adapter_hash(pair["adapter"]), adapter_uri=str(pair["adapter"]),
                        harness_id=harness.id, harness_hash=harness.hash))
        s.add(Generation(lineage="mm", number=1, candidate_pair_id=pair_id, status="promoted"))
    store.dispose()


@pytest.mark.slow
def test_eval_of_a_lineage_logs_its_table_to_the_champion_version(pair, lineage, monkeypatch) -> None:
    """`rsi eval --lineage mm` logs what it prints to the champion's MLflow version: an evaluation run holding the
    table, accuracy and interval per level as metrics of the version's logged model, the version tagged with the
    run. Progress shows level by level on a terminal; a pipe gets the table alone."""
    import io

    import mlflow
    from rich.console import Console
    from typer.testing import CliRunner

    from rsi import cli

    settings, registry = lineage["settings"], lineage["registry"]
    monkeypatch.setenv("RSI_HOME", str(settings.home))
    champion_in_state_db(pair, lineage)
    done = CliRunner().invoke(cli.app, ["eval", "--lineage", "mm", "--levels", "1-3", "--n", "6"])
    assert done.exit_code == 0, done.output
    printed = [[cell.strip() for cell in line.split("│")[1:-1]] for line in done.output.splitlines()
               if line.startswith("│") and line.split("│")[1].strip().isdigit()]
    assert [row[0] for row in printed] == ["1", "2", "3"] and ": level" not in done.output, done.output

    version = registry.client.get_model_version(registry.name, lineage["versions"][0])
    mlflow.set_tracking_uri(settings.mlflow_uri)  # load_table searches runs through the fluent API
    table = registry.client.load_table(registry.experiment_id, "evaluation-test.json",
                                       run_ids=[version.tags["evaluation_test"]])
    assert [[str(r.level), f"{r.acc:.3f}", f"[{r.ci_low:.3f}, {r.ci_high:.3f}]", f"{r.correct}/{r.n}"]
            for r in table.itertuples()] == printed
    model_id = lineage["uris"][0].removeprefix("models:/")  # the champion's logged model
    metrics = {m.key: m.value for m in registry.client.get_logged_model(model_id).metrics}
    for r in table.itertuples():
        assert [metrics[f"test_{name}_level_{r.level}"] for name in ("acc", "ci_low", "ci_high", "n")] == \
            pytest.approx([r.acc, r.ci_low, r.ci_high, r.n], rel=1e-9)  # the table's JSON keeps 10 digits

    screen = io.StringIO()  # a terminal: progress level by level
    monkeypatch.setattr(cli, "out", Console(file=screen, force_terminal=True, width=120))
    assert CliRunner().invoke(cli.app, ["eval", "--lineage", "mm", "--levels", "1-2", "--n", "2"]).exit_code == 0
    assert "under addition/v2: level 2" in screen.getvalue(), screen.getvalue()


def test_lineage_run_charts_generations_and_parents_their_runs(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home")
    registry = LineageRegistry(settings, "charts")
    registry.log_generation(1, {"acc_level_5": 0.25, "gate_p_value": 0.5, "gate_wins": 3.0})
    registry.log_generation(2, {"acc_level_5": 0.75, "gate_p_value": 0.01, "gate_wins": 9.0})
    again = LineageRegistry(settings, "charts")  # a rerun of generation 2 in a new process
    again.log_generation(2, {"acc_level_5": 0.75, "gate_p_value": 0.01, "gate_wins": 9.0})
    assert again.lineage_run_id() == registry.lineage_run_id()
    history = registry.client.get_metric_history(registry.lineage_run_id(), "acc_level_5")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.75)]
    with again.start_run("gen-003", {"generation": "3"}) as run:
        pass
    assert run.data.tags["mlflow.parentRunId"] == registry.lineage_run_id()
    assert len(registry.client.search_runs([registry.experiment_id], "tags.`rsi.role` = 'lineage'")) == 1


@pytest.mark.slow
def test_improvement_plot_is_on_the_lineage_run_and_a_prefect_artifact(tmp_path: Path, prefect_api) -> None:
    import base64

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from rsi.flows.artifacts import publish_improvement
    from rsi.lineage.record import improvement_plot, log_improvement_plot

    registry = LineageRegistry(Settings(home=tmp_path / "home"), "plots")
    assert improvement_plot(registry) is None
    with registry.start_run("gen-001", {"generation": "1"}) as run:
        pass
    log_improvement_plot(registry, run.info.run_id, [{"generation": 1, "gate": "promoted", "accuracy": {1: 1.0}}])
    for run_id in (run.info.run_id, registry.lineage_run_id()):
        assert "improvement.png" in {f.path for f in registry.client.list_artifacts(run_id)}
    plot = improvement_plot(registry)
    assert plot is not None and plot.startswith(b"\x89PNG")
    from prefect import flow

    @flow(name="publish-improvement")
    def publish() -> None:  # as the cycle flow publishes it, inside a flow run
        publish_improvement("plots", registry, 1)

    publish()
    with get_client(sync_client=True) as client:
        key = ArtifactFilter(key=ArtifactFilterKey(any_=["plots-improvement"]))
        (artifact,) = client.read_artifacts(artifact_filter=key)
    assert artifact.type == "image" and artifact.data == f"data:image/png;base64,{base64.b64encode(plot).decode()}"
