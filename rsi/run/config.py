"""A lineage run's config: every knob as data (``CycleConfig``), the shipped profiles (``profiles.toml``) and how
the command line's overrides merge into them."""

from __future__ import annotations

import tomllib
from importlib.resources import files
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationInfo, field_validator

from rsi import plugins
from rsi.curriculum import CurriculumSpec
from rsi.engine import EngineSpec
from rsi.errors import UserError
from rsi.gate import GateSpec
from rsi.hashing import digest
from rsi.select import SelectionSpec
from rsi.train import TrainSpec


# Fields added to a config section (None: the top level; a dotted path: a section in a section) after lineages
# were stored under it, with the default that does what the code did before them: left out of the digest at that
# default, so those lineages' stage keys stay valid.
ADDED_AT_DEFAULT = (("selection", "policy", "distinct_passed"),
                    (None, "proposer", {"source": "generator", "harness": "", "tasks_per_level": 16}),
                    (None, "start_adapter", None), ("harness_search", "on_failures", 0.5),
                    ("harness_search", "screen_n", 32), ("harness_search", "probe_samples", 2),
                    ("harness_search", "gates", 2), ("harness_search", "screen_margin", 0.0),
                    ("train", "grad_accum", 1), ("train", "precision", "fp32"),
                    ("harness_search.migration", "grad_accum", 1), ("harness_search.migration", "precision", "fp32"),
                    (None, "engine", EngineSpec().model_dump(mode="json")))
# Where a train runs and whether it checkpoints: not in the digest (a killed train resumed from a checkpoint, or
# one moved to a GPU, continues the same lineage), as the runner is not.
WHERE = {"runner": True, "shards": True, "train": {"device", "checkpoint_every"},
         "harness_search": {"migration": {"device", "checkpoint_every"}}}
Labels = Literal["verified", "unverified", "truth", "majority"]


OPERATORS = ("token_limits", "step_limits", "answer_params", "template_endings", "pose_levels", "plan_params")


class HarnessSearchSpec(BaseModel):
    """The candidate-harness stage: when it runs, what it proposes, how a candidate's adapter migrates."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    every: int = Field(0, ge=0, description="also search every K generations (0: only when the champion's "
                       "harness cannot pose the level the curriculum targets)")
    proposers: tuple[str, ...] = Field(OPERATORS, description=(
        "registered harness proposers (rsi.proposers): the generic operators, each keyed to a failure cause, and "
        "any a family ships"))
    space: dict[str, list[JsonValue]] = Field(default_factory=lambda: {"width": [16]},
                                              description="knob -> values; each proposer reads its own knobs")
    migration: TrainSpec = Field(TrainSpec(steps=300, frontier_fraction=1.0), description=(
        "LoRA training from the champion's adapter on its own verified answers re-rendered under the candidate "
        "(when the candidate's prompt or answer format differs)"))
    examples_per_level: int = Field(512, ge=1, description="migration: verified answers per level")
    on_failures: float = Field(0.5, gt=0.0, le=1.0, description=(
        "also search when at least this share of the last audit's failed tasks failed for a cause an operator "
        "answers (limit_hit, format_violation, step_limit, tool_misuse)"))
    screen_n: int = Field(32, ge=1, description="screen tasks a level (held-out, a stream apart from the gate's)")
    probe_samples: int = Field(2, ge=1, description="samples of each screen task the parent is probed with")
    gates: int = Field(2, ge=1, description="candidates a search sends to the full gate: the screen's best that "
                       "beat the parent on the screen")
    screen_margin: float = Field(0.0, ge=-1.0, le=1.0, description=(
        "a candidate goes on to the gate only where its screen accuracy (mean over levels) exceeds the parent's by "
        "more than this; -1: the screen only ranks"))


class ProposerSpec(BaseModel):
    """Where a generation's training tasks come from: the family's generator, the pair itself proposing them
    under a proposer harness (its family's rules judge each proposal; ``rsi.run.proposals``), or the turns people
    posed to the lineage's specialists through ``rsi serve`` (``rsi.mol.harvest``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: Literal["generator", "self", "frozen", "traffic"] = Field("generator", description=(
        "generator: the family's own tasks at the curriculum's levels. self: the champion proposes them under "
        "`harness` (the same adapter as the solver, its role told by the prompt), and learns from its proposals "
        "the solver found learnable (solve rate within selection.band). frozen: the untrained base proposes, "
        "and the proposer never trains (an ablation arm: the filter without a proposer that improves). traffic: the "
        "served turns the champion answered as one of the lineage's specialists, harvested and audited again, the "
        "model's own replies as its trajectories (no rollout)"))
    harness: str = Field("", description="the proposer's harness (required for self and frozen): a harness "
                         "of a family that declares what it proposes (TaskFamily.proposes)")
    tasks_per_level: int = Field(16, ge=1, description="proposer prompts per curriculum level, each sampled the "
                                 "proposer harness's decoding.samples times")


