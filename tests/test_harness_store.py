"""The pair's harness as data: the content-addressed harness store, answer templates, migration of audited
answers to another harness, and re-auditing a lineage under another contract."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rsi.audit import audit
from rsi.errors import UserError
from rsi.hcp import load_harness
from rsi.migrate import rerender
from rsi.models import Message, TokenCounts, Timings, Trajectory
from rsi.parsers import get_parser
from rsi.store import open_store
from rsi.store.harnesses import find_row, lock_harness, store_new, store_proposal, stored_harness
from rsi.tasks import get_family

from .conftest import REPO

ADDITION = get_family("addition")


def wide(harness, width: int, version: str) -> tuple[dict, dict]:
    """The document and templates of ``harness`` at another width, with an answer template."""
    doc = harness.document.model_dump(mode="json")
    doc["version"] = version
    doc["prompt"]["vars"]["width"] = width
    doc["answer"] |= {"params": {"width": width + 1}, "template": "templates/answer.j2"}
    doc["decoding"]["max_new_tokens"] = doc["limits"]["max_completion_tokens"] = width + 2
    doc["limits"]["max_prompt_tokens"] = 2 * width + 4
    sources = dict(harness.sources) | {"templates/answer.j2": "{{ answer | digits_lsb(vars.width + 1) }}"}
    return doc, sources


def test_a_used_harness_loads_from_the_state_db_when_its_folder_is_gone(tmp_path: Path) -> None:
    folder = tmp_path / "addition" / "v2"
    shutil.copytree(REPO / "harness_versions/addition/v2", folder)
    harness = load_harness(folder)
    store = open_store(f"sqlite:///{tmp_path}/rsi.db")
    with store.session() as s:
        lock_harness(s, harness)
    shutil.rmtree(folder)
    with store.session() as s:
        by_id, by_at, by_hash = (stored_harness(s, ref, tmp_path / "home") for ref in
                                 ("addition/v2", "addition@v2", harness.hash[:12]))
    assert by_id.hash == by_at.hash == by_hash.hash == harness.hash
    assert by_id.path == tmp_path / "home/harnesses/addition/v2/hcp.toml"
    assert by_id.prompt({"a": 12, "b": 34}) == harness.prompt({"a": 12, "b": 34})
    with store.session() as s, pytest.raises(UserError, match="not in the state DB's harness store"):
        stored_harness(s, "addition/v7", tmp_path / "home")


def test_a_proposed_harness_is_validated_like_a_shipped_one_and_stored_once(tmp_path: Path) -> None:
    v2 = load_harness("addition/v2")
    store = open_store(f"sqlite:///{tmp_path}/rsi.db")
    doc, sources = wide(v2, 16, "v2.w16")
    with store.session() as s:
        stored = store_new(s, doc, sources, tmp_path)
        assert find_row(s, stored.hash[:10]).id == "addition/v2.w16"
        assert store_new(s, doc, sources, tmp_path).hash == stored.hash  # the same content: the same harness
    assert stored.prompt({"a": 12, "b": 34}) == "2100000000000000+4300000000000000="
    bad = dict(doc, decoding=dict(doc["decoding"], max_new_tokens=99))
    with store.session() as s, pytest.raises(UserError, match=r"\(99\) exceeds limits.max_completion_tokens"):
        store_new(s, bad | {"version": "v2.bad"}, sources, tmp_path)
    changed = dict(doc, description="same id, other content")
    with store.session() as s, pytest.raises(UserError, match="immutable"):
        store_new(s, changed, sources, tmp_path)


def test_a_candidate_proposed_again_from_another_parent_is_the_stored_one(tmp_path: Path) -> None:
    """A search from v2 stores chunks3 and chunks4; after chunks3 is adopted, the next search proposes chunks4
    again, named by the same content but described as proposed from chunks3: it is the stored chunks4, not a
    changed harness (an ablation lineage stopped on this). A proposal whose content differs is still refused."""
    from rsi.task_generators.addition import formats as addition_formats

    store = open_store(f"sqlite:///{tmp_path}/rsi.db")
    with store.session() as s:
        first = {p.document["version"]: store_proposal(s, p.document, p.sources, tmp_path)
                 for p in addition_formats(load_harness("addition/v2"), {"chunk": [3, 4]})}
        chunks3 = next(h for version, h in first.items() if version.startswith("v2.chunks3"))
        (again,) = [p for p in addition_formats(chunks3, {"chunk": [4]})]
        stored = first[again.document["version"]]
        assert again.document["description"] != stored.document.description  # it names its parent
        assert store_proposal(s, again.document, again.sources, tmp_path).hash == stored.hash
        with pytest.raises(UserError, match="immutable"):  # as a person's edit of a stored version, refused
            store_new(s, again.document, again.sources, tmp_path)
        other = again.document | {"decoding": again.document["decoding"] | {"max_new_tokens": 11}}
        with pytest.raises(UserError, match="immutable"):
            store_proposal(s, other, again.sources, tmp_path)


def test_an_answer_template_must_write_what_the_parser_reads(tmp_path: Path) -> None:
    v2 = load_harness("addition/v2")
    doc, sources = wide(v2, 12, "v2.w12")
    store = open_store(f"sqlite:///{tmp_path}/rsi.db")
    sources["templates/answer.j2"] = "{{ answer | digits_lsb(vars.width) }}"  # one digit short
    with store.session() as s, pytest.raises(UserError, match="field 'answer.template'.*reads back"):
        store_new(s, doc, sources, tmp_path)
    sources["templates/answer.j2"] = "{{ (answer + 1) | digits_lsb(vars.width + 1) }}"  # parses, but wrong
    with store.session() as s, pytest.raises(UserError, match="which the verifier rejects"):
        store_new(s, doc, sources, tmp_path)


def test_an_audited_answer_migrates_to_a_wider_harness_and_passes_its_audit(tmp_path: Path) -> None:
    v2 = load_harness("addition/v2")
    store = open_store(f"sqlite:///{tmp_path}/rsi.db")
    with store.session() as s:
        w16 = store_new(s, *wide(v2, 16, "v2.w16"), tmp_path)
    task = ADDITION.task("train", 3, 7, 0)
    reply = str(task.answer)[::-1].ljust(11, "0")
    traj = Trajectory.build(task_id=task.id, pair_id="pair-x", harness_id=v2.id, sample_index=0, seed=0,
                            messages=(Message(role="user", content=v2.prompt(task.payload)),
                                      Message(role="assistant", content=reply)),
                            tokens=TokenCounts(prompt=23, completion=12), timings=Timings(generate_s=0.0))
    assert audit(traj, task, v2, ADDITION).passed
    example = rerender(traj, task, v2, w16)
    assert example.prompt == w16.prompt(task.payload) and len(example.completion) == 17
    parsed = get_parser("reversed_digits")(example.completion, width=17)
    assert parsed.ok and parsed.value == task.answer
    migrated = Trajectory.build(task_id=task.id, pair_id="pair-y", harness_id=w16.id, sample_index=0, seed=0,
                                messages=(Message(role="user", content=example.prompt),
                                          Message(role="assistant", content=example.completion)),
                                tokens=TokenCounts(prompt=35, completion=18), timings=Timings(generate_s=0.0))
    assert audit(migrated, task, w16, ADDITION).passed  # what migration trains on is what the new contract accepts
    assert rerender(traj, task, v2, v2).completion == reply  # same harness: the sample as it was


@pytest.mark.slow
def test_reaudit_reports_the_class_a_stricter_contract_rejects(prefect_api, tiny_base, rsi_home, tmp_path) -> None:
    """A tiny lineage, then the same harness with a completion limit one token short of a full reply: every
    trajectory that passed before is now rejected, by the two rules about reply length (`limits`: too many
    tokens; `stopped`: a stop cannot fit in max_new_tokens) and by no other, reported by rule and stored."""
    from sqlalchemy import func, select

    from rsi.store.schema import VerdictRow

    from .test_cycle import run_tiny, seed_home

    seed_home(rsi_home, tiny_base)
    run_tiny(1)
    strict = tmp_path / "strict"
    shutil.copytree(REPO / "harness_versions/addition/v2", strict)
    text = (strict / "hcp.toml").read_text()
    text = text.replace('version = "v2"', 'version = "v2-strict"').replace("max_new_tokens = 12", "max_new_tokens = 11")
    (strict / "hcp.toml").write_text(text.replace("max_completion_tokens = 12", "max_completion_tokens = 11"))
    store = open_store()
    with store.session() as s:
        before = s.scalar(select(func.count()).select_from(VerdictRow))
    cli = [sys.executable, "-m", "rsi", "audit", "--lineage", "addition", "--harness", str(strict), "--json"]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    rules = {r["rule"]: r for r in report["rules"]}
    assert report["passed_before"] > 0 and report["passed_now"] == 0
    assert report["newly_failed"] == report["passed_before"]
    assert rules["limits"]["newly_failing"] == rules["stopped"]["newly_failing"] == report["passed_before"]
    assert all(r["newly_failing"] == 0 for name, r in rules.items() if name not in ("limits", "stopped"))
    assert "completion tokens > max_completion_tokens 11" in rules["limits"]["example"]
    with store.session() as s:
        after = s.scalar(select(func.count()).select_from(VerdictRow))
    assert after == before + report["audited"] == before + report["stored"]
    table = subprocess.run(cli[:-1], capture_output=True, text=True, timeout=600)
    assert table.returncode == 0 and "newly rejected" in table.stdout and "stored 0 new verdict(s)" in table.stdout
