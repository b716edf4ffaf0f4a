"""What a generation's stages hand each other, store in the state DB and read back validated: the champion a
generation starts from, one frozen result per stage, and the generation's summary."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rsi.curriculum import LevelPlan
from rsi.decomposition import Decomposition
from rsi.errors import RuntimeFailure
from rsi.gate import GateDecision
from rsi.train import TrainResult


class Champion(BaseModel):
    """The pair a generation starts from: the base (no adapter) or the latest promoted candidate."""

    model_config = ConfigDict(frozen=True)

    pair_id: str
    adapter_dir: str | None
    version: str  # MLflow model version, or "base"
    generation: int
    harness_id: str  # the pair's harness: a successor pair may carry another one than its parent
    harness_hash: str


# --------------------------------------------------------------------------------------------------------
# Stage results: what each stage stores in the state DB and hands to the next, validated when read back
# --------------------------------------------------------------------------------------------------------
class StageResult(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Proposal(BaseModel):
    """One proposal: the proposer's trajectory, what it wrote, its verdict (the first rule it failed, None when
    accepted), and for an accepted one the solver's task it became (in the canonical program's level)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trajectory_id: str
    text: str
    rejected_by: str | None
    detail: str = ""
    task_id: str | None = None
    level: int | None = None
    key: str | None = Field(None, description="what makes two proposals one task (rsi.run.proposals.key_of)")


class Proposed(StageResult):
    """The pair's proposals under the proposer harness, each audited, and the tasks the accepted ones became
    (what execute runs instead of the generator's): part of the discover stage's result."""

    proposer_pair_id: str
    proposals: tuple[Proposal, ...]
    task_ids: tuple[str, ...]
    rejected_by_rule: dict[str, int]
    seconds: float


class TrafficTurn(StageResult):
    trajectory_id: str
    task_id: str
    level: int
    conversation_id: str
    position: int = Field(description="the assistant message's position in the conversation")


class Traffic(StageResult):
    """Served turns harvested as this generation's experience (``rsi.mol.harvest``): each one's trajectory is the
    model's own reply as the proxy recorded it, stored with its conversation; part of the discover stage's
    result. The audit stage judges them (its result counts the turns that passed)."""

    pair_id: str = Field(description="the champion pair whose turns were harvested")
    specialists: tuple[str, ...]
    turns: tuple[TrafficTurn, ...]
    skipped: dict[str, int] = Field(description="turns not harvested, by why")
    seconds: float


class Discovered(StageResult):
    accuracy: dict[int, float] = Field(description="the champion's held-out greedy accuracy per level")
    frontier: int = Field(description="every level up to this one is mastered")
    plan: tuple[LevelPlan, ...]
    task_ids: tuple[str, ...]
    frontier_levels: tuple[int, ...]
    replay_levels: tuple[int, ...]
    unposable: dict[int, int] = Field(default_factory=dict, description=(
        "levels the curriculum wanted that the champion's harness cannot pose -> tasks it wanted there"))
    proposed: Proposed | None = Field(None, description="the pair's proposals (None: the generator's tasks)")
    traffic: Traffic | None = Field(None, description="served turns harvested (None: tasks are rolled out)")


class Executed(StageResult):
    trajectories: int
    tasks: int
    seconds: float
    ids: tuple[str, ...]


class Audited(StageResult):
    audited: int
    passed: int
    failed_by_rule: dict[str, int]
    pass_rates: dict[int, dict[str, float]] = Field(description="per level: pass@1, pass@k and the task count")
    attribution: dict[str, int] = Field(default_factory=dict, description=(
        "failed or unposed tasks per cause (rsi.attribution; rows in rsi_attributions)"))


class Selected(StageResult):
    digest: str
    size: int
    corrupted: bool
    frontier: int
    replay: int


class Trained(TrainResult, StageResult):
    seconds: float
    mlflow_run_id: str
    examples_digest: str
    warm_start: str | None


class Judged(StageResult):
    candidate_pair_id: str
    levels: tuple[int, ...]
    decision: GateDecision
    candidate: dict[int, float]
    parent: dict[int, float]


class Registered(StageResult):
    version: str
    promoted: bool
    model_uri: str | None = None
    others: dict[str, str] = Field(default_factory=dict, description="harness search: the other candidates' "
                                   "pair ids -> their (rejected) model versions")


class HarnessCandidate(BaseModel):
    """One candidate harness, paired with the champion's adapter (migrated when its format differs), judged."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    harness_id: str
    harness_hash: str
    why: str
    trained: Trained | None = Field(description=(
        "the migration, or the champion's adapter unchanged (0 steps) when replies look as under the champion's "
        "harness; None in results stored before rsi paired such candidates"))
    judged: Judged
    operator: str = Field("", description="the proposer that made it ('' in results stored before rsi kept it)")
    cause: str = Field("", description="the failure cause it answers ('' for a proposer that reads only the space)")
    screen: dict[int, float] = Field(default_factory=dict, description="its screen accuracy per level")


class Screened(BaseModel):
    """A candidate the screen did not send to the gate: kept in the archive with its scores, to be tried again."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    harness_id: str
    harness_hash: str
    why: str
    operator: str
    cause: str
    screen: dict[int, float]


