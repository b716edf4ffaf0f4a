"""How a lineage run judges a candidate pair: against its parent on the same held-out tasks by the gate's paired
rules, and, once judged, its gain over the parent split into weights, harness and their interaction."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rsi.decomposition import Decomposition, decompose_levels
from rsi.decomposition import rows as gain_rows
from rsi.evaluate import evaluation_tasks
from rsi.gate import decide
from rsi.hcp import Harness
from rsi.hcp.plays import calls_with_gold, poses
from rsi.models import Pair, Task, Trajectory
from rsi.run.config import CycleConfig, HarnessSearchSpec
from rsi.run.harnesses import Harnesses
from rsi.run.results import Champion, Discovered, Judged
from rsi.run.scores import Scores
from rsi.store.ledger import Ledger
from rsi.tasks import TaskFamily


class Judge:
    """``pair`` makes the pair of the run's base with an adapter hash and a harness; ``champions`` lists the
    lineage's champion pairs (the base's first)."""

    def __init__(self, config: CycleConfig, ledger: Ledger, scores: Scores, harnesses: Harnesses, family: TaskFamily,
                 pair: Callable[[str | None, Harness], Pair], champions: Callable[[], list[str]]):
        self.config, self.ledger, self.scores, self.harnesses, self.family = config, ledger, scores, harnesses, family
        self.pair, self.champions = pair, champions

    def judge(self, number: int, champ: Champion, found: Discovered, harness: Harness, adapter_hash: str | None,
              adapter_dir: str | None) -> Judged:
        """The candidate pair (adapter, harness) against the champion on the same held-out tasks, level by level,
        by the gate's paired rules, at the candidate's number among those gated against this champion
        (``Ledger.attempt``). Every level either harness can pose is compared, and a level one harness cannot
        pose counts as unsolved for its pair; the targets are the levels the curriculum aimed at, or, for a
        candidate harness, the levels only it can pose."""
        gen = self.ledger.generation(number)
        candidate = self.pair(adapter_hash, harness)
        self.ledger.save_pair(candidate, adapter_dir, champ.pair_id)
        attempt = self.ledger.attempt(champ.pair_id, candidate.id, number)
        reached = [*found.accuracy, *found.frontier_levels, *found.unposable]
        parent_top = self.harnesses.max_level(self.harnesses.of(champ))
        levels = list(range(1, min(max(reached), max(self.harnesses.max_level(harness), parent_top)) + 1))
        parent_scores = self.scores.of(champ, champ.adapter_dir, levels, gen.id)
        cand_scores = self.scores.of(candidate, adapter_dir, levels, gen.id)
        best = self.scores.best(levels, self.champions())
        mastered = {lvl for lvl, sc in best.items() if sc.accuracy >= self.config.curriculum.mastery}
        unlocked = {lvl for lvl in levels if lvl > parent_top}
        decision = decide(parent_scores, cand_scores, targets=unlocked or set(found.frontier_levels), best=best,
                          mastered=mastered, spec=self.config.gate, attempt=attempt)
        return Judged(candidate_pair_id=candidate.id, levels=levels, decision=decision,
                      candidate={k: v.accuracy for k, v in cand_scores.items()},
                      parent={k: v.accuracy for k, v in parent_scores.items()})

    def decompose(self, number: int, champ: Champion, adapter_dir: str | None, judged: Judged) -> Decomposition:
        """The candidate's gain over the champion split into its weights', its harness's and their interaction,
        with the base under the candidate's harness as the no-training reference (``rsi.decomposition``): the
        five pairs on the held-out tasks the gate judged and on the test split's, each level. Stored as a
        ``decompose`` result, so asking again costs nothing; scores are cached per pair."""
        gen = self.ledger.generation(number)
        candidate, parent = self.ledger.load_pair(judged.candidate_pair_id), self.ledger.load_pair(champ.pair_id)
        harness, parent_harness = self.harnesses.of(candidate), self.harnesses.of(champ)
        arms = {"parent": (parent, champ.adapter_dir), "candidate": (candidate, adapter_dir),
                "adapter_only": (self.pair(candidate.adapter_hash, parent_harness), adapter_dir),
                "harness_only": (self.pair(parent.adapter_hash, harness), champ.adapter_dir),
                "base": (self.pair(None, harness), None)}

        def body() -> Decomposition:
            for pair, pair_adapter in arms.values():
                self.ledger.save_pair(pair, pair_adapter, None)  # a no-op for the parent and the candidate
            splits = {}
            for split in ("heldout", "test"):
                scored = {name: self.scores.of(pair, pair_adapter, list(judged.levels), gen.id, split)
                          for name, (pair, pair_adapter) in arms.items()}
                clean = self.clean_tasks(harness, judged.levels) if split == "test" and harness.document.plan else None
                splits[split] = decompose_levels(scored["parent"], scored["adapter_only"], scored["harness_only"],
                                                 scored["candidate"], scored["base"], clean)
            return Decomposition(parent_pair_id=champ.pair_id, candidate_pair_id=candidate.id,
                                 parent_harness=parent_harness.id, harness=harness.id, splits=splits)

        return self.ledger.run_stage(gen, "decompose", {"parent": champ.pair_id, "candidate": candidate.id}, body)

    def gains(self, number: int, judged: Judged) -> dict[str, list[dict[str, Any]]]:
        """The registered candidate's gain decomposition (stored when it was registered), rows per split."""
        decomposition = next(d for d in self.ledger.results(self.ledger.generation(number), "decompose")
                             if d.candidate_pair_id == judged.candidate_pair_id)
        return {split: gain_rows(decomposition, split) for split in decomposition.splits}

    def clean_tasks(self, harness: Harness, levels: Sequence[int]) -> dict[int, list[bool]]:
        """Per level, per test task in evaluation order: whether none of the calls the harness's plan makes for it
        lies in the train split (a task the harness cannot pose makes no call)."""
        tasks, _ = evaluation_tasks(harness, self.family, levels, self.config.eval_n, lineage_seed=self.config.seed,
                                    k=1, split="test")
        out: dict[int, list[bool]] = defaultdict(list)
        for task in tasks:
            calls = calls_with_gold(harness, self.family, task)[0] if poses(harness, self.family, task) else []
            out[task.level].append(all(call.split != "train" for call in calls))
        return dict(out)


