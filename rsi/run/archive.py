"""The archive of a lineage's candidate harnesses: every harness a search proposed is a node under the harness it
was drawn from, with the operator and failure cause that made it, its screen accuracy and, where the screen sent
it on, the full gate's decision. Read back from the stored search results (nothing else is written for it). A
search expands the champion's harness, unless a search with the same champion pair expanded it already and
adopted nothing: then the archived candidate with the best screen, expanded least, is the parent (its proposals
come from its own failures), so a branch the gate rejected can be tried again."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from rsi.run.results import Searched

NOVELTY = 0.1  # a parent's score: screen accuracy + NOVELTY / (1 + times expanded)


class Node(BaseModel):
    model_config = ConfigDict(frozen=True)

    harness_id: str
    harness_hash: str
    parent_hash: str
    generation: int
    operator: str
    cause: str
    why: str
    screen: float
    gate: str  # "adopted", "rejected" (by the full gate) or "screened out"
    p_value: float | None = None


def nodes(searches: Sequence[tuple[int, Searched]]) -> list[Node]:
    """Every candidate of the searches (generation number, result), in the order they were made."""
    out = []
    for number, s in searches:
        for i, c in enumerate(s.candidates):
            out.append(Node(harness_id=c.harness_id, harness_hash=c.harness_hash, parent_hash=s.parent_hash,
                            generation=number, operator=c.operator, cause=c.cause, why=c.why, screen=_mean(c.screen),
                            gate="adopted" if i == s.adopted else "rejected", p_value=c.judged.decision.p_value))
        out += [Node(harness_id=c.harness_id, harness_hash=c.harness_hash, parent_hash=s.parent_hash, generation=number,
                     operator=c.operator, cause=c.cause, why=c.why, screen=_mean(c.screen), gate="screened out")
                for c in s.screened]
    return out


def pick_parent(searches: Sequence[tuple[int, Searched]], champion_hash: str, expanded_with: set[str]) -> str:
    """The harness (hash) the next search expands: the champion's, unless ``expanded_with`` (the parents that
    searches under the current champion pair expanded without adopting) holds it; then the archived candidate with
    the best screen plus novelty that is not expanded with this champion yet (the champion's again if none)."""
    if champion_hash not in expanded_with:
        return champion_hash
    made = nodes(searches)
    times = Counter(s.parent_hash for _, s in searches)
    fresh = [n for n in made if n.gate != "adopted" and n.harness_hash not in expanded_with]
    if not fresh:
        return champion_hash
    return max(fresh, key=lambda n: n.screen + NOVELTY / (1 + times[n.harness_hash])).harness_hash


def tree(made: Sequence[Node], roots: Sequence[tuple[str, str]]) -> list[str]:
    """The archive as indented lines, each root (hash, id) with the candidates drawn from it below it."""
    children: dict[str, list[Node]] = {}
    for n in made:
        children.setdefault(n.parent_hash, []).append(n)
    lines: list[str] = []

    def walk(parent: str, depth: int, seen: frozenset[str]) -> None:
        for n in children.get(parent, []):
            p = f", p={n.p_value:.3g}" if n.p_value is not None else ""
            lines.append(f"{'  ' * depth}- {n.harness_id} [gen {n.generation}, {n.operator or '?'} <- "
                         f"{n.cause or 'space'}] screen {n.screen:.3f}, {n.gate}{p}: {n.why}")
            if n.harness_hash not in seen:
                walk(n.harness_hash, depth + 1, seen | {n.harness_hash})

    for root_hash, root_id in roots:
        lines.append(f"{root_id}")
        walk(root_hash, 1, frozenset({root_hash}))
    return lines


def _mean(scores: dict[int, float]) -> float:
    return sum(scores.values()) / max(1, len(scores))
