"""Harness edits drawn from failures (``rsi.proposers``' generic operators): a pair that works under a harness is
probed under the harness with one field broken, its samples are audited by the real auditor, the failures are
gathered as evidence, and the operator keyed to their cause proposes the broken field's working value, reading
only the broken harness and the evidence. The pair is the FAKE model of the tests, scripted to answer as a pair
trained under the working harness would; what a real pair does is measured by ``bench/harness_repair.py``."""

from __future__ import annotations

import re

import pytest

from rsi.audit import audit
from rsi.backends.base import Completion, SamplingParams
from rsi.hcp import Harness, load_harness
from rsi.pair import Responder
from rsi.proposers import Evidence, gather, in_memory, propose, variant
from rsi.tasks import get_family

from .fakes import FakeModel, adder

OPERATORS = ("token_limits", "step_limits", "answer_params", "template_endings", "pose_levels")


def broken(harness: Harness, changes: dict, sources: dict | None = None) -> Harness:
    return in_memory(variant(harness, "fault", "a broken field", changes, sources), harness)


def probe(harness: Harness, reply, levels=(1, 2, 3), n=4) -> Evidence:
    """The evidence of the pair's samples under ``harness`` (the real responder and auditor)."""
    family = get_family(harness.document.family)
    tasks = [t for lv in levels for t in family.tasks("heldout", 0, lv, n)]
    pair = Responder(harness, FakeModel(reply), "pair", family=family)
    trajectories = pair.episodes(tasks, SamplingParams(n=2, max_new_tokens=harness.document.decoding.max_new_tokens,
                                                       temperature=1.0))
    verdicts = {t.id: audit(t, next(x for x in tasks if x.id == t.task_id), harness, family) for t in trajectories}
    return gather(trajectories, verdicts, {t.id: t for t in tasks})


def proposed(harness: Harness, evidence: Evidence) -> list:
    return propose(harness, OPERATORS, {}, evidence)


def test_a_pair_that_works_gives_no_evidence_and_no_edit() -> None:
    working = load_harness("addition/v2")
    evidence = probe(working, adder())
    assert not evidence.failures and proposed(working, evidence) == []


def cut_at(limit: int, reply):
    """``reply`` as a backend gives it under ``max_new_tokens = limit``: cut, with finish reason length, where the
    reply and its EOS do not fit."""
    def cut(prompt: str, k: int) -> Completion:
        text = reply(prompt, k)
        return Completion(text=text[:limit], prompt_tokens=1 + len(prompt), completion_tokens=min(limit, len(text) + 1),
                          finish_reason="length" if len(text) + 1 > limit else "stop")
    return cut


def repaired(fault: Harness, reply, cause: str, operator: str, levels=(1, 2, 3)) -> None:
    """The probe of the fault fails for ``cause`` only; ``operator`` proposes edits for it, and under one of them
    the same pair fails nowhere (which one is the screen's to find)."""
    evidence = probe(fault, cut_at(fault.document.decoding.max_new_tokens, reply), levels)
    assert set(evidence.causes()) == {cause}
    edits = [e for e in proposed(fault, evidence) if e.operator == operator]
    assert edits and all(e.cause == cause for e in edits), [e.why for e in proposed(fault, evidence)]
    after = {e.why: probe(edited, cut_at(edited.document.decoding.max_new_tokens, reply), levels).causes()
             for e in edits if (edited := in_memory(e, fault))}
    assert any(not causes for causes in after.values()), after


@pytest.mark.parametrize(("field", "value", "cause", "operator"), [
    ("decoding.max_new_tokens", 6, "limit_hit", "token_limits"),
    ("limits.max_prompt_tokens", 16, "limit_hit", "token_limits"),
    ("limits.max_completion_tokens", 8, "limit_hit", "token_limits"),  # (refused by load_harness: see below)
    ("answer.params.width", 10, "format_violation", "answer_params"),
])
def test_an_addition_fault_is_repaired_by_the_operator_of_its_cause(field: str, value: int, cause: str,
                                                                    operator: str) -> None:
    repaired(broken(load_harness("addition/v2"), {field: value}), adder(), cause, operator)


