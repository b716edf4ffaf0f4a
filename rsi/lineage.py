"""The lineage in MLflow: one registered model per lineage, one model version per candidate.

A version's artifacts are the adapter and the HCP document it was judged under; its tags say where it
came from (generation, parent version, pair, harness, contract, base, dataset) and how it fared (gate,
accuracy per level). The alias ``champion`` moves only on promotion; ``challenger`` marks the latest.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rsi.config import Settings

CHAMPION, CHALLENGER = "champion", "challenger"
TAGS = ("generation", "parent_version", "pair_id", "harness_id", "harness_hash", "contract_version",
        "base_model_hash", "dataset_digest", "gate")


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
        """A run in the lineage's experiment (the caller logs metrics, inputs and artifacts into it)."""
        self.mlflow.set_tracking_uri(self.uri)
        return self.mlflow.start_run(experiment_id=self.experiment_id, run_name=run_name, tags=tags)

    def find_run(self, tags: dict[str, str]):
        """The active run of this lineage's experiment carrying all of ``tags`` (None if there is none)."""
        query = " and ".join(f"tags.{k} = '{v}'" for k, v in tags.items())
        hits = self.client.search_runs([self.experiment_id], filter_string=query, max_results=2)
        return hits[0] if hits else None

    def find_version(self, pair_id: str):
        """The version already registered for ``pair_id`` (a rerun after a crash must not register twice)."""
        hits = self.client.search_model_versions(f"name = '{self.name}' and tag.pair_id = '{pair_id}'")
        return hits[0] if hits else None

    def create_version(self, run_id: str, artifact_path: str, tags: dict[str, Any]) -> str:
        """The candidate's model version, created once per pair id (found again on a rerun)."""
        existing = self.find_version(str(tags["pair_id"]))
        if existing is not None:
            return str(existing.version)
        run = self.client.get_run(run_id)
        source = f"{run.info.artifact_uri}/{artifact_path}"
        return str(self.client.create_model_version(
            self.name, source=source, run_id=run_id, tags={k: str(v) for k, v in tags.items()}).version)

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
