"""The pair proposes its own tasks: what a proposal becomes, and which proposals it learns from.

Where a generation's training tasks come from (``Proposer``, ``run.proposer``): the family's generator at the
curriculum's levels, (``proposer.source`` self or frozen) the pair itself, or (traffic) the turns people posed to
the lineage's specialists, harvested with the champion's replies as trajectories (``Proposer.traffic``), in the
discover stage. A proposer harness is a harness of a family that declares what it proposes
(``TaskFamily.proposes``): its tasks ask for a task of the lineage's family, and its rules (``family:<rule>`` in the
contract) judge each proposal as the auditor judges any answer. Three more checks need more than one proposal or
must hold whatever the family's rules say: ``novel`` (the task's split key was not proposed before in this lineage,
nor earlier in the batch), ``train_split`` (a held-out or test task is never trained on) and ``level_range`` (a
level the family has). An accepted proposal becomes the lineage family's task (``TaskFamily.derive``: its split,
level and answer are the family's own); the solver samples it as it samples any task, and the proposal is learnable
when the solver's pass rate on it lies in ``selection.band``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence

from rsi.curriculum import LevelPlan
from rsi.errors import UserError
from rsi.hashing import digest
from rsi.hcp import Harness, load_harness
from rsi.hcp.document import FAMILY_RULE
from rsi.hcp.syntax import parse_reply
from rsi.models import Pair, Task, Trajectory, Verdict
from rsi.pair import sampling_params
from rsi.pair.text import model_input, training_parts
from rsi.run.config import CycleConfig
from rsi.run.results import Champion, Proposal, Proposed, Traffic, TrafficTurn
from rsi.select import Dataset, Example
from rsi.splits import stream_seed
from rsi.store.harnesses import lock_harness
from rsi.store.ledger import Ledger
from rsi.store.records import load_trajectories, put_tasks, put_trajectories, put_verdicts
from rsi.tasks import TaskFamily, get_family

STAGE_RULES = ("novel", "train_split", "level_range")


class Proposer:
    """The source of a generation's training tasks at the curriculum's levels. ``pair`` makes the pair of the
    run's base with an adapter hash and a harness; ``runner`` samples and audits (``rsi.runners``)."""

    def __init__(self, config: CycleConfig, family: TaskFamily, ledger: Ledger, runner,
                 pair: Callable[[str | None, Harness], Pair]):
        self.config, self.family, self.ledger, self.runner, self.pair = config, family, ledger, runner, pair
        self.harness = proposer_harness(config, family)  # None: the family's generator draws them

    def frontier(self, generation_id: int, number: int, champ: Champion, plan: Sequence[LevelPlan],
                 ceiling: int) -> tuple[Proposed | None, list[Task]]:
        """The tasks of generation ``number`` at the plan's levels: the generator's (no proposals), or the ones
        the pair proposed and the rules accepted, at levels up to ``ceiling`` (the highest the champion's harness
        can pose under the curriculum); each proposal is stored as an audited trajectory."""
        if self.harness is None or not plan:
            seed = stream_seed("rollout", self.config.seed, number)
            return None, [t for p in plan for t in self.family.tasks("train", seed, p.level, p.n_tasks)]
        start, harness = time.perf_counter(), self.harness
        frozen = self.config.proposer.source == "frozen"  # the untrained base proposes: the proposer never learns
        adapter_hash = None if frozen else self.ledger.load_pair(champ.pair_id).adapter_hash
        adapter_dir = None if frozen else champ.adapter_dir
        pair = self.pair(adapter_hash, harness)
        with self.ledger.fence.write() as s:
            lock_harness(s, harness)
        self.ledger.save_pair(pair, adapter_dir, None)
        asked, seed = get_family(harness.document.family), stream_seed("propose", self.config.seed, number)
        prompts = [t for p in plan for t in asked.tasks("train", seed, p.level, self.config.proposer.tasks_per_level)]
        trajectories, _ = self.runner.rollout(harness, prompts, pair.id, sampling_params(harness, seed=seed),
                                              adapter=adapter_dir)
        verdicts = {v.trajectory_id: v for v in self.runner.audit(harness, trajectories, {t.id: t for t in prompts},
                                                                  pair)}
        earlier = [self.ledger.result(g, "discover") for g in self.ledger.finished() if g.number < number]
        proposals, tasks = judge(harness, trajectories, verdicts, self.family,
                                 earlier_keys([r.proposed for r in earlier if r and r.proposed]), ceiling)
        with self.ledger.fence.write() as s:
            put_tasks(s, [*prompts, *tasks])
            put_trajectories(s, trajectories, generation_id=generation_id)
            put_verdicts(s, verdicts.values())
        return Proposed(proposer_pair_id=pair.id, proposals=tuple(proposals), task_ids=tuple(t.id for t in tasks),
                        rejected_by_rule=dict(Counter(p.rejected_by for p in proposals if p.rejected_by)),
                        seconds=time.perf_counter() - start), tasks

    def served_upto(self) -> int:
        """The newest stored conversation message's id (0: none): what a harvest now reads up to."""
        from sqlalchemy import func, select

        from rsi.store.schema import ConversationMessageRow

        with self.ledger.store.session() as s:
            return s.scalar(select(func.max(ConversationMessageRow.id))) or 0

    def traffic(self, generation_id: int, champ: Champion, harness: Harness, ceiling: int,
                upto: int) -> tuple[Traffic, list[Task]]:
        """The served turns the champion pair answered as one of this lineage's specialists (``rsi.mol.harvest``:
        only replies the proxy wrote, the task derived again from the person's message, train split only, keys
        that opted out left out), stored up to message id ``upto``, at levels up to ``ceiling``: their tasks, and
        their trajectories stored with the conversation each came from (execute rolls nothing out: the model
        already answered)."""
        from rsi.mol.harvest import harvest
        from rsi.mol.registry import list_specialists

        start = time.perf_counter()
        mine = [s for s in list_specialists(self.ledger.store) if s.lineage == self.config.lineage]
        got = harvest(self.ledger.store, harness, champ.pair_id, mine, upto=upto, judge=False)  # audit judges
        skipped, turns, tasks, kept = Counter(got.skipped), {}, {}, []
        for h in sorted(got.unjudged, key=lambda h: (h.conversation_id, h.position)):
            if h.task.level > ceiling:
                skipped[f"level above {ceiling} (the harness's ceiling)"] += 1
            elif h.trajectory.id in turns:  # the same question answered the same way again: one trajectory
                skipped["the same trajectory as an earlier turn"] += 1
            else:
                turns[h.trajectory.id] = TrafficTurn(trajectory_id=h.trajectory.id, task_id=h.task.id,
                                                     level=h.task.level, conversation_id=h.conversation_id,
                                                     position=h.position)
                tasks[h.task.id] = h.task
                kept.append(h.trajectory)
        with self.ledger.fence.write() as s:
            put_tasks(s, tasks.values())
            put_trajectories(s, kept, generation_id=generation_id,
                             conversations={t.trajectory_id: t.conversation_id for t in turns.values()})
        return Traffic(pair_id=champ.pair_id, specialists=tuple(s.name for s in mine), turns=tuple(turns.values()),
                       skipped=dict(skipped),
                       seconds=time.perf_counter() - start), list(tasks.values())

    def with_learnable(self, proposed: Proposed | None, dataset: Dataset, trajectories: Sequence[Trajectory],
                       passed: Collection[str]) -> Dataset:
        """``dataset`` and the proposals whose task the solver found learnable (its pass rate over
        ``trajectories``, ``passed`` the ids that passed, within selection.band), as examples of the same adapter:
        the proposer learns with the solver (none when it is frozen or the generator proposes)."""
        if proposed is None or self.config.proposer.source != "self":
            return dataset
        with self.ledger.store.session() as s:
            mine, tasks = load_trajectories(s, learnable(proposed, trajectories, passed, self.config.selection.band))
        examples = [proposal_example(t, tasks[t.task_id], self.harness) for t in mine]
        return dataset.model_copy(update={"examples": dataset.examples + tuple(examples)})