class CycleConfig(BaseModel):
    """Every knob of a lineage run. Stored with the lineage; part of each stage's inputs hash."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lineage: str = Field("addition", pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")
    family: str = "addition"
    harness: str = "harness_versions/addition/v2"
    seed: int = 0
    backend: str = Field("hf", description="hf (in process) or openai (rsi's vLLM engine), or another package's "
                         "(rsi.plugins kind 'backend')")
    warm_start: Literal["parent", "base"] = "parent"
    start_adapter: str | None = Field(None, description=(
        "a LoRA adapter (directory) on this base the lineage starts from instead of the bare base: a lineage's "
        "champion, say (`rsi harness repair --lineage`)"))
    base_recipe: dict[str, Any] = Field(default_factory=dict, description="overrides of BaseRecipe's defaults")
    replay_tasks_per_level: int = Field(64, ge=0, description="tasks per mastered level, verified, against forgetting")
    eval_n: int = Field(256, ge=1, description="held-out tasks per level")
    eval_headroom: int = Field(2, ge=1, description="levels evaluated beyond the highest one reached")
    curriculum: CurriculumSpec = CurriculumSpec(rule="accelerated")
    selection: SelectionSpec = SelectionSpec()
    train: TrainSpec = TrainSpec()
    engine: EngineSpec = Field(EngineSpec(), description="vLLM's own options for rsi's engine (backend openai)")
    gate: GateSpec = GateSpec()
    harness_search: HarnessSearchSpec = HarnessSearchSpec()
    proposer: ProposerSpec = ProposerSpec()
    generations: int = Field(12, ge=1)
    target_level: int = Field(9, ge=1, description="stop once every level up to this one is mastered")
    plateau: int = Field(3, ge=1, description="stop after this many rejected candidates in a row")
    corrupt_training_data: bool = Field(False, description="TEST SWITCH: train on shuffled answers")
    labels: Labels = Field("verified", description=(
        "where a training example's rightness comes from. verified: the auditor's verdict under the pair's "
        "contract (the loop as designed). ABLATION SWITCHES (bench/ablation.py): unverified: every rollout "
        "kept, verdict ignored (its control arm); truth: each rollout task's true answer in the harness's "
        "format, or the family's expert episode (its upper bound); majority: no ground truth anywhere in the "
        "loop: an answer is kept when more than half of its task's samples give it, and held-out scores (so "
        "the curriculum and the gate) are the pair's self-agreement, not its accuracy (its label_free arm)"))
    runner: str = Field("local", description="where execute, audit and evaluation run (rsi.runners): local, in "
                        "this process; ray, in shards on a Ray cluster; or another package's (rsi.plugins kind "
                        "'runner')")
    shards: int = Field(0, ge=0, description="ray runner: shards per stage (0: one per CPU of the Ray cluster)")

    @field_validator("proposer")
    @classmethod
    def _proposer_harness(cls, spec: ProposerSpec) -> ProposerSpec:
        if spec.source in ("self", "frozen") and not spec.harness:
            raise ValueError(f"proposer.source {spec.source!r} needs proposer.harness (the proposer's harness)")
        return spec

    @field_validator("backend", "runner")
    @classmethod
    def _registered(cls, name: str, info: ValidationInfo) -> str:
        return plugins.known(info.field_name, name)

    @property
    def digest(self) -> str:
        """What the results depend on: every field except where they are computed (``WHERE``: a runner gives
        the same results as any other), so a lineage started with one runner or device continues under another."""
        data = self.model_dump(mode="json", exclude=WHERE)
        for section, field, default in ADDED_AT_DEFAULT:  # so a lineage begun before such a field keeps its keys
            where = data
            for part in section.split(".") if section else ():
                where = where[part]
            if where[field] == default:
                del where[field]
        return digest(data)


def _profiles() -> dict[str, dict[str, Any]]:
    """The shipped profiles (``profiles.toml`` beside this module); a profile may ``extends`` another: its tables
    replace the other's, key by key at the top level."""
    raw = tomllib.loads(files("rsi.run").joinpath("profiles.toml").read_text())
    return {name: {**raw[spec["extends"]], **{k: v for k, v in spec.items() if k != "extends"}}
            if "extends" in spec else spec for name, spec in raw.items()}


