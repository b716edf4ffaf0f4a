"""A lineage run's training data: which rollouts a selection may keep, stored selections read back as training
examples (re-rendered under another harness where needed), replay of earlier generations, and the migration
set a candidate harness's adapter trains on."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rsi.evaluate import answer_of, majority_answers
from rsi.hashing import digest
from rsi.hcp import Harness
from rsi.migrate import rerender, true_example
from rsi.models import Trajectory
from rsi.run.harnesses import Harnesses
from rsi.run.proposals import proposal_example
from rsi.run.results import Selected
from rsi.select import Dataset, Example
from rsi.store.ledger import Ledger
from rsi.store.records import load_dataset_rows, load_trajectories, passed_under, put_dataset, verified_answers
from rsi.tasks import TaskFamily


class TrainingData:
    def __init__(self, ledger: Ledger, harnesses: Harnesses, family: TaskFamily):
        self.ledger, self.store, self.harnesses, self.family = ledger, ledger.store, harnesses, family

    def kept(self, trajectories: Sequence[Trajectory], labels: str, harness: Harness) -> set[str]:
        """The trajectories a selection may keep, by the lineage's ``labels``: those the auditor passed under
        the champion's contract (``harness``); ABLATIONS: every one (unverified), the first of each task (truth:
        its example is the true answer, written when the dataset is loaded), or those giving the answer more
        than half of their task's samples give (majority: no verifier)."""
        if labels == "unverified":
            return {t.id for t in trajectories}
        if labels == "truth":
            return {next(t.id for t in trajectories if t.task_id == task_id)
                    for task_id in {t.task_id for t in trajectories}}
        if labels == "majority":
            answers = {t.id: answer_of(harness, t.completion) for t in trajectories}
            majority = majority_answers([(t.task_id, answers[t.id]) for t in trajectories
                                         if answers[t.id] is not None], harness.document.decoding.samples)
            return {t.id for t in trajectories if t.task_id in majority and answers[t.id] == majority[t.task_id]}
        with self.store.session() as s:
            return passed_under(s, [t.id for t in trajectories], harness.hash)

    def put(self, key: str, generation_id: int, filters: dict[str, Any], trajectory_ids: Sequence[str]) -> None:
        with self.ledger.fence.write() as s:
            put_dataset(s, key, self.ledger.lineage, generation_id, filters, trajectory_ids)

    def load(self, dataset_digest: str, harness: Harness | None = None) -> tuple[Dataset, bool]:
        """A stored selection as training examples, read from the stored trajectories (prompt and completion
        exactly as sampled; written again under ``harness`` where they were sampled under another one, see
        ``rsi.migrate``), and whether the test switch marked it corrupted."""
        with self.store.session() as s:
            filters, ids = load_dataset_rows(s, dataset_digest)
            trajectories, tasks = load_trajectories(s, ids)
        sources, corrupted = filters["sources"], bool(filters.get("corrupted"))
        examples = []
        for t, source in zip(trajectories, sources, strict=True):
            sampled_under = self.harnesses.of(t.harness_id)
            if harness is not None and sampled_under.document.family != harness.document.family:
                examples.append(proposal_example(t, tasks[t.task_id], sampled_under, source))
                continue  # another role's example (a proposal): its own harness
            examples.append(true_example(t, tasks[t.task_id], harness or sampled_under, self.family, source)
                            if filters.get("labels") == "truth"
                            else rerender(t, tasks[t.task_id], sampled_under, harness or sampled_under, source))
        return Dataset(examples=tuple(examples), corrupted=corrupted), corrupted

    def replay(self, number: int, harness: Harness, generations: int) -> list[Example]:
        """Selected examples of the last ``generations`` earlier generations (verified samples, never labels),
        under the champion's ``harness`` (re-rendered where an earlier generation sampled them under another)."""
        earlier = [g for g in self.ledger.finished() if g.number < number][-generations:]
        examples: list[Example] = []
        for g in earlier:
            result = self.ledger.result(g, "select")
            if result and not result.corrupted:  # the test switch's shuffled answers must never be replayed
                examples += self.load(result.digest, harness)[0].examples
        return examples

    def migration_set(self, generation_id: int, per_level: int) -> Selected:
        """The lineage's verified answers (passed under the harness they were produced under), one per task, at
        most ``per_level`` per level: what migration re-renders. Stored like a selection."""
        with self.store.session() as s:
            rows = verified_answers(s, self.ledger.lineage)
        chosen, tasks_seen, per = [], set(), Counter()
        for traj_id, task_id, harness_id, level, verdict_hash in rows:
            harness = self.harnesses.of(harness_id)
            if harness.document.family != self.family.name or verdict_hash != harness.hash or task_id in tasks_seen \
                    or per[level] >= per_level:
                continue  # this family's answers, verified under their own contract only; one answer per task
            tasks_seen.add(task_id)
            per[level] += 1
            chosen.append(traj_id)
        key = digest({"migration": chosen})
        self.put(key, generation_id, {"migration": True, "per_level": per_level, "corrupted": False,
                                      "sources": ["frontier"] * len(chosen)}, chosen)
        return Selected(digest=key, size=len(chosen), corrupted=False, frontier=len(chosen), replay=0)


def corrupt(dataset: Dataset, seed: int) -> Dataset:
    """TEST SWITCH: shuffle the answers among the examples, so the data no longer matches its prompts."""
    rng = random.Random(seed)
    answers = [(e.completion, e.turns) for e in dataset.examples]
    rng.shuffle(answers)
    return dataset.model_copy(update={"examples": tuple(e.model_copy(update={"completion": a, "turns": turns})
                                                        for e, (a, turns) in zip(dataset.examples, answers))})