def proposer_harness(config: CycleConfig, family: TaskFamily) -> Harness | None:
    """The proposer's harness of ``config`` (None: the generator proposes), checked to propose ``family``'s
    tasks."""
    if config.proposer.source in ("generator", "traffic"):
        return None
    if config.labels != "verified":  # learnability is read from the solver's verdicts
        raise UserError(f"proposer.source {config.proposer.source!r} needs labels = 'verified' (got "
                        f"{config.labels!r}): a proposal is learnable when the solver's verified pass rate on it "
                        "lies in selection.band")
    harness = load_harness(config.proposer.harness)
    proposes = get_family(harness.document.family).proposes
    if proposes is None or proposes.family != family.name:
        what = f"tasks of {proposes.family!r}" if proposes else "no tasks (TaskFamily.proposes is not set)"
        raise UserError(f"proposer.harness {config.proposer.harness}: its family {harness.document.family!r} "
                        f"proposes {what}, not {family.name!r} tasks")
    return harness


def proposal_example(trajectory: Trajectory, task: Task, harness: Harness, source: str = "frontier") -> Example:
    """What an accepted proposal (``trajectory``, sampled under the proposer ``harness`` for ``task``) teaches:
    its completion as sampled, as the answer to the proposer task it answers (``Proposes.answers``, hindsight:
    a 3-operation program asked for as a 2-operation one teaches the request for 3)."""
    asked = get_family(harness.document.family)
    prompt, completion, turns = training_parts(trajectory.messages)
    payload, level = task.payload, task.level
    if asked.proposes.answers is not None:
        payload = asked.proposes.answers(task.payload, parse_reply(completion, harness.document.answer).value)
        prompt, level = model_input(harness, payload), asked.level_of(payload) if asked.level_of else level
    return Example(trajectory_id=trajectory.id, level=level, prompt=prompt, completion=completion, source=source,
                   turns=turns)