PROFILES: dict[str, dict[str, Any]] = _profiles()  # rsi's own; another package's by entry point (rsi.profiles)
for _name, _spec in PROFILES.items():
    plugins.add("profile", _name, _spec)


def profile_for(profile: str | None, family: str | None = None) -> str:
    """The profile a command runs under: the one named, else the family's own (a profile named after it, rsi's or
    one its package declares in ``rsi.profiles``), else ``demo``."""
    return profile or (family if family in plugins.names("profile") else "demo")


def latest_harness(family: str) -> str:
    """The newest shipped harness version of ``family``: ``harness_versions/<family>/v<N>``, highest N."""
    from rsi.hcp import resolve_harness, shipped_harnesses

    return str(resolve_harness(family).relative_to(shipped_harnesses().parent))


def starting_harness(family: str, profile: str | None = None, harness: str | None = None) -> str | None:
    """The harness ``rsi run FAMILY`` starts under: the one named; else None where the run's profile (the one
    named, or the family's own) names a harness, which then applies (smollm2's is a chat harness, programs' the one
    its base learned, not the newest shipped); else the family's newest shipped version."""
    return harness or (None if "harness" in plugins.get("profile", profile_for(profile, family))
                       else latest_harness(family))


def load_config(profile: str | None = "demo", **overrides: Any) -> CycleConfig:
    """The profile's config with ``overrides`` merged in (nested dicts key by key); None values are ignored.
    Profile None: the overrides over CycleConfig's defaults (a whole config, as ``flow_parameters`` passes it)."""
    from pydantic import ValidationError

    spec = plugins.get("profile", profile) if profile is not None else {}
    if not isinstance(spec, dict):
        raise UserError(f"profile {profile!r} is a {type(spec).__name__}, not a mapping of config fields")
    merged = deep_merge(spec, {k: v for k, v in overrides.items() if v is not None})
    try:
        return CycleConfig.model_validate(merged)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise UserError(f"config field {where!r}: {first['msg']} (got {first.get('input')!r})") from None


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def parse_sets(items: list[str]) -> dict[str, Any]:
    """``--set train.steps=60 --set gate.alpha=0.1`` as nested overrides; values are JSON, else strings."""
    import json

    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {item!r}: expected KEY=VALUE with a dotted config key, e.g. --set train.steps=60")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        *parents, leaf = key.strip().split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"--set {item!r}: {part!r} is set to a value and used as a section")
        node[leaf] = value
    return out
