"""Plans: a harness that poses a task as several model calls (``[plan]`` in hcp.toml).

A task family declares its plans (``TaskFamily.plans``): programs over payloads that pose one task as calls the
harness can pose, e.g. a long addition as additions of digit chunks, and compose the task's answer from the
calls' parsed answers. A plan gets the task's payload only, never its answer or the family (so it cannot solve
or verify). This runner makes each call payload a task of the family (``TaskFamily.derive``; the task itself
when a call poses it whole), posed in the harness's one-call format, so its trajectory is an ordinary one-step
trajectory: audited, selected and trained on like any other. The auditor checks every call against its own task
and the family's verifier checks the composed answer against the task's.

``run_plans`` runs the programs of many tasks side by side: each round's calls of every live program go to the
backend in one batch, so a plan costs as many batches as its deepest program has rounds, not one per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from rsi.audit import parse_reply
from rsi.backends.base import GenerationBackend, SamplingParams
from rsi.errors import UserError
from rsi.execute import rollout
from rsi.hcp import Harness
from rsi.models import Task, Trajectory
from rsi.tasks import Plan, TaskFamily


class PlanPath(NamedTuple):
    """One run of a task's program: which sample it is, the calls it made and the answer it composed."""

    task_id: str
    sample_index: int
    calls: tuple[str, ...]  # trajectory ids, in the order the program made them
    answer: Any  # None: a call gave no answer, a call could not be posed, or the parts do not compose


class PlanRun(NamedTuple):
    trajectories: list[Trajectory]  # every call's trajectory (one per distinct id), in the order made
    tasks: dict[str, Task]  # the calls' tasks by id
    paths: list[PlanPath]  # per task, ``params.n`` runs, in task order


def plan_of(harness: Harness, family: TaskFamily) -> Plan:
    name = harness.document.plan.name
    if name not in family.plans:
        raise UserError(f"{harness.path}: field 'plan.name': family {family.name!r} declares no plan {name!r} "
                        f"(its plans: {', '.join(sorted(family.plans)) or 'none'})")
    return family.plans[name]


def call_task(family: TaskFamily, task: Task, payload: dict[str, Any]) -> Task:
    """The task a call of ``task``'s plan poses: ``task`` itself when the call poses it whole (so its trajectory
    is the one a one-call harness makes), else the payload's derived task."""
    return task if payload == task.payload else family.derive(payload)


def calls_with_gold(harness: Harness, family: TaskFamily, task: Task) -> tuple[list[Task], Any]:
    """The calls the plan makes for ``task`` when every call is answered right, and the answer it composes
    (validation, and whether a harness can pose a task at all)."""
    program = plan_of(harness, family)(task.payload, harness.document.plan.params)
    calls: list[Task] = []
    try:
        payloads = next(program)
        while True:
            round_ = [call_task(family, task, payload) for payload in payloads]
            calls += round_
            payloads = program.send([call.answer for call in round_])
    except StopIteration as done:
        return calls, done.value


def poses(harness: Harness, family: TaskFamily, task: Task) -> bool:
    """Whether the harness can pose ``task``: render its prompt, or, with a plan, render every call."""
    try:
        if harness.document.plan is None:
            harness.prompt(task.payload)
        else:
            for call in calls_with_gold(harness, family, task)[0]:
                harness.prompt(call.payload)
    except UserError:
        return False
    return True


def run_plans(tasks: Sequence[Task], harness: Harness, family: TaskFamily, backend: GenerationBackend,
              pair_id: str, params: SamplingParams, adapter: str | None = None) -> PlanRun:
    """``params.n`` runs of the plan's program per task; each round's calls of all live runs in one batch
    (one sample per call: a run samples its own path). A program gets its task's payload, never its answer."""
    plan, plan_params = plan_of(harness, family), harness.document.plan.params
    answer_spec = harness.document.answer
    one = params.model_copy(update={"n": 1})
    programs, pending = {}, {}  # run index -> program, and the calls it waits on
    runs = [(task, k) for task in tasks for k in range(params.n)]
    calls: list[list[str]] = [[] for _ in runs]
    answers: list[Any] = [None] * len(runs)
    seen: dict[str, Trajectory] = {}
    posed: dict[str, Task] = {}

    def advance(i: int, replies: list[Any] | None) -> None:
        program = programs[i]
        try:
            payloads = next(program) if replies is None else program.send(replies)
        except StopIteration as done:
            answers[i] = done.value
            pending.pop(i, None)
            return
        try:
            for payload in payloads:
                harness.prompt(payload)
        except UserError:
            program.close()  # a call this harness cannot pose: the run has no answer
            pending.pop(i, None)
            return
        pending[i] = [call_task(family, runs[i][0], payload) for payload in payloads]  # for the auditor

    for i, (task, _) in enumerate(runs):
        programs[i] = plan(task.payload, plan_params)
        advance(i, None)
    while pending:
        order = sorted(pending)
        batch = [call for i in order for call in pending[i]]
        made = rollout(batch, harness, backend, pair_id, one, adapter=adapter)
        at = 0
        for i in order:
            replies = []
            for call, trajectory in zip(pending[i], made[at:at + len(pending[i])], strict=True):
                trajectory = Trajectory.build(**{**trajectory.model_dump(exclude={"id"}), "sample_index": runs[i][1]})
                seen.setdefault(trajectory.id, trajectory)
                posed[call.id] = call
                calls[i].append(trajectory.id)
                parsed = parse_reply(trajectory.completion, answer_spec)
                replies.append(parsed.value if parsed.ok and not parsed.extra else None)
            at += len(pending[i])
            advance(i, replies)
    paths = [PlanPath(task.id, k, tuple(calls[i]), answers[i]) for i, (task, k) in enumerate(runs)]
    return PlanRun(trajectories=list(seen.values()), tasks=posed, paths=paths)


def pose(tasks: Sequence[Task], harness: Harness, family: TaskFamily, backend: GenerationBackend, pair_id: str,
         params: SamplingParams, adapter: str | None = None) -> tuple[list[Trajectory], list[Task]]:
    """``params.n`` samples of each task under the harness: its trajectories, and the derived tasks its plan's
    calls posed (none without a plan: then each trajectory is one of ``tasks``)."""
    if harness.document.plan is None:
        return rollout(tasks, harness, backend, pair_id, params, adapter=adapter), []
    done = run_plans(tasks, harness, family, backend, pair_id, params, adapter)
    return done.trajectories, list(done.tasks.values())
