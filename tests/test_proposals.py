"""The pair proposes its own tasks: the proposer harness's contract names the family's rules, the auditor judges
them, the discover stage's rules (novel, train split, level range) judge what needs more than one proposal, an accepted
proposal becomes an authentic task of the lineage's family, and the proposals the solver found learnable are
what the proposer learns from. The replies come from the tests' FAKE model (``tests/fakes.py``): this tests the
judging around a model; a real proposer runs in ``test_a_programs_lineage_proposes_its_own_tasks``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rsi.audit import audit
from rsi.backends.base import SamplingParams
from rsi.errors import UserError
from rsi.hcp import load_harness
from rsi.models import Message, Timings, TokenCounts, Trajectory
from rsi.pair import Responder
from rsi.run.proposals import STAGE_RULES, judge, key_of, learnable, proposal_example
from rsi.run.results import Proposal, Proposed
from rsi.task_generators import programs
from rsi.tasks import get_family

from .conftest import REPO
from .fakes import FakeModel

PROPOSER = REPO / "harness_versions/program_proposals/v1"
PROPOSALS, PROGRAMS = get_family("program_proposals"), get_family("programs")


def held_out_program() -> dict:
    return next(t.payload for t in PROGRAMS.tasks("heldout", 0, 3, 8))


def proposals(replies: list[str]) -> tuple[list[Trajectory], dict]:
    """One proposer prompt sampled once per reply (the FAKE model writes them), each audited for real."""
    harness = load_harness(PROPOSER)
    (prompt,) = PROPOSALS.tasks("train", 0, 2, 1)
    pair = Responder(harness, FakeModel(lambda p, k: replies[k]), "pair-proposer", family=PROPOSALS)
    trajectories = pair.episodes([prompt], SamplingParams(n=len(replies), max_new_tokens=60, temperature=1.0,
                                                          seed=0))
    verdicts = {t.id: audit(t, prompt, harness, PROPOSALS) for t in trajectories}
    return trajectories, verdicts


def test_each_rejected_proposal_names_the_contract_or_stage_rule_it_breaks() -> None:
    heldout = held_out_program()
    replies = ["x 4 add ; x=5",                  # accepted
               "x 4 add ; x=5",                  # the same program again: novel
               "x 2 mul 3 add 0 add ; x=1",      # accepted: its canonical form is x 2 mul 3 add
               "x 2 mul 3 add ; x=7",            # that canonical program again, another input: novel
               "x jmp:-1 ; x=1",                 # runs forever
               "x dup mul dup mul dup mul ; x=9",  # 9^8: beyond the machine's bound
               "x dup sub drop ; x=2",           # ends with nothing on the stack
               "x 0 mul 4 add ; x=3",            # constant: 4 whatever x
               "x 5 frob ; x=1",                 # not the machine's language
               f"{heldout['program']} ; x={heldout['input']}"]  # a held-out program
    trajectories, verdicts = proposals(replies)
    judged, tasks = judge(load_harness(PROPOSER), trajectories, verdicts, PROGRAMS, seen=set())
    by = [p.rejected_by for p in judged]
    assert by == [None, "novel", None, "novel", "family:proposal_terminates", "family:proposal_bounded",
                  "family:proposal_runs", "family:proposal_depends_on_input", "family:proposal_format",
                  "family:proposal_in_train"]
    assert [t.payload for t in tasks] == [{"program": "x 4 add", "input": 5},
                                          {"program": "x 2 mul 3 add 0 add", "input": 1}]
    assert [t.level for t in tasks] == [1, 2] and all(t.split == "train" for t in tasks)
    assert [t.answer for t in tasks] == [9, 5]
    # a proposal proposed in an earlier generation is not novel either
    again, _ = judge(load_harness(PROPOSER), trajectories[:1], verdicts, PROGRAMS, seen={judged[0].key})
    assert again[0].rejected_by == "novel"
    # above the levels the champion's harness can pose (the ceiling), a task is not trained on
    capped, kept = judge(load_harness(PROPOSER), trajectories[:3], verdicts, PROGRAMS, seen=set(), ceiling=1)
    assert [p.rejected_by for p in capped] == [None, "novel", "level_range"] and [t.level for t in kept] == [1]
    # nor below the family's first level: a program of no operation ('x' alone depends on its input)
    bare, bare_verdicts = proposals(["x ; x=3"])
    (judged_bare,), _ = judge(load_harness(PROPOSER), bare, bare_verdicts, PROGRAMS, seen=set())
    assert judged_bare.rejected_by == "level_range", judged_bare


def test_an_accepted_proposal_is_a_task_the_auditor_authenticates() -> None:
    """The solver's trajectory on a proposed task passes the audit like a drawn task's: the auditor derives the
    task from its payload (its split, level and answer are the family's, never the proposer's)."""
    trajectories, verdicts = proposals(["x 4 mul 1 sub ; x=3"])
    _, (task,) = judge(load_harness(PROPOSER), trajectories, verdicts, PROGRAMS, seen=set())
    solver = load_harness(REPO / "harness_versions/programs/v1")
    pair = Responder(solver, FakeModel(lambda p, k: ["11", "12"][k]), "pair-solver", family=PROGRAMS)
    right, wrong = pair.episodes([task], SamplingParams(n=2, max_new_tokens=7, temperature=1.0, seed=0))
    assert audit(right, task, solver, PROGRAMS).passed
    assert audit(wrong, task, solver, PROGRAMS).failed_rules() == ["answer_correct"]
    forged = task.model_copy(update={"answer": 12})
    assert "prompt_rendered" not in audit(wrong, forged, solver, PROGRAMS).failed_rules()
    assert not audit(wrong, forged, solver, PROGRAMS).passed  # the task itself is checked, not trusted


def test_a_family_rule_needs_an_answer_and_a_contract_names_only_rules_its_family_declares(tmp_path) -> None:
    trajectories, verdicts = proposals(["\nx 3 add ; x=5"])  # an empty first line: the line parser finds nothing
    (verdict,) = verdicts.values()
    detail = {r.rule: r.detail for r in verdict.rules}
    assert detail["family:proposal_terminates"].startswith("cannot judge: no answer")
    bad = tmp_path / "h"
    shutil.copytree(PROPOSER, bad)
    text = (bad / "hcp.toml").read_text()
    (bad / "hcp.toml").write_text(text.replace('"family:proposal_runs"', '"family:proposal_halts"'))
    with pytest.raises(UserError, match="family 'program_proposals' declares no rule 'proposal_halts'"):
        load_harness(bad)


def _solver(task_id: str, i: int, passed: bool) -> Trajectory:
    return Trajectory.build(task_id=task_id, pair_id="p", harness_id="h", sample_index=i, seed=0,
                            messages=(Message(role="user", content="q"), Message(role="assistant", content=str(i))),
                            tokens=TokenCounts(prompt=1, completion=1), timings=Timings(generate_s=0))


def test_the_proposer_learns_from_proposals_the_solver_solved_sometimes_not_always() -> None:
    def proposal(n: int, task: str | None) -> Proposal:
        return Proposal(trajectory_id=f"proposal-{n}", text="", rejected_by=None if task else "novel", task_id=task)

    proposed = Proposed(proposer_pair_id="p", proposals=(proposal(0, "always"), proposal(1, "never"),
                                                          proposal(2, "sometimes"), proposal(3, None)),
                        task_ids=("always", "never", "sometimes"), rejected_by_rule={"novel": 1}, seconds=0)
    solved = {"always": 8, "never": 0, "sometimes": 3}
    trajectories = [_solver(task, i, i < right) for task, right in solved.items() for i in range(8)]
    passed = {t.id for t in trajectories if int(t.messages[-1].content) < solved[t.task_id]}
    assert learnable(proposed, trajectories, passed, (0.125, 0.75)) == ["proposal-2"]
    assert learnable(proposed, trajectories, passed, (0.0, 1.0)) == ["proposal-0", "proposal-1", "proposal-2"]


def test_a_proposal_teaches_the_request_for_what_it_wrote() -> None:
    """Hindsight: asked for 2 operations, a proposal of 3 (canonical: ``0 add`` is dead) teaches the request for
    3, under the proposer's own prompt; the completion is the one sampled."""
    harness = load_harness(PROPOSER)
    trajectories, _ = proposals(["x 2 mul 3 add 0 add 5 mul ; x=1", "x 4 add ; x=5"])
    (asked,) = PROPOSALS.tasks("train", 0, 2, 1)
    three, one = (proposal_example(t, asked, harness) for t in trajectories)
    assert (three.prompt, three.level, three.completion) == ("propose 3 :", 3, "x 2 mul 3 add 0 add 5 mul ; x=1")
    assert (one.prompt, one.level) == ("propose 1 :", 1)
    assert harness.prompt(asked.payload) == "propose 2 :"  # what it was asked


