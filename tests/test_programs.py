"""The programs family: rsi's stack machine (its semantics, bounds and named errors), canonical forms, levels and
splits by canonical program, the human-written generator, and a base that learns it from prompts and answers."""

from __future__ import annotations

import pytest

from rsi.hcp import load_harness
from rsi.hcp.plays import demonstration
from rsi.substrate import SubstrateViolation
from rsi.task_generators import programs
from rsi.task_generators.programs import canonical, level_of, run
from rsi.tasks import get_family


@pytest.mark.parametrize(("program", "x", "output"), [
    ("x 3 add 2 mul", 5, 16), ("x 3 sub", 1, -2), ("x 7 div", 20, 2), ("x 7 mod", 20, 6), ("x 7 div", -1, -1),
    ("x dup mul", 9, 81), ("2 x over sub", 5, 3), ("2 x swap sub", 5, 3), ("x 4 drop", 6, 6),
    ("x jz:2 1 jmp:1 2", 0, 2), ("x jz:2 1 jmp:1 2", 3, 1),  # if x == 0 then 2 else 1
    ("0 x dup jz:7 swap over add swap 1 sub jmp:-9 drop", 4, 10),  # a loop: 4 + 3 + 2 + 1
])
def test_the_machine_runs_programs_as_the_readme_says(program: str, x: int, output: int) -> None:
    assert run(program, x).output == output and run(program, x).error is None


@pytest.mark.parametrize(("program", "error"), [
    ("x jmp:-1", "budget: more than 256 steps"),  # never ends
    ("1 jmp:-2", "stack: more than 16 values"),
    ("x dup mul dup mul dup mul", "bound: a value beyond ±9999"),  # at x = 9: Python's integers would not stop
    ("add", "underflow: add at step 1 needs 2 value(s)"),
    ("x 0 div", "division: div by 0"),
    ("x drop", "empty: the program ends with nothing on the stack"),
    ("x jmp:5", "jump: jmp:5 lands outside the program"),
    ("x print", "parse: token 2 'print'"),
    ("x " + "1 add " * 40, "parse: 81 tokens; a program has at most 64"),
    ("", "parse: a program is a non-empty string"),
])
def test_a_program_without_output_names_why(program: str, error: str) -> None:
    outcome = run(program, 9)
    assert outcome.output is None and outcome.error.startswith(error), outcome


def test_the_machine_runs_inside_the_substrate_guard(monkeypatch) -> None:
    """Whatever the interpreter does runs as a tool runs: a file opened inside it raises."""
    def leaky(tokens, x):
        open("/etc/hostname").close()

    monkeypatch.setattr(programs, "_execute", leaky)
    with pytest.raises(SubstrateViolation, match="'programs' attempted 'open'"):
        run("x", 1)


def test_canonical_forms_drop_what_changes_nothing() -> None:
    assert canonical("x 2 3 add add") == "x 5 add"  # literal arithmetic folded
    assert canonical("x dup drop 0 add 1 mul 7 drop swap swap 5 add") == "x 5 add"
    assert canonical("x 60 60 add add") == "x 60 60 add add"  # 120 is no literal: kept
    assert canonical("x jmp:1 9 2 add") == "x jmp:1 2 add"  # unreachable: gone; the jumps keep their targets
    assert level_of({"program": "x dup drop 2 3 add add 0 add"}) == 1
    padded = {"program": "x 5 add 0 add dup drop"}
    assert programs.family.split_of(padded) == programs.family.split_of({"program": "x 2 3 add add"})


