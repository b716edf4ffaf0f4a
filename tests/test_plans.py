"""Plans (``rsi.pair.plans``): a harness poses a task its format cannot hold as calls it can pose.

The plan logic is checked with a FAKE generation backend that reads the operands off a prompt and writes their
sum (optionally wrong on calls a test picks): it tests the logic around generation, not what a model can do,
which ``make demo`` measures with the real one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest

from rsi.audit import audit
from rsi.backends.base import SamplingParams
from rsi.errors import UserError
from rsi.evaluate import expressible, solved
from rsi.hcp import load_harness
from rsi.hcp.plays import calls_with_gold
from rsi.models import Message, Task, Trajectory
from rsi.pair import Responder
from rsi.pair.plans import PlanRun
from rsi.proposers import propose
from rsi.tasks import DERIVED_SEED, Plan, family_names, get_family
from rsi.task_generators.addition import cuts

from .fakes import FakeModel, adder

FAMILY = get_family("addition")


def chunked(tmp_path, chunk: int):
    """addition/v2 with the digit_chunks plan, as the harness search proposes and stores it."""
    from rsi.store import open_store
    from rsi.store.harnesses import store_new

    (proposal,) = propose(load_harness("addition/v2"), ["addition"], {"chunk": [chunk]})
    with open_store(f"sqlite:///{tmp_path}/rsi.db").session() as s:
        return store_new(s, proposal.document, proposal.sources, tmp_path)


@pytest.mark.parametrize("chunk", [1, 3, 4, 7, 9])
def test_digit_chunks_compose_the_answer_from_right_calls_without_reading_it(chunk) -> None:
    harness = load_harness("addition/v2").document.model_copy(
        update={"plan": {"name": "digit_chunks", "params": {"chunk": chunk}}})
    plan = FAMILY.plans["digit_chunks"]
    for level in (1, chunk, chunk + 1, 13, 25):
        for task in FAMILY.tasks("train", 3, level, 20):
            rounds, answer = answered(plan, task.payload, harness.plan["params"], FAMILY.solve)
            calls = [call for round_ in rounds for call in round_]
            assert all(FAMILY.level_of(c) <= chunk + 1 for c in calls)  # every call fits the chunk (+ its carry)
            assert answer == task.answer, (task.payload, chunk)
            assert len(calls) == 1 if level <= chunk else len(calls) >= -(-level // chunk)


def test_a_plan_poses_levels_beyond_the_width_and_each_call_passes_the_audit(tmp_path) -> None:
    v2, harness = load_harness("addition/v2"), chunked(tmp_path, 4)
    assert not expressible(v2, FAMILY, 13) and expressible(harness, FAMILY, 13)
    tasks = FAMILY.tasks("heldout", 0, 13, 16)
    params = SamplingParams(max_new_tokens=12, n=1)
    assert set(solved(Responder(harness, FakeModel(adder()), "pair-x", family=FAMILY), tasks, params).values()) == {True}
    assert set(solved(Responder(v2, FakeModel(adder()), "pair-x", family=FAMILY), tasks, params).values()) == {False}
    done = Responder(harness, FakeModel(adder()), "pair-x", family=FAMILY).run(tasks, params)
    for trajectory in done.trajectories:
        call = done.tasks[trajectory.task_id]
        assert call.level <= 5 and audit(trajectory, call, harness, FAMILY).passed
    # a derived task is checked against its family like a drawn one: one claiming another answer is refused
    call = next(iter(done.tasks.values()))
    tampered = call.model_copy(update={"answer": call.answer + 1})
    traj = next(t for t in done.trajectories if t.task_id == call.id)
    traj = Trajectory.build(**{**traj.model_dump(exclude={"id"}), "task_id": tampered.id,
                               "messages": (*traj.messages[:-1], Message(role="assistant", content=str(call.answer + 1)[::-1].ljust(11, "0")))})
    verdict = audit(traj, tampered, harness, FAMILY)
    assert not verdict.passed and "ids_consistent" in verdict.failed_rules()


def test_one_wrong_call_leaves_its_task_unsolved(tmp_path) -> None:
    """The model errs only on additions of a ...7 and a ...3: exactly the tasks with such a call are unsolved
    (a run counts only if every call it made passed its audit)."""
    harness = chunked(tmp_path, 5)
    tasks = FAMILY.tasks("heldout", 0, 12, 64)
    erring = FakeModel(adder(wrong=lambda a, b: (a % 10, b % 10) == (7, 3)))
    got = solved(Responder(harness, erring, "pair-x", family=FAMILY), tasks, SamplingParams(max_new_tokens=12, n=1))

    def erred(task: Task) -> bool:
        return any((c.payload["a"] % 10, c.payload["b"] % 10) == (7, 3) for c in calls_with_gold(harness, FAMILY, task)[0])

    assert any(got.values()) and not all(got.values())
    assert {t.id for t in tasks if not got[t.id]} == {t.id for t in tasks if erred(t)}


def test_the_calls_of_a_round_go_to_the_backend_in_one_batch(tmp_path) -> None:
    harness, backend = chunked(tmp_path, 5), FakeModel(adder())
    tasks = FAMILY.tasks("train", 1, 15, 10)
    done = Responder(harness, backend, "pair-x", family=FAMILY).run(tasks, SamplingParams(max_new_tokens=12, n=2))
    # 15 digits at chunk 5: 3 parts, the 2 upper ones also with a carry in; every task's 2 runs, one batch
    assert [len(p) for p in backend.prompts] == [10 * 2 * (3 + 2)]
    assert [p.sample_index for p in done.paths] == [0, 1] * 10
    assert all(FAMILY.verify(t, p.answer) for t, p in zip([t for t in tasks for _ in (0, 1)], done.paths))


def answered(plan: Plan, payload: dict[str, Any], params: dict[str, Any],
             gold: Callable[[dict[str, Any]], Any]) -> tuple[list[list[dict[str, Any]]], Any]:
    """A plan's program run on ``payload`` with every call answered by ``gold``: its rounds of call payloads and
    the answer it composes."""
    program, rounds = plan(payload, params), []
    try:
        payloads = next(program)
        while True:
            rounds.append(payloads)
            payloads = program.send([gold(p) for p in payloads])
    except StopIteration as done:
        return rounds, done.value


def test_a_plan_answers_the_same_whatever_answer_its_task_carries(tmp_path) -> None:
    """Through the runner, tasks whose answer is wrong get the same calls, replies and composed answers; a call
    that poses its task whole is that task, the others are derived from their payloads alone."""
    harness, params = chunked(tmp_path, 5), SamplingParams(max_new_tokens=12, n=2)
    tasks = [t for level in (3, 5, 6, 12) for t in FAMILY.tasks("train", 2, level, 8)]
    wrong = [t.model_copy(update={"answer": t.answer + 1}) for t in tasks]
    right_backend, wrong_backend = FakeModel(adder()), FakeModel(adder())
    right = Responder(harness, right_backend, "pair-x", family=FAMILY).run(tasks, params)
    blind = Responder(harness, wrong_backend, "pair-x", family=FAMILY).run(wrong, params)
    assert wrong_backend.prompts == right_backend.prompts
    assert [p.answer for p in blind.paths] == [p.answer for p in right.paths]
    assert all(FAMILY.verify(t, p.answer) for t, p in zip([t for t in tasks for _ in (0, 1)], right.paths))
    assert [t.completion for t in blind.trajectories] == [t.completion for t in right.trajectories]

    def derived(run: PlanRun) -> dict[str, Task]:
        return {i: t for i, t in run.tasks.items() if t.seed == DERIVED_SEED}

    assert derived(blind) == derived(right) and derived(right)
    assert set(blind.tasks) - set(derived(blind)) == {t.id for t in wrong if t.level <= 5}


# Params to run each registered plan with (a plan missing here fails the test below, naming it).
PLAN_PARAMS: dict[tuple[str, str], list[dict[str, Any]]] = {
    ("addition", "digit_chunks"): [{"chunk": chunk} for chunk in (1, 3, 5)],
}


def test_no_plan_reads_an_answer_or_calls_its_family_while_answering(monkeypatch) -> None:
    """Every registered family's plans, run again with the family's ``solve``, ``verify`` and ``make`` raising
    (on the family and in its module), make the same calls and compose the same answers: a plan gets the payload
    only and composes from its calls' replies."""
    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a plan called its family's solve, verify or make while answering")

    for family in (get_family(name) for name in family_names()):
        if not family.plans:
            continue
        missing = [name for name in family.plans if (family.name, name) not in PLAN_PARAMS]
        assert not missing, f"add params for {family.name}'s plans {missing} to PLAN_PARAMS"
        gold = family.solve
        runs = [(plan, task.payload, params) for name, plan in family.plans.items()
                for params in PLAN_PARAMS[family.name, name]
                for level in range(family.min_level, min(family.max_level, 12) + 1)
                for task in family.tasks("train", 4, level, 5)]
        expected = [answered(*run, gold) for run in runs]
        assert all(answer == gold(payload) for (_, payload, _), (_, answer) in zip(runs, expected))
        originals = {field: getattr(family, field) for field in ("solve", "verify", "make")}
        try:
            with monkeypatch.context() as m:
                module = sys.modules[family.make.__module__]
                for field, function in originals.items():
                    object.__setattr__(family, field, forbidden)  # a frozen dataclass: put back below
                    if getattr(module, function.__name__, None) is function:
                        m.setattr(module, function.__name__, forbidden)
                assert [answered(*run, gold) for run in runs] == expected
        finally:
            for field, function in originals.items():
                object.__setattr__(family, field, function)