def test_the_same_task_has_the_same_key_however_it_is_written() -> None:
    assert key_of(PROGRAMS, {"program": "x 3 add 0 add", "input": 1}) == key_of(PROGRAMS, {"program": "x 3 add",
                                                                                          "input": 4})
    assert key_of(PROGRAMS, {"program": "x 3 add", "input": 1}) != key_of(PROGRAMS, {"program": "x 3 sub",
                                                                                    "input": 1})
    assert programs.canonical("x 3 add 0 add") == "x 3 add"


def test_a_proposer_harness_must_propose_the_lineages_family(tmp_path: Path) -> None:
    from rsi.run import load_config
    from rsi.run.proposals import proposer_harness

    config = load_config("programs")
    assert proposer_harness(config, PROGRAMS).id == "program_proposals/v1"
    with pytest.raises(UserError, match="proposes tasks of 'programs', not 'addition' tasks"):
        proposer_harness(config, get_family("addition"))
    with pytest.raises(UserError, match="proposer.source 'self' needs proposer.harness"):
        load_config("programs", proposer={"harness": ""})
    assert proposer_harness(load_config("programs", proposer={"source": "generator"}), PROGRAMS) is None


TINY_PROGRAMS = {"family": "programs", "harness": "programs/v1", "steps": 300, "warmup": 20, "lr": 2e-3,
                 "train_levels": [1, 2], "level_weights": [1.0, 2.0],
                 "also": [{"family": "program_proposals", "harness": "program_proposals/v1", "train_levels": [1, 2],
                           "level_weights": [1.0, 2.0], "steps": 150}]}