def key_of(family: TaskFamily, payload: dict) -> str:
    """What makes two proposals the same task: the digest of the family's split key (its payload by default)."""
    return digest([family.name, family.split_key(payload) if family.split_key else payload])


def judge(harness: Harness, trajectories: Sequence[Trajectory], verdicts: Mapping[str, Verdict], target: TaskFamily,
          seen: Collection[str], ceiling: int | None = None) -> tuple[list[Proposal], list[Task]]:
    """Each proposal's verdict (the contract's first failed rule, a family rule first, else the stage's rules in
    order) and the tasks the accepted ones become, in trajectory order; ``seen``: keys of earlier proposals of
    this lineage; ``ceiling``: the highest level a task may have (default: the family's)."""
    proposes = get_family(harness.document.family).proposes
    top = min(target.max_level, ceiling or target.max_level)
    seen, proposals, tasks = set(seen), [], []
    for t in trajectories:
        verdict = verdicts[t.id]
        failed = [r for r in verdict.rules if not r.passed]  # a family rule names the reason best
        failed = next((r for r in failed if r.rule.startswith(FAMILY_RULE)), failed[0] if failed else None)
        text = parse_reply(t.completion, harness.document.answer).value if verdict.passed else None  # the auditor's
        rejected, detail, task, key = (failed.rule, failed.detail, None, None) if failed else (None, "", None, None)
        if rejected is None:
            payload = proposes.payload(text)
            key, level = key_of(target, payload), target.level_of(payload)
            if key in seen:
                rejected, detail = "novel", "proposed before in this lineage"
            elif not target.min_level <= level <= top:  # checked before a task of that level is made
                rejected, detail = "level_range", f"level {level}, not {target.min_level}..{top}"
            elif (task := target.derive(payload)).split != "train":
                rejected, detail = "train_split", f"a {task.split} task"
            seen.add(key)
        accepted = rejected is None
        proposals.append(Proposal(trajectory_id=t.id, text=t.completion[:200], rejected_by=rejected,
                                  detail=detail[:200], task_id=task.id if accepted else None,
                                  level=task.level if accepted else None, key=key))
        tasks += [task] if accepted else []
    return proposals, tasks


def learnable(proposed: Proposed, trajectories: Sequence[Trajectory], passed: Collection[str],
              band: tuple[float, float]) -> list[str]:
    """The proposer trajectories whose task the solver found learnable: its pass rate over the solver's samples
    (``trajectories``, ``passed`` the ids that passed) within ``band``."""
    attempts: dict[str, list[bool]] = {}
    for t in trajectories:
        attempts.setdefault(t.task_id, []).append(t.id in passed)
    lo, hi = band
    return [p.trajectory_id for p in proposed.proposals
            if p.task_id in attempts and lo <= sum(attempts[p.task_id]) / len(attempts[p.task_id]) <= hi]


def earlier_keys(results: Sequence[Proposed]) -> set[str]:
    """The keys of earlier generations' proposals that the contract accepted (they became tasks, or a stage rule
    rejected them): the same task proposed again is not novel."""
    return {p.key for r in results for p in r.proposals if p.key is not None}
