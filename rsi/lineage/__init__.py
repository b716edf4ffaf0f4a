"""The lineage in MLflow: one registered model per lineage, one model version per candidate.

A version is the candidate's MLflow 3 model (``rsi.mlmodel``: adapter and HCP harness, base referenced);
its tags say where it came from (generation, parent version, pair, harness, contract, base, dataset) and
how it fared (gate, accuracy per level). The alias ``champion`` moves only on promotion; ``challenger``
marks the latest. One lineage run in the experiment is the parent of the generation runs and carries
the per-generation metrics (step = generation), so the MLflow UI charts the climb.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rsi.config import Settings

CHAMPION, CHALLENGER = "champion", "challenger"
LINEAGE_ROLE = {"rsi.role": "lineage"}
TAGS = ("generation", "parent_version", "pair_id", "harness_id", "harness_hash", "parent_harness_hash",
        "contract_version", "base_model_hash", "dataset_digest", "gate")


def model_name(lineage: str) -> str:
    return f"rsi-{lineage}"


class LineageRegistry:
    """MLflow tracking and registry for one lineage."""

    def __init__(self, settings: Settings, lineage: str):
        import mlflow
        from mlflow import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)
        self.mlflow = mlflow
        self.uri = settings.mlflow_uri
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        self.lineage = lineage
        self.name = model_name(lineage)
        self._lineage_run_id: str | None = None
        exp_name = f"rsi/{lineage}"
        exp = self.client.get_experiment_by_name(exp_name)
        if exp is None:
            location = (settings.home / "mlartifacts").as_uri() if self.uri.startswith("sqlite:") else None
            self.experiment_id = self.client.create_experiment(exp_name, artifact_location=location)
        else:
            self.experiment_id = exp.experiment_id
        if not self.client.search_registered_models(filter_string=f"name = '{self.name}'"):
            self.client.create_registered_model(self.name, tags={"lineage": lineage},
                                                description=f"rsi lineage {lineage}: one version per candidate")

    def start_run(self, run_name: str, tags: dict[str, str]):
        """A run in the lineage's experiment, nested under the lineage run (the caller logs metrics, inputs
        and artifacts into it)."""
        self.mlflow.set_tracking_uri(self.uri)
        return self.mlflow.start_run(experiment_id=self.experiment_id, run_name=run_name, tags=tags,
                                     parent_run_id=self.lineage_run_id())

    @contextmanager
    def resumed_run(self, run_id: str) -> Iterator[Any]:
        """Run ``run_id`` as the active run (fluent calls such as ``log_model`` log into it)."""
        self.mlflow.set_tracking_uri(self.uri)
        active = self.mlflow.active_run()
        if active is not None and active.info.run_id == run_id:
            yield active
            return
        with self.mlflow.start_run(run_id=run_id) as run:
            yield run

    def find_run(self, tags: dict[str, str]):
        """The active run of this lineage's experiment carrying all of ``tags`` (None if there is none)."""
        query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        hits = self.client.search_runs([self.experiment_id], filter_string=query, max_results=2)
        return hits[0] if hits else None

    def find_version(self, pair_id: str):
        """The version already registered for ``pair_id`` (a rerun after a crash must not register twice)."""
        hits = self.client.search_model_versions(f"name = '{self.name}' and tag.pair_id = '{pair_id}'")
        return hits[0] if hits else None

    def create_version(self, run_id: str, source: str, tags: dict[str, Any]) -> str:
        """The candidate's model version, created once per pair id (found again on a rerun). ``source`` is
        the logged model's URI (``models:/m-...`` from ``rsi.mlmodel.log_candidate``) or, for a plain
        artifact folder without an MLmodel, its path inside run ``run_id``."""
        existing = self.find_version(str(tags["pair_id"]))
        if existing is not None:
            return str(existing.version)
        model_id = None
        if source.startswith("models:/"):
            model_id = source.removeprefix("models:/")
            # A SQL registry resolves a models:/ source with a client on the global tracking URI.
            self.mlflow.set_tracking_uri(self.uri)
        else:
            source = f"{self.client.get_run(run_id).info.artifact_uri}/{source}"
        return str(self.client.create_model_version(
            self.name, source=source, run_id=run_id, tags={k: str(v) for k, v in tags.items()},
            model_id=model_id).version)

    def lineage_run_id(self) -> str:
        """The lineage's own run (one per lineage, found again by its tag): parent of the generation runs and
        holder of the per-generation metrics."""
        if self._lineage_run_id is None:
            found = self.find_run(LINEAGE_ROLE)
            if found is None:
                found = self.client.create_run(self.experiment_id, run_name=f"lineage-{self.lineage}",
                                               tags=LINEAGE_ROLE | {"lineage": self.lineage})
                self.client.set_terminated(found.info.run_id)  # metrics are logged by id; nothing stays running
            self._lineage_run_id = found.info.run_id
        return self._lineage_run_id

    def log_generation(self, generation: int, metrics: dict[str, float]) -> None:
        """Log a generation's metrics (e.g. ``acc_level_5``, ``gate_p_value``) at ``step=generation`` on the
        lineage run. A rerun of the generation skips (key, step) pairs already logged with the same value; a
        changed value is appended (MLflow keeps every point of a metric's history)."""
        from mlflow.entities import Metric

        run_id, now = self.lineage_run_id(), int(time.time() * 1000)
        fresh = [Metric(key, float(value), now, generation) for key, value in metrics.items()
                 if not any(m.step == generation and m.value == float(value)
                            for m in self.client.get_metric_history(run_id, key))]
        if fresh:
            self.client.log_batch(run_id, metrics=fresh)

    def set_aliases(self, *, challenger: str | None, champion: str | None) -> None:
        """Point the aliases at these versions (None removes the alias)."""
        for alias, version in ((CHALLENGER, challenger), (CHAMPION, champion)):
            if version is not None:
                self.client.set_registered_model_alias(self.name, alias, version)
            elif self.alias(alias) is not None:
                self.client.delete_registered_model_alias(self.name, alias)

    def alias(self, alias: str):
        try:
            return self.client.get_model_version_by_alias(self.name, alias)
        except Exception:
            return None

    def versions(self) -> list:
        found = self.client.search_model_versions(f"name = '{self.name}'")
        return sorted(found, key=lambda v: int(v.version))

    def decomposition(self, version) -> Any:
        """The version's gain decomposition (``rsi.decomposition``) as its run holds it; None for a version
        registered before rsi decomposed gains."""
        import json
        import tempfile

        from mlflow.exceptions import MlflowException

        from rsi.decomposition import Decomposition

        with tempfile.TemporaryDirectory() as tmp:
            try:  # through this registry's client: the process's default tracking URI may be another store
                path = self.client.download_artifacts(version.run_id, "decomposition.json", tmp)
            except (MlflowException, OSError):
                return None
            return Decomposition.model_validate(json.loads(Path(path).read_text(encoding="utf-8")))


def plot_improvement(rows: list[dict[str, Any]], path: Path) -> Path:
    """Accuracy per level per generation, one line per generation (the lineage's improvement plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for row in rows:
        levels = sorted(row["accuracy"])
        ax.plot(levels, [row["accuracy"][lvl] for lvl in levels], marker="o",
                label=f"gen {row['generation']} ({row['gate']})")
    ax.set_xlabel("level (digits)")
    ax.set_ylabel("greedy accuracy (held-out)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
