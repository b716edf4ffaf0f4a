"""A lineage run's training: a LoRA adapter fitted on a stored selection (warm-started from the champion's),
logged as the generation's MLflow run; or the champion's adapter kept as it is for a candidate harness."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rsi.hashing import digest
from rsi.hcp import Harness
from rsi.lineage import LineageRegistry
from rsi.lineage.record import log_training
from rsi.run.base import Base, stepping
from rsi.run.config import CycleConfig
from rsi.run.results import Champion, Selected, Trained
from rsi.select import Dataset
from rsi.store.leases import Fence
from rsi.train import TrainSpec, train_adapter


class Training:
    def __init__(self, config: CycleConfig, fence: Fence, registry: LineageRegistry, base: Base):
        self.config, self.fence, self.registry, self.base = config, fence, registry, base

    def fit(self, number: int, champ: Champion, selected: Selected, dataset: Dataset, spec: TrainSpec,
            out_dir: Path, warm: bool, harness: Harness | None = None) -> Trained:
        """The adapter trained on ``dataset`` (from the champion's when ``warm``), its MLflow run logged (per
        candidate ``harness`` when a search migrates one). A lost lease stops training at its next step."""
        losses: list[tuple[int, float, float]] = []
        shown = stepping("generation %d: train step %d/%d, loss %.4f", spec.steps, number)

        def on_step(step: int, loss: float, lr: float) -> None:
            self.fence.check()  # a lost lease stops training at once, not after it
            losses.append((step, loss, lr))
            shown(step + 1, loss)

        parent = Path(champ.adapter_dir) if warm and champ.adapter_dir else None
        start = time.perf_counter()
        result = train_adapter(self.base.dir, parent, dataset, spec, out_dir, seed=self.config.seed * 1000 + number,
                               on_step=on_step)
        seconds = time.perf_counter() - start
        run_id = log_training(self.registry, number, selected.digest, dataset.examples, self.params(champ, selected),
                              losses, seconds, harness=harness)
        return Trained(**result.model_dump(), seconds=seconds, mlflow_run_id=run_id,
                       examples_digest=examples_digest(dataset), warm_start=str(parent) if parent else None)

    def keep(self, number: int, champ: Champion, harness: Harness, adapter_hash: str | None) -> Trained:
        """A candidate whose replies look as under the champion's harness (a plan, a decoding knob): the
        champion's adapter as it is, with an MLflow run of its own that the candidate pair is registered from."""
        unchanged = Dataset(examples=())
        nothing = Selected(digest=digest({"unchanged_adapter": adapter_hash}), size=0, corrupted=False, frontier=0,
                           replay=0)
        run_id = log_training(self.registry, number, nothing.digest, (), self.params(champ, nothing), [], 0.0,
                              harness=harness)
        return Trained(adapter_dir=champ.adapter_dir, adapter_hash=adapter_hash, steps=0, first_loss=0.0,
                       final_loss=0.0, examples=0, seconds=0.0, mlflow_run_id=run_id,
                       examples_digest=examples_digest(unchanged), warm_start=champ.adapter_dir)

    def params(self, champ: Champion, selected: Selected) -> dict[str, Any]:
        return ({f"train.{k}": v for k, v in self.config.train.model_dump().items()}
                | {"parent_pair_id": champ.pair_id, "dataset_digest": selected.digest, "dataset_size": selected.size})


def examples_digest(dataset: Dataset) -> str:
    """Digest of exactly the (prompt, completion) texts the trainer consumed, in order."""
    return digest([[e.prompt, e.completion] for e in dataset.examples])
