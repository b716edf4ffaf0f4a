"""What every harness proposer shares: the proposal, the evidence it reads, the registry, and ``variant`` (a
harness with fields set) and ``in_memory`` (a proposal to render with)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, JsonValue

from rsi import plugins
from rsi.hashing import digest
from rsi.hcp import Harness

Space = dict[str, list[JsonValue]]


class Proposal(BaseModel):
    model_config = ConfigDict(frozen=True)

    document: dict[str, Any]
    sources: dict[str, str]
    why: str  # one line: what changes and what it is for
    operator: str = ""  # the proposer that made it (set by ``propose``)
    cause: str = ""  # the failure cause it answers ("" for a proposer that reads only the space)


class Failure(BaseModel):
    """One failed sample of a probe: its level, cause (``rsi.attribution.sample_cause``), the contract rules it
    failed with the auditor's detail, its model turns (the last one is what failed) and how the last ended."""

    model_config = ConfigDict(frozen=True)

    level: int
    cause: str
    rules: dict[str, str]
    replies: tuple[str, ...]
    finish_reason: str


class Evidence(BaseModel):
    """What a probe of a pair under its harness showed: per level the share of samples that passed and the share
    of tasks with a pass (pass@1, pass@k), the levels the harness cannot pose, every failed sample."""

    model_config = ConfigDict(frozen=True)

    pass_rates: dict[int, dict[str, float]] = {}
    unposable: tuple[int, ...] = ()
    failures: tuple[Failure, ...] = ()

    def causes(self) -> Counter[str]:
        """Failed samples per cause (a level not posable counts once)."""
        return Counter([f.cause for f in self.failures] + ["not_posable"] * len(self.unposable))

    def of(self, *causes: str) -> list[Failure]:
        return [f for f in self.failures if f.cause in causes]


NO_EVIDENCE = Evidence()


def gather(trajectories: Sequence[Any], verdicts: Mapping[str, Any], tasks: Mapping[str, Any],
           unposable: Sequence[int] = ()) -> Evidence:
    """The evidence of audited trajectories (``Trajectory``, ``Verdict`` by trajectory id, ``Task`` by id)."""
    from rsi.attribution import sample_cause
    from rsi.run.judge import pass_rates

    failures = [Failure(level=tasks[t.task_id].level, cause=sample_cause(t, verdicts[t.id]),
                        rules={r.rule: r.detail for r in verdicts[t.id].rules if not r.passed},
                        finish_reason=t.finish_reason,
                        replies=tuple(m.content for m in t.messages if m.role == "assistant"))
                for t in trajectories if not verdicts[t.id].passed]
    passed = {t.id: verdicts[t.id].passed for t in trajectories}
    return Evidence(pass_rates=pass_rates(trajectories, dict(tasks), passed), unposable=tuple(sorted(unposable)),
                    failures=tuple(failures))


Proposer = Callable[[Harness, Space, Evidence], list[Proposal]]


def proposer(name: str) -> Callable[[Proposer], Proposer]:
    """Register a proposer under ``name`` (``rsi.plugins`` kind "proposer"; another package's by entry point in
    ``rsi.proposers``)."""
    return plugins.plugin("proposer", name)


def get_proposer(name: str) -> Proposer:
    return plugins.get("proposer", name)


def propose(harness: Harness, names: list[str] | tuple[str, ...], space: Space,
            evidence: Evidence = NO_EVIDENCE) -> list[Proposal]:
    """Every named proposer's candidates, in order, without duplicates or the harness itself, each naming the
    proposer that made it."""
    seen = {_content_key(harness.document.model_dump(mode="json"), harness.sources)}
    out = []
    for name in names:
        made = get_proposer(name)
        # a proposer written before evidence existed takes (harness, space)
        for p in made(harness, space, evidence) if _takes_evidence(made) else made(harness, space):
            key = _content_key(p.document, p.sources)
            if key not in seen:
                seen.add(key)
                out.append(p.model_copy(update={"operator": name}))
    return out


def _takes_evidence(fn: Proposer) -> bool:
    import inspect

    try:
        return len(inspect.signature(fn).parameters) >= 3
    except (TypeError, ValueError):
        return True


def _content_key(document: dict[str, Any], sources: dict[str, str]) -> str:
    return digest({"document": {k: v for k, v in document.items() if k not in ("version", "description")},
                   "sources": sources})


def variant(harness: Harness, slug: str, why: str, changes: dict[str, Any], sources: dict[str, str] | None = None,
            drop: tuple[str, ...] = (), cause: str = "") -> Proposal:
    """``harness`` with dotted fields set (``decoding.temperature``), templates added or replaced, template files
    dropped, and the version ``<root>.<slug>-<content digest>``: the same content always gets the same id."""
    doc = harness.document.model_dump(mode="json")  # a fresh dict, edited in place
    for dotted, value in changes.items():
        node = doc
        *path, last = dotted.split(".")
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    files = {k: v for k, v in harness.sources.items() if k not in drop} | (sources or {})
    root = harness.document.version.split(".")[0]
    doc["version"] = f"{root}.{slug}-{_content_key(doc, files)[:8]}"
    doc["description"] = f"{why} (proposed from {harness.id})"
    return Proposal(document=doc, sources=files, why=why, cause=cause)


def in_memory(proposal: Proposal, like: Harness) -> Harness | None:
    """The proposal as a harness to render with (not stored), or None where its document does not validate."""
    from pydantic import ValidationError

    from rsi.hcp.document import HCPDocument

    try:
        return Harness(like.path, HCPDocument.model_validate(proposal.document), proposal.sources)
    except (ValidationError, ValueError):
        return None
