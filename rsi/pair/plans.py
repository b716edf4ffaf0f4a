"""Plans: a harness that poses a task as several model calls (``[plan]`` in hcp.toml), run for many tasks.

A task family declares its plans (``TaskFamily.plans``): programs over payloads that pose one task as calls the
harness can pose, e.g. a long addition as additions of digit chunks, and compose the task's answer from the
calls' parsed answers (``rsi.hcp.plays``). A plan gets the task's payload only, never its answer or the family
(so it cannot solve or verify). Each call payload is a task of the family (``TaskFamily.derive``; the task
itself when a call poses it whole), posed in the harness's one-call format, so its trajectory is an ordinary
one-step trajectory: audited, selected and trained on like any other. The auditor checks every call against its
own task and the family's verifier checks the composed answer against the task's.

``run_plans`` runs the programs of many tasks side by side: each round's calls of every live program go to the
model in one batch, so a plan costs as many batches as its deepest program has rounds, not one per call. It
reads the model through ``answer`` (the responder's one-step episodes, ``rsi.pair.Responder``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from rsi.backends.base import SamplingParams
from rsi.errors import UserError
from rsi.hcp import Harness
from rsi.hcp.plays import call_task, plan_of
from rsi.hcp.syntax import parse_reply
from rsi.models import Task, Trajectory
from rsi.tasks import TaskFamily

Answer = Callable[[list[Task], SamplingParams], list[Trajectory]]  # one trajectory per task, in order


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


def run_plans(tasks: Sequence[Task], harness: Harness, family: TaskFamily, answer: Answer,
              params: SamplingParams) -> PlanRun:
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
        made = answer(batch, one)
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
