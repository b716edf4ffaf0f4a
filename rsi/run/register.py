"""A lineage run's MLflow record: each judged candidate as a model version with its evidence, the per-generation
metrics and improvement plot, and the aliases following what the state DB committed (``rsi.lineage.record``
makes the MLflow calls)."""

from __future__ import annotations

from typing import Any

from rsi.curriculum import CurriculumSpec, frontier
from rsi.lineage import LineageRegistry
from rsi.lineage.record import log_improvement_plot, register_version, sync_aliases
from rsi.run.base import Base
from rsi.run.config import CycleConfig
from rsi.run.harnesses import Harnesses
from rsi.run.judge import Judge
from rsi.run.results import Champion, Judged, Trained
from rsi.run.scores import Scores
from rsi.store.ledger import Ledger


class Registrar:
    def __init__(self, registry: LineageRegistry, ledger: Ledger, harnesses: Harnesses, base: Base, judge: Judge):
        self.registry, self.ledger, self.harnesses, self.base, self.judge = registry, ledger, harnesses, base, judge

    def candidate(self, number: int, champ: Champion, dataset_digest: str, trained: Trained, judged: Judged,
                  why: str = "", adopted: bool = True, made_by: tuple[str, str, str] = ("", "", "")) -> tuple[str, str]:
        """One candidate pair as an MLflow model version (adapter + harness, base referenced) with the lineage's
        tags, its evidence and its gain decomposition; returns (version, model URI). ``why``: a candidate
        harness's reason to exist; ``adopted`` False: a searched candidate not taken (rejected, or passed the
        gate while another won)."""
        harness = self.harnesses.of(self.ledger.load_pair(judged.candidate_pair_id))  # a successor may carry another
        promote = judged.decision.promote and adopted
        tags: dict[str, Any] = {
            "generation": number, "parent_version": champ.version, "pair_id": judged.candidate_pair_id,
            "harness_id": harness.id, "harness_hash": harness.hash, "parent_harness_hash": champ.harness_hash,
            "contract_version": harness.contract_version, "base_model_hash": self.base.hash,
            "dataset_digest": dataset_digest, "gate": "promoted" if promote else "rejected",
            "adapter_hash": trained.adapter_hash, "gate_p_value": f"{judged.decision.p_value:.4g}",
            "gate_reasons": "; ".join(judged.decision.reasons)[:4000]}
        if why:
            tags["harness_candidate"] = why
            operator, cause, drawn_from = made_by  # the archive's edge: the operator, the failure cause, the parent
            tags |= {"harness_operator": operator, "harness_cause": cause,
                     "harness_drawn_from": drawn_from} if operator else {}
        if judged.decision.promote and not adopted:
            tags["gate_note"] = "passed the gate; another candidate of the search scored higher and was adopted"
        decomposition = self.judge.decompose(number, champ, trained.adapter_dir, judged)
        return register_version(self.registry, trained.mlflow_run_id, adapter_dir=trained.adapter_dir,
                                harness=harness, base_dir=self.base.dir, base_hash=self.base.hash,
                                pair_id=judged.candidate_pair_id, tags=tags, accuracy=judged.candidate,
                                decomposition=decomposition)

    def generation(self, number: int, judged: Judged, run_id: str) -> None:
        """The generation's metrics on the lineage's run (step = generation) and the improvement plot with it."""
        decision, gate = judged.decision, "promoted" if judged.decision.promote else "rejected"
        self.registry.log_generation(number, {f"acc_level_{level}": acc for level, acc in judged.candidate.items()}
                                     | {"gate_p_value": decision.p_value, "gate_wins": decision.wins,
                                        "gate_losses": decision.losses, "promoted": float(decision.promote)})
        rows = [r for r in self.rows() if r["generation"] != number]  # this one is not committed yet
        rows.append({"generation": number, "gate": gate, "accuracy": dict(judged.candidate)})
        log_improvement_plot(self.registry, run_id, rows)

    def rows(self) -> list[dict[str, Any]]:
        """One row per finished generation: gate decision and candidate accuracy per level."""
        rows = []
        for g in self.ledger.finished():
            judged, registered = self.ledger.result(g, "evaluate"), self.ledger.result(g, "register")
            rows.append({"generation": g.number, "gate": g.status, "version": registered.version,
                         "accuracy": dict(judged.candidate), "parent": dict(judged.parent)})
        return rows

    def sync_aliases(self) -> None:
        """``challenger`` at the latest finished generation's version, ``champion`` at the latest promoted one, as
        the state DB records them (idempotent; run after every register and when a lineage run starts)."""
        sync_aliases(self.registry, [(self.ledger.result(g, "register").version, g.status)
                                     for g in self.ledger.finished()])


def mastered_up_to(ledger: Ledger, scores: Scores, base_levels: tuple[int, ...], curriculum: CurriculumSpec) -> int:
    """Every level up to this one is mastered by the champion: its held-out scores as stored, whether its gate
    or a later discovery measured them (a harness that poses longer tasks is measured there)."""
    promoted = [g for g in ledger.finished() if g.status == "promoted"]
    if not promoted:
        return max(base_levels)
    pair_id = promoted[-1].candidate_pair_id
    stored = scores.stored([pair_id], list(range(1, curriculum.max_level + 1)), "heldout").get(pair_id, {})
    return frontier({lvl: sc.accuracy for lvl, sc in stored.items()}, curriculum.mastery)


def done_reason(config: CycleConfig, mastered: int, rejected_in_a_row: int) -> str | None:
    """Why the lineage stops after a generation: its target level mastered, or a plateau of rejections."""
    if mastered >= config.target_level:
        return f"every level up to {config.target_level} mastered"
    if rejected_in_a_row >= config.plateau:
        return f"{rejected_in_a_row} candidates rejected in a row (plateau)"
    return None