def wants_search(spec: HarnessSearchSpec, found: Discovered, number: int, stalled: bool,
                 failed: Mapping[str, int] | None = None) -> bool:
    """Search when the harness holds progress back: it cannot pose a level the curriculum wants (attributed
    ``not_posable``), and that is the target level itself or the last candidate was rejected (``stalled``:
    the levels it can pose stopped improving); or, in the last audit (``failed``: failed tasks per cause), at
    least ``spec.on_failures`` of the failed tasks failed for a cause an operator answers (a cut reply, a
    format the parser refuses, a step limit). Also every ``spec.every`` generations."""
    held_back = bool(found.unposable) and (not found.plan or stalled)
    answerable = sum(n for cause, n in (failed or {}).items() if cause in ANSWERABLE)
    failing = answerable > 0 and answerable >= spec.on_failures * sum((failed or {}).values())
    return spec.enabled and (held_back or failing or (spec.every > 0 and number % spec.every == 0))


ANSWERABLE = ("limit_hit", "format_violation", "step_limit", "tool_misuse")  # causes the generic operators read


def pass_rates(trajectories: Sequence[Trajectory], tasks: dict[str, Task],
               passed: dict[str, bool]) -> dict[int, dict[str, float]]:
    """Per level: pass@1 (mean over samples) and pass@k (share of tasks with at least one pass)."""
    by_task: dict[str, list[bool]] = defaultdict(list)
    for t in trajectories:
        by_task[t.task_id].append(passed[t.id])
    by_level: dict[int, list[list[bool]]] = defaultdict(list)
    for task_id, outcomes in by_task.items():
        by_level[tasks[task_id].level].append(outcomes)
    return {lvl: {"pass@1": sum(map(sum, rows)) / sum(map(len, rows)),
                  "pass@k": sum(any(r) for r in rows) / len(rows), "tasks": len(rows)}
            for lvl, rows in sorted(by_level.items())}
