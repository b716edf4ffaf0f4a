"""``rsi harness repair``: a user's broken harness in, the harness search run on it with zero training steps, the
adopted harness (or none) and what each step changed out.

The repair is a lineage of its own (``repair-<id>-<hash>``) that starts from the broken harness and a pair
that works elsewhere (the bare base, a lineage's champion, or an adapter), trains no weights, and searches every
generation with the generic operators only (``rsi.proposers``: they read the broken harness and the failures of
its probe, never another stored harness). Each generation gates at most one candidate; the search stops when the
probe finds nothing an operator answers, or after ``generations`` gates."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from rsi.run.config import OPERATORS, CycleConfig


class Step(BaseModel):
    model_config = ConfigDict(frozen=True)

    generation: int
    harness_id: str
    operator: str
    cause: str
    why: str
    changed: dict[str, Any]  # dotted field or template file -> (before, after)
    p_value: float | None


class Repair(BaseModel):
    model_config = ConfigDict(frozen=True)

    lineage: str
    broken: str
    adopted: str | None  # the repaired harness's id, None: no repair found
    steps: tuple[Step, ...]
    gates: int


def repair_config(path: str, lineage: str | None = None, adapter: str | None = None, profile: str | None = None,
                  generations: int = 3, seed: int = 0, target_level: int | None = None) -> CycleConfig:
    """The repair lineage's config: the profile of the harness's family (or ``lineage``'s recorded base);
    ``target_level``: the highest level the harness should pose and the pair pass (default: the profile's)."""
    from rsi.errors import UserError
    from rsi.hcp.load import tolerating
    from rsi.run.config import load_config, profile_for

    if lineage and adapter:
        raise UserError("--lineage and --adapter both name the adapter to repair for; give one")
    with tolerating(path) as harness:  # (a document refused for what it would do is what a repair is for)
        family, base = harness.document.family, {}
    if lineage:
        from rsi.store.champions import champion_pair

        adapter_dir, _, spec, _ = champion_pair(lineage)
        adapter, base = str(adapter_dir), spec.get("base_recipe", {})
    return load_config(profile_for(profile, family), lineage=f"repair-{harness.document.id}-{harness.hash[:8]}",
                       family=family, harness=str(harness.path.parent), seed=seed, start_adapter=adapter,
                       target_level=target_level,
                       base_recipe=base or None, train={"steps": 0}, generations=generations, plateau=generations,
                       harness_search={"enabled": True, "every": 1, "proposers": list(OPERATORS), "gates": 1})


def repair(config: CycleConfig, events: Callable[[str], Any] = lambda _: None) -> Repair:
    """Run the repair lineage; its adopted edits, in order. A broken harness the validator refuses for what it would
    do (``rsi.hcp.load.tolerating``) runs too, its refusals reported as events; its repairs are validated in full."""
    from rsi.flows.cycle import run_lineage
    from rsi.hcp.load import tolerating

    with tolerating(config.harness) as broken:
        for warning in broken.warnings:
            events(warning)
        run_lineage(config, config.generations, events)
        return _result(config)


def _result(config: CycleConfig) -> Repair:
    from rsi.config import get_settings
    from rsi.run.results import read_result
    from rsi.store import open_store
    from rsi.store.harnesses import stored_harness
    from rsi.store.ledger import stage_results

    settings, store = get_settings(), open_store()
    try:
        searches = stage_results(store, config.lineage, "search", read_result)
        steps, adopted = [], None
        with store.session() as s:
            for number, found in searches:
                if found.adopted is None:
                    continue
                chosen = found.candidates[found.adopted]
                before, after = stored_harness(s, found.parent_hash, settings.home), \
                    stored_harness(s, chosen.harness_hash, settings.home)
                steps.append(Step(generation=number, harness_id=chosen.harness_id, operator=chosen.operator,
                                  cause=chosen.cause, why=chosen.why, changed=changes(before, after),
                                  p_value=chosen.judged.decision.p_value))
                adopted = chosen.harness_id
    finally:
        store.dispose()
    return Repair(lineage=config.lineage, broken=config.harness, adopted=adopted, steps=tuple(steps),
                  gates=sum(len(s.candidates) for _, s in searches))


def changes(before: Any, after: Any) -> dict[str, Any]:
    """What an edit changed: dotted document fields and template files, each (before, after)."""
    out: dict[str, Any] = {}

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                walk(a.get(key), b.get(key), f"{path}.{key}" if path else key)
        elif a != b:
            out[path] = (a, b)

    skip = ("version", "description")
    walk({k: v for k, v in before.document.model_dump(mode="json").items() if k not in skip},
         {k: v for k, v in after.document.model_dump(mode="json").items() if k not in skip}, "")
    for name in sorted(set(before.sources) | set(after.sources)):
        if before.sources.get(name) != after.sources.get(name):
            out[name] = (before.sources.get(name), after.sources.get(name))
    return out


def write_adopted(result: Repair, out: Path) -> Path | None:
    """The adopted harness written as a folder (hcp.toml and templates) at ``out``; None where none was."""
    if result.adopted is None:
        return None
    from rsi.config import get_settings
    from rsi.store import open_store
    from rsi.store.harnesses import stored_harness, write_harness_dir

    store = open_store()
    try:
        with store.session() as s:
            harness = stored_harness(s, result.adopted, get_settings().home)
    finally:
        store.dispose()
    write_harness_dir(out, harness.document.model_dump(mode="json"), harness.sources)
    return out
