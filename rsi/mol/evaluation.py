"""``rsi router eval``: a router on the held-out routing set (the families' ``heldout`` split, which no router
trains on): confusion matrix over the specialists and the base, macro-F1, routing latency, and answer accuracy of
the routed answers against an oracle router (each turn answered by its own specialist).

An answer is judged as the cycle judges it (``rsi.evaluate.solved``: the audit under the true specialist's
harness); routed elsewhere, the turn is played under the same harness (the client's conversation and tools) with
the routed specialist's adapter, or with no adapter when the base answers.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from rsi.errors import UserError

BASE = "base"


class RouterReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    router: str
    n: int
    labels: list[str]
    confusion: dict[str, dict[str, int]]  # true -> routed -> count
    f1: dict[str, float]
    macro_f1: float
    accuracy: float
    latency_ms: dict[str, float]
    answer_accuracy: dict[str, dict[str, float]]  # specialist -> routed / oracle / n


def f1_scores(pairs: list[tuple[str, str]], labels: list[str]) -> dict[str, float]:
    """F1 per true label (a label no turn has is left out of the macro average)."""
    out = {}
    for label in labels:
        tp = sum(t == label and r == label for t, r in pairs)
        fp = sum(t != label and r == label for t, r in pairs)
        fn = sum(t == label and r != label for t, r in pairs)
        if tp + fn:
            out[label] = 2 * tp / (2 * tp + fp + fn)
    return out


def evaluate_router(store: Any, home: Path, kind: str, per_level: int, threshold: float, answers: bool = True,
                    seed: int = 0) -> RouterReport:
    from rsi.mol.registry import Registry
    from rsi.mol.routers import load_router, routing_tasks, timed_routes, user_text

    champions = Registry(store, home).champions()
    if not champions:
        raise UserError("no specialist has a promoted champion; `rsi specialists add LINEAGE` a lineage with one")
    model = load_router(kind, home)
    tasks = {name: routing_tasks(c, "heldout", per_level, seed) for name, c in champions.items()}
    items = [(name, task) for name, ts in tasks.items() for task in ts]
    if not items:
        raise UserError("no held-out routing task: the specialists' --levels are outside what their harnesses can "
                        "pose; `rsi specialists remove` and add them again with --levels in their families' range")
    routes, seconds = timed_routes(model, [user_text(champions[n].harness, t.payload) for n, t in items],
                                   list(champions), threshold)
    labels = [*champions, BASE]
    pairs = [(name, r.specialist or BASE) for (name, _), r in zip(items, routes)]
    confusion = {t: {r: 0 for r in labels} for t in labels}
    for t, r in pairs:
        confusion[t][r] += 1
    f1 = f1_scores(pairs, labels)
    ms = sorted(s * 1000 for s in seconds)
    latency = {"mean": statistics.fmean(ms), "p50": ms[len(ms) // 2], "p95": ms[min(len(ms) - 1, int(len(ms) * 0.95))]}
    accuracy = {}
    if answers:
        accuracy = answer_accuracy(champions, items, [r for _, r in pairs])
    return RouterReport(router=kind, n=len(pairs), labels=labels, confusion=confusion, f1=f1,
                        macro_f1=statistics.fmean(f1.values()), accuracy=sum(t == r for t, r in pairs) / len(pairs),
                        latency_ms=latency, answer_accuracy=accuracy)


def answer_accuracy(champions: dict[str, Any], items: list[tuple[str, Any]], routed: list[str]) -> dict[str, dict]:
    """Per true specialist: the share of its turns answered correctly as routed, and by the oracle."""
    from rsi.backends import get_backend
    from rsi.evaluate import solved
    from rsi.pair import Responder, sampling_params

    backends: dict[Path, Any] = {}

    def backend(base_dir: Path) -> Any:
        if base_dir not in backends:
            backends[base_dir] = get_backend("hf", model_dir=base_dir)
        return backends[base_dir]

    try:
        groups: dict[tuple[str, str], list] = defaultdict(list)  # (true, answering) -> tasks
        for (true, task), r in zip(items, routed):
            groups[(true, r)].append(task)
        oracle = {true: [t for n, t in items if n == true] for true in champions}
        correct: dict[tuple[str, str], dict[str, bool]] = {}
        for (true, answering), tasks in list(groups.items()) + [((t, f"oracle:{t}"), ts) for t, ts in oracle.items()]:
            owner = champions[true]
            by = champions.get(answering.removeprefix("oracle:"))
            base_dir = by.base_dir if by else owner.base_dir
            adapter = str(by.adapter_dir) if by else None
            params = sampling_params(owner.harness, seed=0, greedy=True)
            pair = Responder(owner.harness, backend(base_dir), "router-eval", adapter)
            correct[(true, answering)] = solved(pair, tasks, params)
        out = {}
        for true in champions:
            mine = [(task, r) for (n, task), r in zip(items, routed) if n == true]
            routed_ok = sum(correct[(true, r)][task.id] for task, r in mine)
            oracle_ok = sum(correct[(true, f"oracle:{true}")][task.id] for task, _ in mine)
            out[true] = {"routed": routed_ok / len(mine) if mine else 0.0,
                         "oracle": oracle_ok / len(mine) if mine else 0.0, "n": float(len(mine))}
        return out
    finally:  # the models are freed when a backend or a harness fails too
        for b in backends.values():
            b.close()