def test_the_generator_draws_programs_of_their_level_that_depend_on_their_input() -> None:
    family = get_family("programs")
    for level in (1, 2, 5, 12):
        for task in family.tasks("train", 0, level, 20):
            program, x = task.payload["program"], task.payload["input"]
            assert level_of(task.payload) == level and run(program, x).output == task.answer
            assert len({run(program, v).output for v in range(10)} - {None}) > 1  # not a constant program
            assert canonical(program) == program
    held_out = {canonical(t.payload["program"]) for t in family.tasks("heldout", 0, 2, 200)}
    test = {canonical(t.payload["program"]) for t in family.tasks("test", 0, 2, 200)}
    train = {canonical(t.payload["program"]) for t in family.tasks("train", 3, 2, 400)}
    assert held_out and test and not (held_out & test) and not (train & (held_out | test))


def test_an_answer_familys_demonstration_is_its_prompt_and_right_answer() -> None:
    """What the built-in base learns a family without tools from (rsi.basemodel.Episodes)."""
    harness, family = load_harness("programs/v1"), get_family("programs")
    task = family.tasks("train", 0, 2, 1)[0]
    demo = demonstration(harness, family, task)
    assert [m.role for m in demo.messages] == ["user", "assistant"] and demo.tool_log == []
    assert demo.messages[0].content == f"{task.payload['program']} ; x={task.payload['input']} ="
    assert demo.messages[1].content == str(task.answer)


@pytest.mark.parametrize(("program", "x", "written"), [
    ("x 3 add 4 mul 2 sub", 5, "5 3 add 4 mul 2 sub | 8 4 mul 2 sub | 32 2 sub | 30"),
    ("x dup mul", 3, "3 dup mul | 3 3 mul | 9"),
    ("x 2 swap sub", 7, "7 2 swap sub | 2 7 sub | -5"),
    ("x jz:2 1 jmp:1 2", 4, "4 jz:2 1 jmp:1 2 | 1 jmp:1 2 | 1"),  # x != 0: on to 1, then over the 2
    ("x 3 add 5", 1, "1 3 add 5 | 4 5"),  # the last state is the final stack: 5 on top
    ("x", 4, "4"),
])
def test_a_worked_answer_writes_each_state_of_the_run(program: str, x: int, written: str) -> None:
    assert programs.worked({"program": program, "input": x}) == written


def test_the_worked_harness_teaches_the_run_and_reads_its_output() -> None:
    """programs/v2: the base learns the run written out (the family's `worked` filter in the answer template),
    and the auditor reads the output from the last state; a run that does not end in integers has no answer."""
    from rsi.audit import audit
    from rsi.backends.base import SamplingParams
    from rsi.pair import Responder
    from rsi.parsers import parse_worked_integer

    from .fakes import FakeModel

    harness, family = load_harness("programs/v2"), get_family("programs")
    for level in (1, 3, 8):
        task = family.tasks("test", 0, level, 1)[0]
        demo = demonstration(harness, family, task)
        assert demo.messages[1].content == programs.worked(task.payload)
        assert demo.messages[1].content.count(" | ") >= level
        wrong = demo.messages[1].content.rsplit(" ", 1)[0] + f" {task.answer + 1}"  # the run right, its end not
        pair = Responder(harness, FakeModel(lambda p, k: [demo.messages[1].content, wrong][k]), "pair", family=family)
        right_reply, wrong_reply = pair.episodes([task], SamplingParams(n=2, max_new_tokens=640, temperature=1.0))
        assert audit(right_reply, task, harness, family).passed
        assert audit(wrong_reply, task, harness, family).failed_rules() == ["answer_correct"]
    assert parse_worked_integer("5 3 add | 8").value == 8 and parse_worked_integer("4 5").value == 5
    assert not parse_worked_integer("5 3 add | 8 add").ok and not parse_worked_integer("5 3 add |").ok


