"""Failure attribution: a failed task's cause comes from the rules its samples failed, by majority."""

from __future__ import annotations

from rsi.attribution import attribute, sample_cause, summary, table
from rsi.models import Message, RuleResult, Timings, TokenCounts, ToolCall, Trajectory, Verdict
from rsi.tasks import get_family

ADDITION = get_family("addition")
RULES = ("ids_consistent", "prompt_rendered", "messages_allowed", "limits", "stopped", "tools_allowed",
         "results_replayed", "states_replayed", "answer_format", "no_extra_content", "answer_correct")


def sample(task, index: int, finish: str = "stop") -> Trajectory:
    return Trajectory.build(task_id=task.id, pair_id="pair-x", harness_id="addition/v2", sample_index=index, seed=0,
                            messages=(Message(role="user", content="p"), Message(role="assistant", content=str(index))),
                            finish_reason=finish, tokens=TokenCounts(prompt=1, completion=1),
                            timings=Timings(generate_s=0.0))


def verdict(traj: Trajectory, *failed: str, detail: str = "") -> Verdict:
    return Verdict(trajectory_id=traj.id, contract_version="2", harness_hash="h",
                   rules=tuple(RuleResult(rule=r, passed=r not in failed, detail=detail if r in failed else "")
                               for r in RULES))


def test_each_failed_rule_set_has_its_cause() -> None:
    task = ADDITION.task("train", 0, 3, 0)
    t = sample(task, 0)
    assert sample_cause(t, verdict(t, "answer_correct")) == "wrong_answer"
    assert sample_cause(t, verdict(t, "answer_format", "answer_correct")) == "format_violation"
    assert sample_cause(t, verdict(t, "no_extra_content", "answer_correct")) == "format_violation"
    assert sample_cause(sample(task, 1, "length"), verdict(sample(task, 1, "length"), "stopped")) == "limit_hit"
    assert sample_cause(t, verdict(t, "limits")) == "limit_hit"
    assert sample_cause(t, verdict(t, "prompt_rendered", "answer_correct")) == "contract_violation"
    assert sample_cause(t, verdict(t, "ids_consistent", detail="task differs from the one its family generates")) \
        == "inauthentic_task"
    # episodes: out of steps while still calling tools; a bad call; a log the replay contradicts
    calls = sample(task, 2).model_copy(update={"messages": (
        Message(role="user", content="p"),
        Message(role="assistant", content="swap(0,1)", tool_calls=(ToolCall(id="c", name="swap", arguments={}),)),
        Message(role="tool", content="x", tool_call_id="c"))})
    assert sample_cause(calls, verdict(calls, "messages_allowed", "answer_format", "answer_correct")) == "step_limit"
    assert sample_cause(t, verdict(t, "tools_allowed", "answer_correct")) == "tool_misuse"
    assert sample_cause(t, verdict(t, "results_replayed")) == "contract_violation"
    assert sample_cause(t, verdict(t, "states_replayed", "answer_correct")) == "contract_violation"


def test_a_task_is_failed_only_when_no_sample_passed_and_takes_its_samples_majority_cause() -> None:
    solved, wrong, cut = (ADDITION.task("train", 0, level, 0) for level in (2, 4, 5))
    trajectories, verdicts = [], {}
    for task, causes in ((solved, [(), ("answer_correct",)]),
                         (wrong, [("answer_correct",), ("answer_correct",), ("answer_format", "answer_correct")]),
                         (cut, [("stopped",), ("stopped",), ("answer_correct",)])):
        for i, failed in enumerate(causes):
            t = sample(task, i, "length" if failed == ("stopped",) else "stop")
            trajectories.append(t)
            verdicts[t.id] = verdict(t, *failed)
    tasks = {t.id: t for t in (solved, wrong, cut)}
    rows = attribute(trajectories, verdicts, tasks, unposable={11: 128})
    assert [(r.level, r.cause, r.owner, r.tasks) for r in rows] == [
        (11, "not_posable", "harness", 128), (4, "wrong_answer", "model", 1), (5, "limit_hit", "harness", 1)]
    assert rows[1].samples == {"wrong_answer": 2, "format_violation": 1}
    assert summary(rows) == {"not_posable": 128, "wrong_answer": 1, "limit_hit": 1}
    assert [(r["cause"], r["owner"], r["tasks"], r["levels"]) for r in table(rows)] == [
        ("not_posable", "harness", 128, "11"), ("limit_hit", "harness", 1, "5"), ("wrong_answer", "model", 1, "4")]


def test_a_tie_goes_to_the_earlier_cause() -> None:
    task = ADDITION.task("train", 0, 3, 1)
    a, b = sample(task, 0), sample(task, 1)
    rows = attribute([a, b], {a.id: verdict(a, "answer_correct"), b.id: verdict(b, "limits")}, {task.id: task})
    assert [r.cause for r in rows] == ["limit_hit"]