class Searched(StageResult):
    parent_harness: str
    dataset: str = Field(description="digest of the migration set: the lineage's verified trajectories")
    size: int
    candidates: tuple[HarnessCandidate, ...] = Field(description="the candidates the full gate judged")
    adopted: int | None = Field(description="index of the candidate the gate promotes, if any")
    parent_hash: str = Field("", description="the parent harness's hash ('' in results stored before the archive)")
    champion: str = Field("", description="the champion pair whose adapter the candidates carry")
    evidence: dict[str, int] = Field(default_factory=dict, description="the parent's probe: failed samples per cause")
    parent_screen: dict[int, float] = Field(default_factory=dict, description="the parent's screen accuracy")
    screened: tuple[Screened, ...] = Field((), description="candidates screened out before the gate")


STAGE_RESULTS: dict[str, type[BaseModel]] = {
    "discover": Discovered, "execute": Executed, "audit": Audited, "select": Selected, "train": Trained,
    "evaluate": Judged, "register": Registered, "search": Searched, "decompose": Decomposition,
}


def counts(result: Any) -> str:
    """A stage result's counts in a few words (``rsi run`` prints one line per stage with them)."""
    if isinstance(result, Discovered):
        levels = sorted({p.level for p in result.plan})
        said = [f"{len(result.task_ids)} tasks at levels {levels[0]}-{levels[-1]}" if levels else "no level to train",
                f"mastered up to level {result.frontier}"]
        if result.traffic is not None:
            said.append(f"{len(result.traffic.turns)} served turns harvested")
        if result.proposed is not None:
            said.append(f"{len(result.proposed.task_ids)} of {len(result.proposed.proposals)} proposals accepted")
        return ", ".join(said)
    if isinstance(result, Executed):
        return f"{result.trajectories} trajectories of {result.tasks} tasks"
    if isinstance(result, Audited):
        return f"{result.audited} trajectories audited, {result.passed} passed"
    if isinstance(result, Selected):
        return f"{result.size} training examples"
    if isinstance(result, Trained):
        return f"{result.steps} train steps, loss {result.first_loss:.4f} -> {result.final_loss:.4f}"
    if isinstance(result, Judged):
        return f"{'promote' if result.decision.promote else 'reject'} (p={result.decision.p_value:.3g})"
    if isinstance(result, Registered):
        return f"version {result.version}{', promoted' if result.promoted else ''}"
    if isinstance(result, Searched):
        return (f"{len(result.candidates) + len(result.screened)} candidate harnesses, {len(result.candidates)} "
                f"judged, {'one adopted' if result.adopted is not None else 'none adopted'}")
    return ""


def read_result(stage: str, generation: int, stored: dict[str, Any]) -> StageResult:
    """A stored stage result, validated against this version's schema (a mismatch is named, not guessed at)."""
    from pydantic import ValidationError

    try:
        return STAGE_RESULTS[stage].model_validate(stored)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(root)"
        raise RuntimeFailure(f"the state DB's {stage} result of generation {generation} does not match this rsi "
                             f"version ({where}: {first['msg']}); it was written by another version: continue the "
                             "lineage with that version or start a new --lineage") from None


class HarnessTried(BaseModel):
    model_config = ConfigDict(frozen=True)

    harness: str
    gate: str = Field(description="promoted or rejected by the full gate, or screened out before it")
    p_value: float | None = None


class GenerationSummary(BaseModel):
    """One generation as the lineage flow reports it (and publishes as Prefect artifacts): its gate decision
    and accuracies, or why the lineage stopped before a candidate was judged."""

    model_config = ConfigDict(frozen=True)

    generation: int
    seconds: dict[str, float] = Field(default_factory=dict, description="wall seconds per stage")
    stopped: str | None = Field(None, description="why the lineage stops here (None: it goes on)")
    gate: str | None = Field(None, description="promoted or rejected; None when no candidate was judged")
    p_value: float | None = None
    reasons: tuple[str, ...] = ()
    version: str | None = Field(None, description="the candidate's MLflow model version")
    targets: tuple[str, ...] = Field((), description="the levels the generation aimed at")
    tasks: int = 0
    trajectories: int = 0
    passed: int = 0
    selected: int = 0
    pass_at: dict[str, dict[str, float] | None] = Field(default_factory=dict, description="per target level")
    candidate: dict[str, float] = Field(default_factory=dict, description="held-out accuracy per level")
    parent: dict[str, float] = Field(default_factory=dict)
    train_seconds: float | None = None
    harness: str | None = Field(None, description="a harness generation: the candidate harness taken")
    harness_candidates: tuple[HarnessTried, ...] = ()
    gains: dict[str, list[dict[str, Any]]] = Field(default_factory=dict, description=(
        "per split, the candidate's gain decomposition per level (rsi.decomposition.rows)"))


def judged_summary(number: int, judged: Judged, registered: Registered, trained: Trained,
                   gains: dict[str, list[dict[str, Any]]], searched: Searched | None) -> GenerationSummary:
    """What every generation that judged a candidate reports: the gate's decision and both pairs' accuracy."""
    return GenerationSummary(
        generation=number, gate="promoted" if judged.decision.promote else "rejected",
        p_value=judged.decision.p_value, reasons=judged.decision.reasons, version=registered.version,
        candidate={str(k): round(v, 3) for k, v in judged.candidate.items()},
        parent={str(k): round(v, 3) for k, v in judged.parent.items()}, train_seconds=trained.seconds, gains=gains,
        harness_candidates=[HarnessTried(harness=c.harness_id, p_value=c.judged.decision.p_value,
                                         gate="promoted" if c.judged.decision.promote else "rejected")
                            for c in (searched.candidates if searched else ())]
        + [HarnessTried(harness=c.harness_id, gate="screened out") for c in (searched.screened if searched else ())])
