"""The harness search's cheap look before the gate: a few held-out tasks a level, drawn from a stream of their own
(the lineage seed offset by ``OFFSET``, so never the stream the gate draws), on which the parent pair is probed
(its samples audited and gathered as the operators' evidence) and each candidate is ranked (greedy accuracy).
Only the best candidates go on to the full gate; a screen spends none of the gate's alpha."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rsi.evaluate import evaluation_tasks, posable
from rsi.hcp import Harness
from rsi.proposers import Evidence, gather
from rsi.tasks import TaskFamily

OFFSET = 1_000_003


class Screen:
    def __init__(self, runner: Any, family: TaskFamily, lineage_seed: int, n: int, samples: int):
        self.runner, self.family, self.seed, self.n, self.samples = runner, family, lineage_seed + OFFSET, n, samples

    def probe(self, harness: Harness, pair: Any, adapter: str | None, levels: Sequence[int],
              unposable: Sequence[int] = ()) -> Evidence:
        """The pair's ``samples`` samples of each screen task it can pose, audited: what the operators read."""
        tasks, params = evaluation_tasks(harness, self.family, levels, self.n, lineage_seed=self.seed,
                                         k=self.samples, split="heldout")
        can = posable(harness, self.family, tasks)
        trajectories, posed = self.runner.rollout(harness, can, pair.id, params, adapter=adapter)
        by_id = {t.id: t for t in [*can, *posed]}  # under a plan, the trajectories are the calls it posed
        verdicts = self.runner.audit(harness, trajectories, by_id, pair)
        unposed = [lv for lv in levels if not any(t.level == lv for t in can)]
        return gather(trajectories, {v.trajectory_id: v for v in verdicts}, by_id,
                      sorted({*unposable, *unposed}))

    def scores(self, harness: Harness, pair: Any, adapter: str | None, levels: Sequence[int]) -> dict[int, float]:
        """Greedy accuracy per level on the screen tasks (a level the harness cannot pose scores 0)."""
        return {sc.level: sc.accuracy for sc in self.runner.evaluate(
            harness, pair.id, levels, self.n, lineage_seed=self.seed, adapter=adapter, split="heldout")}