@pytest.mark.parametrize(("plan", "error"), [
    ({"name": "digits"}, "field 'plan.name': family 'addition' declares no plan 'digits' (its plans: digit_chunks)"),
    ({"name": "digit_chunks", "params": {"chunk": "7"}}, "params.chunk must be a positive number of digits"),
    ({"name": "digit_chunks", "params": {"chunk": 11}}, "field 'plan': cannot pose"),  # 11 digits whole: width 10
])
def test_a_plan_the_harness_cannot_run_is_refused_naming_the_field(tmp_path, plan, error) -> None:
    import shutil

    folder = tmp_path / "h"
    shutil.copytree(load_harness("addition/v2").folder, folder)
    toml = folder / "hcp.toml"
    params = ", ".join(f"{k} = {v!r}".replace("'", '"') for k, v in plan.get("params", {}).items())
    toml.write_text(toml.read_text() + f'\n[plan]\nname = "{plan["name"]}"\nparams = {{ {params} }}\n')
    with pytest.raises(UserError, match=error.replace("(", r"\(").replace(")", r"\)")):
        load_harness(folder)


def test_cuts_are_the_best_of_every_way_to_cut() -> None:
    """Against brute force: no way to cut has fewer parts starting with a 0, then fewer parts, then a smaller
    largest part."""
    def cost(a: str, b: str, edges: list[int]) -> tuple[int, int, int]:
        spans = list(zip(edges, edges[1:]))
        return (sum(a[hi - 1] == "0" or b[hi - 1] == "0" for _, hi in spans), len(spans),
                max(hi - lo for lo, hi in spans))

    def every_way(n: int, chunk: int, at: int = 0):
        if at == n:
            yield [n]
        for size in range(1, min(chunk, n - at) + 1):
            for rest in every_way(n, chunk, at + size):
                yield [at, *rest]

    for level in (6, 9, 13):
        ways = list(every_way(level, 5))
        for task in FAMILY.tasks("train", 5, level, 30):
            a, b = str(task.payload["a"])[::-1], str(task.payload["b"])[::-1]
            assert cost(a, b, cuts(a, b, 5)) == min(cost(a, b, w) for w in ways)


def test_calls_with_gold_lists_every_call(tmp_path) -> None:
    harness = chunked(tmp_path, 6)
    task = FAMILY.task("train", 0, 13, 0)
    calls, answer = calls_with_gold(harness, FAMILY, task)
    assert task.payload == {"a": 5944270024154, "b": 5382871035724} and answer == task.answer
    # 13 digits in the fewest parts of at most 6 whose top digits are not 0 in either operand (so each call
    # adds equal-length operands), the largest part as small as possible: 5 + 4 + 4, least significant first
    assert [c.payload for c in calls] == [{"a": 4154, "b": 5724}, {"a": 7002, "b": 7103}, {"a": 59442, "b": 53828},
                                          {"a": 70025, "b": 71035}, {"a": 594425, "b": 538285}]