def test_the_verified_harness_passes_the_run_and_no_other_reply_ending_on_the_output() -> None:
    """programs/v3: the same prompt and run as v2, but the answer is the whole run: a reply whose states go wrong
    and whose last value is the output by chance passes v2 and fails v3 (answer_correct); the run passes both."""
    from rsi.audit import audit
    from rsi.backends.base import SamplingParams
    from rsi.pair import Responder

    from .fakes import FakeModel

    v2, v3, family = load_harness("programs/v2"), load_harness("programs/v3"), get_family("programs")
    assert v3.prompt_messages({"program": "x 3 add", "input": 5}) == v2.prompt_messages({"program": "x 3 add",
                                                                                           "input": 5})
    for level in (1, 3, 8):
        task = family.tasks("test", 0, level, 1)[0]
        run = demonstration(v3, family, task).messages[1].content
        assert run == programs.worked(task.payload)
        states = run.split(" | ")
        lucky = " | ".join([states[0], "0 1 add", states[-1]])  # a state no step of the run writes
        assert lucky != run and lucky.endswith(str(task.answer))
        for harness, verdicts in ((v2, [[], []]), (v3, [[], ["answer_correct"]])):
            pair = Responder(harness, FakeModel(lambda p, k: [run, lucky][k]), "pair", family=family)
            replies = pair.episodes([task], SamplingParams(n=2, max_new_tokens=640, temperature=1.0))
            failed = [audit(r, task, harness, family).failed_rules() for r in replies]
            assert failed == verdicts, harness.document.version
    task = family.tasks("test", 0, 2, 1)[0]
    assert not family.verify(task, "x jmp:-1") and not family.verify(task, str(task.answer))
    assert family.verify(task, task.answer) and family.verify(task, programs.worked(task.payload))


def test_rsi_run_programs_starts_under_the_harness_its_base_learned() -> None:
    """The programs profile names programs/v1 (its base learned v1's answers); programs/v2 and v3 are shipped too,
    v3 the family's newest, so a run that took the newest would score the base under a format it never saw. A
    harness named on the command line wins; a family whose profile names none starts under its newest."""
    from rsi.run import latest_harness, load_config, starting_harness

    assert latest_harness("programs") == "harness_versions/programs/v3"
    assert starting_harness("programs") is None
    assert load_config("programs", harness=starting_harness("programs")).harness.endswith("programs/v1")
    assert starting_harness("programs", harness="programs/v2") == "programs/v2"
    assert starting_harness("addition") == latest_harness("addition") == "harness_versions/addition/v2"


@pytest.mark.parametrize(("proposal", "rule"), [
    ("x 3 add", "proposal_format"), ("x 3 print ; x=4", "proposal_format"), ("x 3 add ; x=400", "proposal_format"),
    ("x jmp:-1 ; x=4", "proposal_terminates"),
    ("x dup mul dup mul dup mul ; x=9", "proposal_bounded"), ("1 jmp:-2 ; x=1", "proposal_bounded"),
    ("x 0 div ; x=3", "proposal_runs"), ("x drop ; x=3", "proposal_runs"),
    ("x x sub 5 add ; x=3", "proposal_depends_on_input"),  # constant: 5 whatever x
    ("x 2 3 add add ; x=3", "proposal_novel"),  # a rewriting of one proposed before
])
def test_a_rejected_proposal_names_the_rule_it_breaks(proposal: str, rule: str) -> None:
    judged = programs.judge_proposal(proposal, seen={"x 5 add"})
    assert not judged.accepted and judged.rejected_by == rule, judged.rules
    assert [r for r, _, _ in judged.rules] == list(programs.PROPOSAL_RULES)


def test_a_proposal_of_a_held_out_program_is_rejected_and_a_fresh_one_accepted() -> None:
    family = get_family("programs")
    held_out = family.tasks("heldout", 0, 3, 1)[0].payload["program"]
    rewritten = f"{held_out} 0 add ; x=7"  # the same canonical program, dressed up
    judged = programs.judge_proposal(rewritten)
    assert judged.rejected_by == "proposal_in_train" and judged.canonical == held_out
    fresh = next(t.payload for t in family.tasks("train", 0, 3, 5))
    judged = programs.judge_proposal(f"{fresh['program']} ; x={fresh['input']}")
    assert judged.accepted and judged.level == 3 and judged.payload == fresh
