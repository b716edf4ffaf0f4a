"""A generation in MLflow: its training run (dataset, parameters, loss curve), each candidate pair as a model
version with its evidence (gate, accuracy per level, gain decomposition), the improvement plot, the aliases."""

from __future__ import annotations

import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rsi.decomposition import Decomposition, over_no_training
from rsi.decomposition import metrics as gain_metrics
from rsi.decomposition import rows as gain_rows
from rsi.hcp import Harness
from rsi.lineage import LineageRegistry, plot_improvement

IMPROVEMENT_PLOT = "improvement.png"


def log_training(registry: LineageRegistry, number: int, dataset_digest: str, examples: Sequence[Any],
                 params: dict[str, Any], losses: Sequence[tuple[int, float, float]], seconds: float,
                 harness: Harness | None = None) -> str:
    """The generation's MLflow run, one per (lineage, generation, dataset digest[, candidate harness]): found
    again when a crashed run trains again (a complete one is reused as is; one cut short is deleted and logged
    afresh). ``examples``: what the trainer consumed (``rsi.select.Example``), logged as the run's input."""
    import mlflow
    import pandas as pd
    from mlflow.entities import Metric

    tags = {"lineage": registry.lineage, "generation": str(number), "dataset_digest": dataset_digest}
    if harness is not None:  # a harness search trains one migration per candidate on the same set
        tags |= {"candidate_harness": harness.id, "harness_hash": harness.hash}
    found = registry.find_run(tags)
    if found is not None and "train_seconds" in found.data.metrics:
        return found.info.run_id
    if found is not None:
        registry.client.delete_run(found.info.run_id)
    frame = pd.DataFrame([{"trajectory_id": e.trajectory_id, "level": e.level, "source": e.source,
                           "prompt": e.prompt, "completion": e.completion} for e in examples])
    name = f"gen-{number:03d}" + (f"-{harness.document.version}" if harness is not None else "")
    with registry.start_run(name, tags) as mlrun:
        if examples:  # none: a candidate harness paired with the champion's adapter as it is
            with warnings.catch_warnings():  # MLflow's hint about integer columns: ours never miss values
                warnings.simplefilter("ignore", UserWarning)
                data = mlflow.data.from_pandas(frame, name=f"{registry.lineage}-gen{number}-selected",
                                               digest=dataset_digest[:36])
                mlflow.log_input(data, context="training")
        mlflow.log_params(params)
        now = int(time.time() * 1000)
        metrics = [Metric("train_loss", loss, now, step) for step, loss, _ in losses]
        metrics += [Metric("learning_rate", lr, now, step) for step, _, lr in losses]
        for i in range(0, len(metrics), 900):
            registry.client.log_batch(mlrun.info.run_id, metrics=metrics[i:i + 900])
        mlflow.log_metric("train_seconds", seconds)  # last: its presence marks the run complete
        return mlrun.info.run_id


def log_decomposition(registry: LineageRegistry, run_id: str, decomposition: Decomposition) -> None:
    """Its metrics on the version's run, a table per split (browsable in the MLflow UI) and the whole of it."""
    from mlflow.entities import Metric

    client, now = registry.client, int(time.time() * 1000)
    metrics = [Metric(name, value, now, 0) for name, value in gain_metrics(decomposition).items()]
    for at in range(0, len(metrics), 1000):  # one write per batch, not one per metric (MLflow takes <= 1000)
        client.log_batch(run_id, metrics=metrics[at:at + 1000])
    for split in decomposition.splits:
        table = gain_rows(decomposition, split)
        client.log_table(run_id, {key: [row.get(key) for row in table] for key in table[0]} if table else {},
                         f"decomposition-{split}.json")
    client.log_dict(run_id, decomposition.model_dump(mode="json"), "decomposition.json")


def register_version(registry: LineageRegistry, run_id: str, *, adapter_dir: str | None, harness: Harness,
                     base_dir: Path, base_hash: str, pair_id: str, tags: dict[str, Any],
                     accuracy: dict[int, float], decomposition: Decomposition) -> tuple[str, str]:
    """One candidate pair as an MLflow model version (adapter + harness, base referenced) with the lineage's
    ``tags``, its accuracy per level and its gain decomposition; returns (version, model URI)."""
    from rsi.mlmodel import log_base, log_candidate

    client = registry.client
    if adapter_dir is not None:  # None: the candidate pairs the base itself with its harness
        client.log_artifacts(run_id, adapter_dir, "candidate/adapter")  # browsable beside the model
    client.log_artifacts(run_id, str(harness.folder), "candidate/harness")
    for level, acc in accuracy.items():
        client.log_metric(run_id, f"acc_level_{level}", acc)
    base_uri = log_base(registry, base_dir, base_hash)  # once per base, then referenced
    model_uri = log_candidate(registry, run_id, base_uri, adapter_dir, harness.folder, pair_id=pair_id,
                              base_hash=base_hash)
    tags = tags | {f"acc_level_{level}": f"{acc:.4f}" for level, acc in accuracy.items()}
    log_decomposition(registry, run_id, decomposition)
    if (over := over_no_training(decomposition)) is not None:
        tags["test_over_no_training"] = f"{over:+.4f}"
    return registry.create_version(run_id, model_uri, tags), model_uri