def test_levels_a_narrowed_prompt_cannot_pose_get_the_smallest_width_that_poses_them() -> None:
    working = load_harness("addition/v2")
    fault = broken(working, {"prompt.vars.width": 8})
    (edit,) = proposed(fault, Evidence(unposable=(9, 10)))
    assert edit.operator == "pose_levels" and edit.document["prompt"]["vars"]["width"] == 10
    assert edit.document["answer"]["params"]["width"] == 11  # not a step or two above 8: left alone


def sorter(missing_ending: bool | str = False):
    """Sorts as a pair trained under sorting/v1 would: the first out-of-order neighbours swapped, 'done' when
    sorted; where a state comes without its '>' (``missing_ending``), it writes the '>' it expected first, or
    (``"lost"``) loses its way: the tail of a call, as the real tiny base was seen to, or (``"stray"``) a word that
    ends the episode."""
    def reply(prompt: str, k: int) -> str:
        items = [int(c) for c in re.findall(r"\d{7}", prompt)[-1]]
        i = next((i for i in range(len(items) - 1) if items[i] > items[i + 1]), None)
        move = "done" if i is None else f"swap({i})"
        if missing_ending and not prompt.endswith(">"):
            return {"lost": "p(4)", "stray": "ok"}.get(missing_ending, ">" + move)
        return move
    return reply


@pytest.mark.parametrize(("changes", "sources", "missing_ending", "cause", "operator"), [
    ({"limits.max_steps": 4}, None, False, "step_limit", "step_limits"),
    ({"decoding.max_new_tokens": 4}, None, False, "limit_hit", "token_limits"),
    ({"answer.params.words": ["finished"]}, None, False, "format_violation", "answer_params"),
    # the '>' it writes first runs "swap(i)" over max_new_tokens 8: cut
    ({}, {"templates/tool.j2": "{{ result }}"}, True, "limit_hit", "template_endings"),
    # ... or it writes something else: the tool result is made to end as the prompt does
    ({}, {"templates/tool.j2": "{{ result }}"}, "lost", "step_limit", "template_endings"),
    # the prompt without its '>': the first turn goes astray, and the prompt is made to end as the tool result does
    ({}, {"templates/prompt.j2": '{{ task["items"] | join("") }}'}, "stray", "format_violation", "template_endings"),
])
def test_a_sorting_fault_is_repaired_by_the_operator_of_its_cause(changes, sources, missing_ending, cause,
                                                                  operator) -> None:
    repaired(broken(load_harness("sorting/v1"), changes, sources), sorter(missing_ending), cause, operator, (3, 5, 8))


@pytest.mark.parametrize(("passes", "chunks"), [(4, [1, 2, 3]), (2, [1]), (0, [])])
def test_unposable_levels_are_posed_by_plan_settings_whose_calls_the_pair_passes(passes: int, chunks: list) -> None:
    """addition declares digit_chunks with chunk 1..8; a chunk of c digits makes calls of c + 1 digits (the carry
    digit), so only the chunks whose calls lie at levels the probe passed are proposed."""
    rates = {lv: {"pass@1": 1.0 if lv <= passes else 0.1, "pass@k": 1.0, "tasks": 32} for lv in range(1, 7)}
    edits = propose(load_harness("addition/v2"), ["plan_params"], {}, Evidence(pass_rates=rates, unposable=(11, 12)))
    assert [e.document["plan"]["params"]["chunk"] for e in edits] == chunks
    assert all(e.cause == "not_posable" and e.document["decoding"]["samples"] == 1 for e in edits)


