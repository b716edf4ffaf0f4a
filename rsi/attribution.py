"""Failure attribution: each task a generation failed, or could not pose, is put down to its cause and owner.

A task fails when none of its samples passed the audit. Each failed sample has a cause, read from the rules
its verdict failed (and its finish reason); the task takes the cause most of its samples share (ties go to
the earlier cause in ``CAUSES``). A level the curriculum wanted and the harness cannot render is one row for
the whole level (cause ``not_posable``). The owner says what would have to change: the model (it can follow
the format but answers wrongly), the harness (it cut the reply, or cannot pose the task at all) or the task
(its family did not regenerate it). The harness search runs when the harness owns what holds progress back.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict

from rsi.models import Task, Trajectory, Verdict

# cause -> (owner, what it means); the order breaks ties
CAUSES: dict[str, tuple[str, str]] = {
    "not_posable": ("harness", "the harness's format cannot pose tasks of this level"),
    "inauthentic_task": ("task", "the task is not the one its family generates"),
    "step_limit": ("model", "the episode used every step the harness allows and was still calling tools"),
    "tool_misuse": ("model", "a call to a tool the harness does not expose, or with arguments outside its schema"),
    "contract_violation": ("harness", "the prompt or messages are not what the harness renders and allows"),
    "limit_hit": ("harness", "the reply was cut by the harness's token limit"),
    "format_violation": ("model", "the reply does not follow the answer format, or adds to it"),
    "wrong_answer": ("model", "a well-formed answer that the verifier rejects"),
}
HARNESS_RULES = ("prompt_rendered", "messages_allowed", "results_replayed", "states_replayed")
FORMAT_RULES = ("answer_format", "no_extra_content", "stopped")


class Attribution(BaseModel):
    model_config = ConfigDict(frozen=True)

    level: int
    task_id: str | None
    cause: str
    owner: str
    tasks: int = 1
    samples: dict[str, int] = {}


def sample_cause(trajectory: Trajectory, verdict: Verdict) -> str:
    """The cause of one failed sample, from the rules its verdict failed."""
    failed = {r.rule: r.detail for r in verdict.rules if not r.passed}
    if "ids_consistent" in failed and "task" in failed["ids_consistent"]:
        return "inauthentic_task"
    last = trajectory.messages[-1] if trajectory.messages else None
    if last is not None and last.role == "tool" and "messages_allowed" in failed:
        return "step_limit"
    if "tools_allowed" in failed and not any(rule in failed for rule in HARNESS_RULES):
        return "tool_misuse"
    if any(rule in failed for rule in HARNESS_RULES) or "ids_consistent" in failed:
        return "contract_violation"
    if trajectory.finish_reason == "length" or "limits" in failed:
        return "limit_hit"
    if any(rule in failed for rule in FORMAT_RULES):
        return "format_violation"
    return "wrong_answer"


def attribute(trajectories: Sequence[Trajectory], verdicts: Mapping[str, Verdict], tasks: Mapping[str, Task],
              unposable: Mapping[int, int] | None = None) -> list[Attribution]:
    """One attribution per failed task (by level, then task id) and per level not posable."""
    by_task: dict[str, list[str]] = defaultdict(list)
    passed: set[str] = set()
    for t in trajectories:
        verdict = verdicts[t.id]
        if verdict.passed:
            passed.add(t.task_id)
        else:
            by_task[t.task_id].append(sample_cause(t, verdict))
    order = list(CAUSES)
    rows = [Attribution(level=level, task_id=None, cause="not_posable", owner="harness", tasks=n)
            for level, n in sorted((unposable or {}).items())]
    for task_id in sorted(set(by_task) - passed, key=lambda i: (tasks[i].level, i)):
        counts = Counter(by_task[task_id])
        cause = min(counts, key=lambda c: (-counts[c], order.index(c)))
        rows.append(Attribution(level=tasks[task_id].level, task_id=task_id, cause=cause, owner=CAUSES[cause][0],
                                samples=dict(counts)))
    return rows


def summary(rows: Sequence[Attribution]) -> dict[str, int]:
    """Tasks per cause."""
    out: Counter[str] = Counter()
    for r in rows:
        out[r.cause] += r.tasks
    return dict(out)


def table(rows: Sequence[Attribution]) -> list[dict[str, object]]:
    """Rows of (cause, owner, levels, tasks) for a table artifact or the CLI."""
    groups: dict[str, list[Attribution]] = defaultdict(list)
    for r in rows:
        groups[r.cause].append(r)
    return [{"cause": cause, "owner": CAUSES[cause][0], "tasks": sum(r.tasks for r in group),
             "levels": ", ".join(str(lvl) for lvl in sorted({r.level for r in group})), "meaning": CAUSES[cause][1]}
            for cause in CAUSES if (group := groups.get(cause))]
