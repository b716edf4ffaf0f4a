"""The auditor: a good trajectory passes every rule; each tampering fails exactly the rule it breaks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rsi.audit import RULES, audit, audit_jsonl
from rsi.hcp import CONTRACT_RULES, load_harness
from rsi.models import Message, Pair, Task, Timings, TokenCounts, ToolCall, Trajectory
from rsi.tasks import get_family

from .conftest import REPO

HARNESS = load_harness(REPO / "harness_versions/addition/v1")
FAMILY = get_family("addition")
TASK = FAMILY.task(seed=7, level=4, index=3)
PAIR = Pair(base_model_hash="b" * 64, adapter_hash=None, harness_id=HARNESS.id, harness_hash=HARNESS.hash)


def answer_text(value: int) -> str:
    return str(value)[::-1].ljust(11, "0")


def good(**changes) -> Trajectory:
    traj = Trajectory(
        id="traj-1", task_id=TASK.id, pair_id=PAIR.id, harness_id=HARNESS.id, sample_index=0, seed=0,
        messages=(Message(role="user", content=HARNESS.prompt(TASK.payload)),
                  Message(role="assistant", content=answer_text(TASK.answer))),
        tokens=TokenCounts(prompt=23, completion=12), timings=Timings(generate_s=0.01),
    )
    return traj.model_copy(update=changes)


def with_completion(text: str) -> Trajectory:
    return good(messages=(good().messages[0], Message(role="assistant", content=text)))


def failed(traj: Trajectory, task: Task = TASK, pair: Pair | None = PAIR) -> list[str]:
    return audit(traj, task, HARNESS, FAMILY, pair).failed_rules()


def test_every_rule_is_implemented_and_listed() -> None:
    assert set(RULES) == set(CONTRACT_RULES)
    verdict = audit(good(), TASK, HARNESS, FAMILY, PAIR)
    assert verdict.passed, verdict
    assert [r.rule for r in verdict.rules] == list(HARNESS.document.contract.rules)
    assert verdict.contract_version == "1" and verdict.harness_hash == HARNESS.hash


@pytest.mark.parametrize(
    ("traj", "task", "rule"),
    [
        (good(task_id="task-elsewhere"), TASK, "ids_consistent"),
        (good(harness_id="addition/v0"), TASK, "ids_consistent"),
        (good(pair_id="pair-forged"), TASK, "ids_consistent"),
        # the task itself tampered: its answer changed to match a wrong completion
        (with_completion(answer_text(TASK.answer + 1)).model_copy(
            update={"task_id": TASK.model_copy(update={"answer": TASK.answer + 1}).id}),
         TASK.model_copy(update={"answer": TASK.answer + 1}), "ids_consistent"),
        (good(messages=(Message(role="user", content="1+1="), good().messages[1])), TASK, "prompt_rendered"),
        (good(tokens=TokenCounts(prompt=23, completion=99)), TASK, "limits"),
        (good(tokens=TokenCounts(prompt=99, completion=12)), TASK, "limits"),
        (good(messages=(good().messages[0], Message(role="assistant", content="first try"), good().messages[1])),
         TASK, "limits"),
        (good(finish_reason="error"), TASK, "limits"),
        (good(messages=(good().messages[0], Message(role="assistant", content=answer_text(TASK.answer),
                        tool_calls=(ToolCall(id="c1", name="shell", arguments={"cmd": "ls"}),)))), TASK, "tools_allowed"),
        (with_completion(answer_text(TASK.answer) + "7"), TASK, "no_extra_content"),
        (with_completion(answer_text(TASK.answer + 10)), TASK, "answer_correct"),
    ],
    ids=["task_id", "harness_id", "pair_id", "task-tampered", "prompt", "completion-tokens", "prompt-tokens",
         "steps", "error", "tool", "extra", "wrong"],
)
def test_tampering_fails_its_rule(traj: Trajectory, task: Task, rule: str) -> None:
    assert rule in failed(traj, task)
    assert set(failed(traj, task)) <= {rule, "answer_correct"}  # a wrong answer may also follow, nothing else


def test_unparsable_answer_fails_format_and_correctness() -> None:
    assert failed(with_completion("12ab")) == ["answer_format", "answer_correct"]
    assert failed(with_completion("")) == ["answer_format", "answer_correct"]


def test_pair_of_another_harness_version() -> None:
    other = PAIR.model_copy(update={"harness_hash": "0" * 64})
    assert failed(good(pair_id=other.id), pair=other) == ["ids_consistent"]


def test_tool_arguments_checked_against_schema(tmp_path: Path) -> None:
    import shutil

    shutil.copytree(REPO / "harness_versions/addition/v1", tmp_path / "h")
    toml = tmp_path / "h/hcp.toml"
    toml.write_text(toml.read_text() + '\n[[tools]]\nname = "calc"\nparameters = { type = "object", '
                    'properties = { expr = { type = "string" } }, required = ["expr"] }\n')
    harness = load_harness(tmp_path / "h")
    call = lambda args: good(harness_id=harness.id, messages=(
        Message(role="user", content=harness.prompt(TASK.payload)),
        Message(role="assistant", content=answer_text(TASK.answer),
                tool_calls=(ToolCall(id="c", name="calc", arguments=args),))))
    assert audit(call({"expr": "1+1"}), TASK, harness, FAMILY).passed
    verdict = audit(call({"expr": 3}), TASK, harness, FAMILY)
    assert verdict.failed_rules() == ["tools_allowed"] and "is not of type 'string'" in verdict.rules[3].detail


def write_mixed_file(path: Path) -> None:
    lines = [
        json.dumps({"trajectory": good().model_dump(mode="json"), "task": TASK.model_dump(mode="json"),
                    "pair": PAIR.model_dump(mode="json")}),
        "{not json",
        json.dumps({"trajectory": with_completion(answer_text(TASK.answer + 1)).model_copy(update={"id": "traj-2"})
                    .model_dump(mode="json"), "task": TASK.model_dump(mode="json")}),
        json.dumps({"trajectory": {"id": "traj-3"}, "task": TASK.model_dump(mode="json")}),
        "",
        json.dumps({"trajectory": good(id="traj-4").model_dump(mode="json"), "task": TASK.model_dump(mode="json")}),
    ]
    path.write_text("\n".join(lines) + "\n")


def test_jsonl_audit_reports_malformed_lines_and_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    write_mixed_file(path)
    results, records = audit_jsonl(path, HARNESS)
    assert [r.line for r in results] == [1, 2, 3, 4, 6]
    assert [r.verdict.passed if r.verdict else None for r in results] == [True, None, False, None, True]
    assert "JSON" in results[1].error and "trajectory" in results[3].error
    assert len(records) == 3


def test_audit_cli_prints_summary_and_stores_verdicts(tmp_path: Path, db_url: str) -> None:
    path = tmp_path / "mixed.jsonl"
    write_mixed_file(path)
    env = {**__import__("os").environ, "RSI_DATABASE_URL": db_url}
    cmd = [sys.executable, "-m", "rsi", "audit", "--file", str(path), "--harness", "harness_versions/addition/v1"]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert result.returncode == 2, result.stderr  # malformed lines are bad input, reported after the others
    assert "Traceback" not in result.stderr
    assert "3 audited: 2 passed, 1 failed; 2 malformed line(s)" in result.stdout
    assert "stored 3 new verdict(s)" in result.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert "stored 0 new verdict(s)" in again.stdout  # idempotent: same contract, same trajectories

    from sqlalchemy import func, select

    from rsi.store import open_store
    from rsi.store.schema import VerdictRow

    store = open_store(db_url)
    with store.session() as s:
        assert s.scalar(select(func.count()).select_from(VerdictRow)) == 3
        assert s.scalar(select(func.count()).select_from(VerdictRow).where(VerdictRow.passed)) == 2
    store.dispose()