@pytest.fixture(scope="module")
def programs_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny built-in base that learned programs' outputs and, as the proposer, to write such programs (cached
    in RSI_TEST_BASE_CACHE by recipe digest, like the tiny base)."""
    import os

    from rsi.basemodel import BaseRecipe, ensure_base
    from rsi.config import Settings
    from rsi.run import load_config

    home = Path(os.environ.get("RSI_TEST_BASE_CACHE") or tmp_path_factory.mktemp("base-home"))
    return ensure_base(Settings(home=home), BaseRecipe(**{**load_config("tiny").base_recipe, **TINY_PROGRAMS}))


def tiny_programs(source: str, lineage: str):
    from rsi.run import load_config

    return load_config("tiny", family="programs", lineage=lineage, harness="harness_versions/programs/v1",
                       base_recipe=TINY_PROGRAMS, selection={"band": [0.125, 0.75]},
                       proposer={"source": source, "harness": "harness_versions/program_proposals/v1",
                                 "tasks_per_level": 4})


@pytest.mark.slow
def test_a_programs_lineage_proposes_its_own_tasks(prefect_api, programs_base, rsi_home) -> None:
    """A real generation on the tiny base: every proposal is a stored trajectory with the auditor's verdict, the
    rule that rejected it is the verdict's (or the stage's), execute ran exactly the accepted proposals' tasks,
    the selection holds exactly the proposals the solver found learnable, and the proposals are published as a
    Prefect artifact. With the frozen proposer, none of its proposals is trained on."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from sqlalchemy import select as query

    from rsi.config import get_settings
    from rsi.flows.cycle import run_lineage
    from rsi.store import open_store
    from rsi.reaudit import reaudit_lineage
    from rsi.run import RunContext, open_run
    from rsi.store.records import load_dataset_rows, load_trajectories, longest_passed
    from rsi.store.schema import DatasetRow, Generation, StageRun, VerdictRow

    (rsi_home / "models").mkdir(parents=True, exist_ok=True)
    shutil.copytree(programs_base, rsi_home / "models" / programs_base.name)
    trained: dict[str, set[str]] = {}
    for source in ("self", "frozen"):
        (summary,) = run_lineage(tiny_programs(source, f"programs-{source}"), 1)
        store = open_store(get_settings().db_url)
        with store.session() as s:
            stages = {r.stage: r.result for r in s.scalars(query(StageRun).join(
                Generation, Generation.id == StageRun.generation_id).where(Generation.lineage == f"programs-{source}"))}
            proposed = Proposed.model_validate(stages["discover"]["proposed"])
            executed, ids = stages["execute"], [p.trajectory_id for p in proposed.proposals]
            verdicts = {v.trajectory_id: v for v in s.scalars(query(VerdictRow).where(
                VerdictRow.trajectory_id.in_(ids)))}
            solver, tasks = load_trajectories(s, executed["ids"])
            passed = {v.trajectory_id for v in s.scalars(query(VerdictRow).where(
                VerdictRow.trajectory_id.in_(executed["ids"]), VerdictRow.passed))}
            (dataset,) = s.scalars(query(DatasetRow).where(DatasetRow.digest == stages["select"]["digest"]))
            _, selected = load_dataset_rows(s, dataset.digest)
        store.dispose()
        assert len(proposed.proposals) == len(ids) == len(verdicts) > 0  # one verdict per proposal
        for p in proposed.proposals:
            failed = [r["rule"] for r in verdicts[p.trajectory_id].rules if not r["passed"]]
            assert (p.rejected_by in failed) if failed else (p.rejected_by in (None, *STAGE_RULES)), p
        accepted = {p.task_id for p in proposed.proposals if p.rejected_by is None}
        assert accepted, "the tiny base proposed no program the executor accepts"
        assert set(tasks) == accepted and all(t.split == "train" for t in tasks.values())
        learned = set(learnable(proposed, solver, passed, (0.125, 0.75)))
        trained[source] = set(selected) & set(ids)
        assert trained[source] == (learned if source == "self" else set())
        assert summary.selected == len(selected)
        config = tiny_programs(source, f"programs-{source}")
        with open_run(RunContext.of(config, get_settings())) as run:
            dataset, _ = run.data.load(dataset.digest, run.harnesses.start)  # as the train stage loads it
            roles = {e.trajectory_id: e.prompt.startswith("propose ") for e in dataset.examples}
            assert {i for i, proposer in roles.items() if proposer} == trained[source]  # its own harness's prompt
            if source == "frozen":  # its trajectories are the self lineage's (the same content, stored once)
                continue
            with run.store.session() as s:
                gen_id = s.scalars(query(Generation.id).where(Generation.lineage == config.lineage)).one()
                episode = longest_passed(s, gen_id)
            assert episode.id in executed["ids"]  # the published episode is the solver's, never a proposal
            again = reaudit_lineage(run.store, config.lineage, run.harnesses.start, run.settings.home)
            assert again.audited == len(executed["ids"])  # the proposer's trajectories keep their own verdicts
    assert trained["self"], "no proposal of the self arm landed in the learnability band on this tiny base"

    key = "programs-self-gen-1-proposals"
    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    rows = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
    assert artifact.type == "table" and len(rows) == len(ids), artifact
    assert [r["verdict"] for r in rows] == [p.rejected_by or "accepted" for p in proposed.proposals]