def log_evaluation(registry: LineageRegistry, version: Any, scores: Sequence[Any], *, split: str, k: int,
                   harness_id: str) -> str:
    """An evaluation of a model version (``rsi eval --lineage``; ``scores``: ``rsi.evaluate.LevelScore``): a run of
    its own under the lineage run holding the table (level, accuracy, 95 % interval, correct, n) as
    ``evaluation-<split>.json``, its metrics per level linked to the version's logged model (listed on the model's
    page), and the version tagged ``evaluation_<split>`` with the run's id; returns the run id."""
    from mlflow.entities import Metric

    client, now = registry.client, int(time.time() * 1000)
    what = "acc" if k == 1 else f"pass_at_{k}"
    model_id = logged_model_id(version)
    run = client.create_run(registry.experiment_id, run_name=f"eval-v{version.version}-{split}", tags={
        "rsi.role": "evaluation", "lineage": registry.lineage, "version": str(version.version), "split": split,
        "decoding": "greedy" if k == 1 else f"pass@{k}", "harness_id": harness_id,
        "mlflow.parentRunId": registry.lineage_run_id()})
    run_id = run.info.run_id
    table = {"level": [s.level for s in scores], what: [s.accuracy for s in scores],
             "ci_low": [s.ci_low for s in scores], "ci_high": [s.ci_high for s in scores],
             "correct": [s.correct for s in scores], "n": [s.n for s in scores]}
    client.log_table(run_id, table, f"evaluation-{split}.json")
    metrics = [Metric(f"{split}_{name}_level_{level}", float(value), now, 0, model_id=model_id)
               for name in (what, "ci_low", "ci_high", "n") for level, value in zip(table["level"], table[name])]
    client.log_batch(run_id, metrics=metrics)
    client.set_terminated(run_id)
    client.set_model_version_tag(registry.name, version.version, f"evaluation_{split}", run_id)
    return run_id


def logged_model_id(version: Any) -> str | None:
    """The id of a version's logged model (a SQL registry keeps it only in the version's ``models:/`` source)."""
    if version.model_id:
        return version.model_id
    return version.source.removeprefix("models:/") if version.source.startswith("models:/m-") else None


def log_improvement_plot(registry: LineageRegistry, run_id: str, rows: list[dict[str, Any]]) -> None:
    """The lineage's accuracy per level per generation (``rows``: generation, gate, accuracy) on the generation's
    run ``run_id`` and on the lineage's run (each generation's plot replaces the one before there)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = plot_improvement(rows, Path(tmp) / IMPROVEMENT_PLOT)
        for run in (run_id, registry.lineage_run_id()):
            registry.client.log_artifact(run, str(path))


def improvement_plot(registry: LineageRegistry) -> bytes | None:
    """The lineage run's improvement plot (PNG), None before its first generation is registered."""
    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = registry.client.download_artifacts(registry.lineage_run_id(), IMPROVEMENT_PLOT, tmp)
            return Path(path).read_bytes()
        except (MlflowException, OSError):
            return None


def sync_aliases(registry: LineageRegistry, finished: Sequence[tuple[str, str]]) -> None:
    """Point ``challenger`` at the latest finished generation's version and ``champion`` at the latest promoted
    one; ``finished``: (version, status) of each finished generation in order, as the state DB records them."""
    latest = champion = None
    for version, status in finished:
        latest = version
        champion = version if status == "promoted" else champion
    registry.set_aliases(challenger=latest, champion=champion)


def version_url(registry: LineageRegistry, version: str) -> str:
    """The version's page in the MLflow UI when tracking is a server, else its ``models:/`` URI."""
    if registry.uri.startswith(("http://", "https://")):
        return f"{registry.uri.rstrip('/')}/#/models/{registry.name}/versions/{version}"
    return f"models:/{registry.name}/{version}"
