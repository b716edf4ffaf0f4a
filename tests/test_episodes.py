"""Episodes on the action substrate: tools are deterministic functions of the state, confined to it; the episode
runner plays tool calls turn by turn and records what the auditor replays; a one-step episode is the
single-turn trajectory it always was.

The runner's logic is checked with FAKE generation backends (scripted replies); that the built-in model learns
the sorting family is measured by the sorting lineage (``tests/test_cycle.py``), not here."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest

from rsi.audit import audit
from rsi.backends.base import SamplingParams
from rsi.hcp import load_harness
from rsi.hcp.plays import demonstration
from rsi.hcp.syntax import parse_call, render_call
from rsi.models import Message, TokenCounts, Timings, Trajectory
from rsi.pair import Responder
from rsi.pair.text import segments, transcript
from rsi.substrate import Environment, Session, SubstrateViolation, ToolError, replay, state_hash
from rsi.tasks import get_family

from .conftest import REPO
from .fakes import FakeModel

SORT = load_harness(REPO / "harness_versions/sorting/v1")
SORT2 = load_harness(REPO / "harness_versions/sorting/v2")  # contract 3: each turn's text is its recorded call
SORTING = get_family("sorting")
ADD = load_harness(REPO / "harness_versions/addition/v2")
ADDITION = get_family("addition")
SCHEMAS = SORT.tool_schemas


def last_list(prompt: str) -> list[int]:
    return [int(c) for c in re.findall(r"(\d+)>", prompt)[-1]]


def expert_policy(prompt: str, k: int) -> str:
    calls = SORTING.expert({"items": last_list(prompt)})
    return render_call(SORT, calls[0].name, calls[0].arguments) if calls else "done"


# ---- the substrate ------------------------------------------------------------------------------------


def test_tools_are_deterministic_and_a_replay_reproduces_the_log() -> None:
    payload = SORTING.task("train", 0, 4, 0).payload
    calls = [(f"c{n}", "swap", {"i": i}) for n, i in enumerate([0, 2, 0])]
    first, second = replay(SORTING.environment, payload, SCHEMAS, calls), replay(SORTING.environment, payload,
                                                                                  SCHEMAS, calls)
    assert first.records == second.records and len(first.records) == 3
    assert first.records[0].state_before == first.initial_hash == state_hash({"items": payload["items"]})
    assert [r.state_after for r in first.records[:-1]] == [r.state_before for r in first.records[1:]]
    assert first.records[0].state_after != first.records[0].state_before


def test_wrong_calls_are_answered_with_errors_and_change_nothing() -> None:
    session = Session(SORTING.environment, {"items": [1, 0, 2, 3, 4, 5, 6]}, SCHEMAS)
    before = session.hash
    unknown = session.call("a", "shuffle", {})
    outside = session.call("b", "swap", {"i": 9})
    assert unknown.result.startswith("error: no tool 'shuffle'") and outside.result.startswith("error: arguments")
    assert session.hash == before == unknown.state_after == outside.state_after


def test_tool_randomness_and_clock_are_seeded_by_the_episode() -> None:
    def draw(state: Any, arguments: dict, ctx: Any) -> tuple[Any, Any]:
        return state, [ctx.rng.random(), ctx.now]

    env = Environment(init=lambda payload: {"x": payload["x"]}, tools={"draw": draw})
    schemas = {"draw": {"type": "object", "properties": {}}}
    runs = [[Session(env, {"x": x}, schemas).call("c", "draw", {}).result for x in (1, 1, 2)] for _ in range(2)]
    assert runs[0] == runs[1]  # same initial state and call number: same draw, on any run
    assert runs[0][0] == runs[0][1] != runs[0][2]  # another initial state: another stream
    assert runs[0][0][1] == 1_700_000_000.0


def test_a_tool_cannot_reach_outside_its_state(tmp_path: Any) -> None:
    def leak(state: Any, arguments: dict, ctx: Any) -> tuple[Any, Any]:
        with open(tmp_path / "leak.txt", "w") as f:
            f.write("x")
        return state, "ok"

    def shell(state: Any, arguments: dict, ctx: Any) -> tuple[Any, Any]:
        os.system("true")
        return state, "ok"

    def keep(state: Any, arguments: dict, ctx: Any) -> tuple[Any, Any]:
        state["items"].append(9)  # mutates its copy only
        return state, "ok"

    env = Environment(init=lambda payload: {"items": [1]}, tools={"leak": leak, "shell": shell, "keep": keep})
    schemas = {name: {"type": "object", "properties": {}} for name in env.tools}
    session = Session(env, {}, schemas)
    for name in ("leak", "shell"):
        with pytest.raises(SubstrateViolation, match=f"tool {name!r} attempted"):
            session.call("c", name, {})
    assert not (tmp_path / "leak.txt").exists()
    open(tmp_path / "after.txt", "w").close()  # outside a tool, the process is unaffected
    state = session.state
    session.call("k", "keep", {})
    assert state == {"items": [1]} and session.state == {"items": [1, 9]}


def test_a_refusing_tool_leaves_the_state() -> None:
    def refuse(state: Any, arguments: dict, ctx: Any) -> tuple[Any, Any]:
        state["x"] = 1
        raise ToolError("not now")

    session = Session(Environment(init=lambda p: {"x": 0}, tools={"r": refuse}), {}, {"r": {"type": "object"}})
    assert session.call("c", "r", {}).result == "error: not now" and session.state == {"x": 0}


# ---- the runner ---------------------------------------------------------------------------------------


def test_call_syntax_round_trips_and_non_calls_are_final_replies() -> None:
    assert render_call(SORT, "swap", {"i": 2}) == "swap(2)"
    assert parse_call(SORT, "swap(2)") == ("swap", {"i": 2})
    assert parse_call(SORT, "swap(2,5)") == ("swap", {"i": 2, "_0": 5})  # extra value kept: the schema fails it
    assert parse_call(SORT, "shuffle()") == ("shuffle", {})  # an unknown tool is still a call
    for final in ("done", "swap(2", "swap(a)", ""):
        assert parse_call(SORT, final) is None


@pytest.mark.parametrize("harness", [SORT, SORT2], ids=lambda h: h.id)
def test_episodes_play_tool_calls_and_pass_the_audit(harness: Any) -> None:
    tasks = SORTING.tasks("train", 0, 4, 3)
    backend = FakeModel(expert_policy)
    params = SamplingParams(max_new_tokens=10, n=2, temperature=1.0)
    trajectories = Responder(harness, backend, "pair-x").episodes(tasks, params)
    assert len(trajectories) == 6 and backend.calls == 5  # 4 swaps and "done": one batch per turn
    for trajectory, task in zip(trajectories, [t for t in tasks for _ in range(2)]):
        assert [m.role for m in trajectory.messages] == ["user"] + ["assistant", "tool"] * 4 + ["assistant"]
        assert len(trajectory.tool_log) == 4 and trajectory.messages[-1].content == "done"
        verdict = audit(trajectory, task, harness, SORTING)
        assert verdict.passed, verdict.failed_rules()
    played = trajectories[0].messages
    assert played == tuple(demonstration(harness, SORTING, tasks[0]).messages)[:len(played)]


def test_an_episode_ends_at_the_step_limit_and_fails_the_audit() -> None:
    task = SORTING.task("train", 0, 2, 0)
    looping = FakeModel(lambda p, k: "swap(0)")
    trajectory = Responder(SORT, looping, "pair-x").episodes([task], SamplingParams(max_new_tokens=10))[0]
    assert sum(m.role == "assistant" for m in trajectory.messages) == SORT.document.limits.max_steps
    assert trajectory.messages[-1].role == "tool"
    assert "messages_allowed" in audit(trajectory, task, SORT, SORTING).failed_rules()


def test_a_wrong_final_state_fails_answer_correct_only() -> None:
    task = SORTING.task("train", 0, 2, 0)
    quitting = FakeModel(lambda p, k: "done")
    trajectory = Responder(SORT, quitting, "pair-x").episodes([task], SamplingParams(max_new_tokens=10))[0]
    assert audit(trajectory, task, SORT, SORTING).failed_rules() == ["answer_correct"]


def test_a_one_step_episode_is_the_single_turn_trajectory() -> None:
    """What ``rollout`` recorded before episodes existed, field by field: same messages, counts and id."""
    tasks = ADDITION.tasks("train", 0, 3, 2)
    reply = lambda prompt, k: str(k) * 11  # noqa: E731
    params = SamplingParams(max_new_tokens=12, n=2, temperature=1.0)
    got = Responder(ADD, FakeModel(reply), "pair-x").episodes(tasks, params)
    want = [Trajectory.build(task_id=t.id, pair_id="pair-x", harness_id=ADD.id, sample_index=k, seed=0,
                             messages=(Message(role="user", content=ADD.prompt(t.payload)),
                                       Message(role="assistant", content=str(k) * 11)),
                             finish_reason="stop", tokens=TokenCounts(prompt=1 + len(ADD.prompt(t.payload)),
                                                                      completion=12),
                             timings=Timings(generate_s=0.0)) for t in tasks for k in range(2)]
    assert got == want
    assert "tool_log" not in want[0].model_dump(exclude_defaults=True)


def test_segments_mark_the_assistant_turns_for_training() -> None:
    messages = demonstration(SORT, SORTING, SORTING.task("train", 0, 1, 0)).messages
    pieces = segments(messages)
    assert [trained for _, trained in pieces] == [False, True, False, True]
    assert transcript(messages) == "".join(text for text, _ in pieces)
    assert pieces[1][0].endswith("<eos>") and pieces[-1][0] == "done<eos>"


def test_demonstrations_with_mistakes_mend_them_and_the_base_trains_on_the_mends_only() -> None:
    from rsi.basemodel import BaseRecipe, _demonstrations, build_tokenizer

    tasks = SORTING.tasks("train", 0, 2, 64)
    demos = [demonstration(SORT, SORTING, task, 0.3) for task in tasks]
    assert 10 < sum(bool(d.mistaken) for d in demos) < 64
    for demo in demos:  # each mistake is one more inversion to mend: two more calls; every episode ends sorted
        assert sum(m.role == "assistant" for m in demo.messages) == 1 + 2 + 2 * len(demo.mistaken)
        assert all(demo.messages[k].tool_calls for k in demo.mistaken)
    assert demonstration(SORT, SORTING, tasks[0], 0.3) == demos[0]  # seeded by the task
    recipe = BaseRecipe(family="sorting", harness="sorting/v1", train_levels=(2,), level_weights=(1.0,), mistakes=0.3)
    tok, rows = build_tokenizer(), _demonstrations(recipe)[2]
    trained = [tok.decode([t for t in labels if t != -100]) for _, labels in rows]
    mended = [d for d in demos if d.mistaken][0]
    row = next(k for k, task in enumerate(SORTING.tasks("train", 0, 2, 4096)) if task.id == tasks[demos.index(mended)].id)
    assert trained[row] == "".join(m.content + "<eos>" for k, m in enumerate(mended.messages)
                                   if m.role == "assistant" and k not in mended.mistaken)


def test_rsi_audit_names_the_rule_each_forged_episode_breaks(tmp_path: Any) -> None:
    """``rsi audit --file`` on a genuine episode and one forged episode of each kind."""
    from rsi.audit import AuditRecord

    from .test_audit import SORT_TASK, edit_state, extra_call, forge_result, sort_episode
    from .test_cli import rsi

    episodes = {"genuine": sort_episode(), "forged tool result": sort_episode(forge_result),
                "edited state": sort_episode(edit_state), "tool not exposed": sort_episode(extra_call("shuffle", {})),
                "arguments outside the schema": sort_episode(extra_call("swap", {"i": 9}))}
    path = tmp_path / "episodes.jsonl"
    path.write_text("".join(AuditRecord(trajectory=t, task=SORT_TASK).model_dump_json() + "\n"
                            for t in episodes.values()))
    result = rsi("audit", "--file", str(path), "--harness", "sorting/v1", "--no-store", "--json",
                 env={"RSI_HOME": str(tmp_path / "home")})
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert {kind: line["failed_rules"] for kind, line in zip(episodes, lines, strict=True)} == {
        "genuine": [], "forged tool result": ["results_replayed"], "edited state": ["states_replayed"],
        "tool not exposed": ["tools_allowed"], "arguments outside the schema": ["tools_allowed"]}


def test_rsi_audit_fails_a_turn_whose_text_says_another_call_and_keeps_the_old_verdict(tmp_path: Any,
                                                                                       rsi_home: Any) -> None:
    """Issue 30's forged episode (text swap(2), recorded call, tool log and replay swap(1), id recomputed) through
    ``rsi audit --file``: recorded under sorting/v1 it passes contract 2 and that verdict is stored; recorded under
    sorting/v2 it gets a failed verdict naming text_matches_calls (exit 0, no traceback) beside a genuine episode
    that passes; the stored contract-2 verdict stays as it was."""
    from sqlalchemy import select

    from rsi.audit import AuditRecord
    from rsi.store import open_store
    from rsi.store.schema import VerdictRow

    from .test_audit import SORT2, SWAP_1_TASK, say_swap_2, sort_episode
    from .test_cli import rsi

    def audited(harness: str, *trajectories: Trajectory) -> Any:
        path = tmp_path / f"{harness.replace('/', '-')}.jsonl"
        path.write_text("".join(AuditRecord(trajectory=t, task=SWAP_1_TASK).model_dump_json() + "\n"
                                for t in trajectories))
        result = rsi("audit", "--file", str(path), "--harness", harness)
        assert result.returncode == 0 and "Traceback" not in result.stderr + result.stdout, result.stderr
        return result.stdout

    old = sort_episode(say_swap_2, SORT, SWAP_1_TASK)
    assert "1 audited: 1 passed, 0 failed" in audited("sorting/v1", old)
    genuine, forged = sort_episode(None, SORT2, SWAP_1_TASK), sort_episode(say_swap_2, SORT2, SWAP_1_TASK)
    out = audited("sorting/v2", genuine, forged)
    assert "2 audited: 1 passed, 1 failed" in out and "text_matches_calls" in out and "fail" in out
    assert "stored 2 new verdict(s) under contract 3" in out
    assert "stored 0 new verdict(s) under contract 2" in audited("sorting/v1", old)
    with open_store().session() as s:
        rows = {(r.trajectory_id, r.contract_version): r for r in s.scalars(select(VerdictRow))}
    assert rows.keys() == {(old.id, "2"), (genuine.id, "3"), (forged.id, "3")}
    assert rows[old.id, "2"].passed and rows[genuine.id, "3"].passed and not rows[forged.id, "3"].passed
    [rule] = [r for r in rows[forged.id, "3"].rules if not r["passed"]]
    assert rule["rule"] == "text_matches_calls" and rule["detail"].startswith("message 1: the text 'swap(2)'")


def test_the_pyfunc_model_plays_payloads_as_episodes() -> None:
    """The MLflow model of a tool pair predicts an episode per payload (here with the FAKE expert backend)."""
    from rsi.errors import UserError
    from rsi.mlmodel import PairModel

    model = PairModel()
    model.harness, model.adapter, model.backend = SORT, None, FakeModel(expert_policy)
    task = SORTING.task("test", 0, 3, 0)
    [prediction] = model.predict(None, [task.payload])
    assert prediction["final_state"] == {"items": task.answer} and prediction["answer"] == "done"
    assert prediction["calls"] == 3 and prediction["turns"][-1] == "done"
    with pytest.raises(UserError, match=r"input 0: .* is not a sorting task payload"):
        model.predict(None, [{"list": [1, 0]}])