def searched(parent: str, champion: str, gated: list[tuple[str, float, bool]], screened: list[tuple[str, float]]):
    """A stored search result: ``gated`` (hash, screen accuracy, promoted), ``screened`` (hash, screen accuracy)."""
    from rsi.gate import GateDecision
    from rsi.run.results import HarnessCandidate, Judged, Screened, Searched

    def judged(promote: bool) -> Judged:
        decision = GateDecision(promote=promote, p_value=0.01 if promote else 0.4, wins=1, losses=0, reasons=(),
                                alpha=0.03, attempt=1)
        return Judged(candidate_pair_id="c", levels=(1,), decision=decision, candidate={1: 1.0}, parent={1: 0.5})

    candidates = [HarnessCandidate(harness_id=f"h/{h}", harness_hash=h, why=f"made {h}", trained=None,
                                   judged=judged(p), operator="token_limits", cause="limit_hit", screen={1: s})
                  for h, s, p in gated]
    adopted = next((i for i, (_, _, p) in enumerate(gated) if p), None)
    return Searched(parent_harness=f"h/{parent}", parent_hash=parent, champion=champion, dataset="d", size=0,
                    candidates=candidates, adopted=adopted, screened=[
                        Screened(harness_id=f"h/{h}", harness_hash=h, why=f"made {h}", operator="answer_params",
                                 cause="format_violation", screen={1: s}) for h, s in screened])


def test_the_archive_keeps_every_candidate_and_tries_a_rejected_branch_once_the_champions_is_spent() -> None:
    """A search from the champion's harness adopts nothing: the next search under the same champion expands the
    best screened candidate (its branch), not the champion's harness again; once that branch is expanded too,
    the next best; with every branch spent, the champion's harness again. A new champion starts from its own."""
    from rsi.run.archive import nodes, pick_parent, tree

    first = (1, searched("root", "pair-a", [("g1", 0.6, False)], [("s1", 0.5), ("s2", 0.7)]))
    assert [(n.harness_hash, n.gate) for n in nodes([first])] == [("g1", "rejected"), ("s1", "screened out"),
                                                                   ("s2", "screened out")]
    assert pick_parent([first], "root", set()) == "root"
    assert pick_parent([first], "root", {"root"}) == "s2"  # the best screen, never expanded
    second = (2, searched("s2", "pair-a", [], [("s3", 0.4)]))
    assert pick_parent([first, second], "root", {"root", "s2"}) == "g1"
    assert pick_parent([first, second], "root", {"root", "s2", "g1", "s1", "s3"}) == "root"
    lines = tree(nodes([first, second]), [("root", "h/root")])
    assert lines[0] == "h/root" and any(line.startswith("    - h/s3 [gen 2, answer_params <- format_violation]")
                                        for line in lines), lines


@pytest.mark.parametrize(("ref", "changes", "sources", "refusal"), [
    ("addition/v2", {"limits.max_completion_tokens": 8}, None, "exceeds limits.max_completion_tokens"),
    ("sorting/v1", {"answer.params.words": ["finished"]}, None, "is refused by parser 'word'"),
    ("programs/v1", {}, {"templates/answer.j2": "{{ answer }}!"}, "make the template write what the parser reads"),
])
def test_a_document_refused_for_what_it_would_do_loads_for_its_repair_only(tmp_path, ref, changes, sources,
                                                                          refusal) -> None:
    """``rsi harness repair`` runs a broken harness the validator refuses for its behaviour (not its form): inside
    ``tolerating`` that document, wherever it is loaded from, has the refusal as a warning; a document with other
    content (a candidate repair, or the same fault elsewhere) is still validated in full, and outside the context so
    is the broken one."""
    from rsi.errors import UserError
    from rsi.hcp.load import tolerating
    from rsi.store.harnesses import write_harness_dir

    edit = variant(load_harness(ref), "fault", "a broken field", changes, sources)
    write_harness_dir(tmp_path / "fault", edit.document, edit.sources)
    write_harness_dir(tmp_path / "copy", edit.document, edit.sources)
    other = dict(edit.document, description="other content, the same fault")
    write_harness_dir(tmp_path / "other", other, edit.sources)
    with pytest.raises(UserError, match=re.escape(refusal)):
        load_harness(tmp_path / "fault")
    with tolerating(tmp_path / "fault") as harness:
        assert any(refusal in w for w in harness.warnings), harness.warnings
        assert load_harness(tmp_path / "copy").hash == harness.hash
        with pytest.raises(UserError, match=re.escape(refusal)):
            load_harness(tmp_path / "other")
    with pytest.raises(UserError, match=re.escape(refusal)):
        load_harness(tmp_path / "copy")
