"""A lineage run's evaluations: a pair's held-out (or test) scores per level, measured once and read back from
the state DB after that (a score is the pair's, and the pair's id covers its harness)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rsi.evaluate import LevelScore
from rsi.run.config import CycleConfig
from rsi.run.harnesses import Harnesses
from rsi.store.leases import Fence
from rsi.store.records import put_scores, stored_evaluations


class Scores:
    def __init__(self, config: CycleConfig, fence: Fence, runner: Any, harnesses: Harnesses):
        self.config, self.fence, self.runner, self.harnesses = config, fence, runner, harnesses
        self.scoring = "agreement" if config.labels == "majority" else "greedy"
        """How this lineage scores a pair (the stored evaluations' ``decoding``): greedy accuracy, or under
        ``labels = "majority"`` self-agreement (``rsi.evaluate.agreed``)."""

    def of(self, pair: Any, adapter_dir: str | None, levels: Sequence[int], generation_id: int | None = None,
           split: str = "heldout") -> dict[int, LevelScore]:
        """Greedy scores of a pair (a ``Pair`` or a ``Champion``) under its harness on ``split`` (under
        ``labels = "majority"`` its self-agreement instead: no ground truth); levels measured before are read
        from the state DB."""
        pair_id = getattr(pair, "pair_id", None) or pair.id
        found = self.stored([pair_id], levels, split).get(pair_id, {})
        missing = [lvl for lvl in levels if lvl not in found]
        if missing:
            new = self.runner.evaluate(self.harnesses.of(pair), pair_id, missing, self.config.eval_n,
                                       lineage_seed=self.config.seed, adapter=adapter_dir, split=split,
                                       agreement=self.scoring == "agreement")
            with self.fence.write() as s:
                put_scores(s, pair_id, generation_id, split, self.config.seed, self.config.eval_n, self.scoring, new)
            found |= {sc.level: sc for sc in new}
        return {lvl: found[lvl] for lvl in levels}

    def stored(self, pair_ids: Sequence[str], levels: Sequence[int], split: str) -> dict[str, dict[int, LevelScore]]:
        """Stored scores of this lineage's kind (requested n = eval_n, this lineage's seed) by pair and level."""
        out: dict[str, dict[int, LevelScore]] = {}
        with self.fence.store.session() as s:
            for row in stored_evaluations(s, pair_ids, levels, split, self.config.seed, self.config.eval_n,
                                          self.scoring):
                outcomes = tuple(row.outcomes)
                out.setdefault(row.pair_id, {})[row.level] = LevelScore(
                    level=row.level, n=len(outcomes), correct=row.correct, accuracy=row.accuracy,
                    ci_low=row.ci_low, ci_high=row.ci_high, outcomes=outcomes, exhaustive=len(outcomes) < row.n)
        return out

    def best(self, levels: Sequence[int], champions: Sequence[str]) -> dict[int, LevelScore]:
        """Per level, the best held-out record among the lineage's ``champions`` (the base and every promoted
        candidate), on the same tasks, so a candidate can be compared with it task by task."""
        stored = self.stored(champions, levels, "heldout")
        best: dict[int, LevelScore] = {}
        for pair_id in champions:  # earliest wins ties: the record was set first
            for level, sc in stored.get(pair_id, {}).items():
                if level not in best or sc.accuracy > best[level].accuracy:
                    best[level] = sc
        return best
