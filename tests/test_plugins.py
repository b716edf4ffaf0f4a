"""One registry (``rsi.plugins``): rsi's own plugins by decorator, another package's by entry point.

The family ``parity`` lives in ``tests/plugin_parity`` with its answer parser and harness proposer; a throwaway
distribution (a dist-info folder on ``sys.path``, nothing else) declares them by entry point, and rsi poses,
validates, proposes and scores under them without one file of ``rsi/`` naming them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rsi import plugins
from rsi.errors import UserError

from .conftest import REPO
from .fakes import FakeModel

PARITY = {"rsi.families": {"parity": "tests.plugin_parity:family"},
          "rsi.parsers": {"yes_no": "tests.plugin_parity:yes_no"},
          "rsi.proposers": {"parity": "tests.plugin_parity:propose"}}
HCP = """hcp_version = "1.0"
id = "parity"
version = "v1"
family = "parity"

[prompt]
template = "prompt.j2"
vars = { question = "odd?" }

[decoding]
max_new_tokens = 4

[limits]
max_prompt_tokens = 200
max_completion_tokens = 4

[answer]
parser = "yes_no"
template = "answer.j2"

[contract]
version = "2"
rules = ["ids_consistent", "prompt_rendered", "messages_allowed", "limits", "stopped", "answer_format",
         "no_extra_content", "answer_correct"]
"""


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Install a throwaway distribution declaring ``groups`` of entry points (group -> name -> target); the
    registry as it was comes back after the test (rsi's own registered first, so none lands only in the copy)."""
    for kind in plugins.GROUPS:
        plugins.names(kind)
    monkeypatch.setattr(plugins, "_registry", {kind: dict(found) for kind, found in plugins._registry.items()})
    monkeypatch.setattr(plugins, "_from_entry_points", {})

    def install(groups: dict[str, dict[str, str]], name: str = "rsi-parity") -> None:
        dist = tmp_path / "site" / f"{name.replace('-', '_')}-0.1.dist-info"
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text("".join(
            f"[{group}]\n" + "".join(f"{n} = {target}\n" for n, target in eps.items()) + "\n"
            for group, eps in groups.items()))
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
        plugins.reload_entry_points()

    return install


def parity_harness(folder: Path):
    from rsi.hcp import load_harness

    folder.mkdir(parents=True)
    (folder / "hcp.toml").write_text(HCP)
    (folder / "prompt.j2").write_text("{{ task.bits }} {{ vars.question }} ")
    (folder / "answer.j2").write_text("{{ 'yes' if answer else 'no' }}")
    return load_harness(folder)


def answers(right: bool):
    """The FAKE model's policy: the right parity of the bits in the prompt, or the wrong one."""
    return lambda prompt, k: "yes" if (prompt.split()[0].count("1") % 2 == 1) == right else "no"


def test_a_family_from_another_package_is_posed_validated_proposed_and_scored(install, tmp_path: Path) -> None:
    from rsi.evaluate import evaluate
    from rsi.pair import Responder
    from rsi.proposers import propose
    from rsi.store import open_store
    from rsi.store.harnesses import store_proposal
    from rsi.tasks import family_names, get_family

    assert "parity" not in family_names()
    install(PARITY)
    assert "parity" in family_names() and get_family("parity").name == "parity"
    assert "yes_no" in plugins.names("parser") and "parity" in plugins.names("proposer")
    harness = parity_harness(tmp_path / "parity" / "v1")  # validation renders tasks and reads answers back
    proposals = propose(harness, ["parity"], {"question": ["an odd number of ones?"]})
    with open_store(f"sqlite:///{tmp_path}/rsi.db").session() as s:
        (stored,) = [store_proposal(s, p.document, p.sources, tmp_path) for p in proposals]
    assert stored.prompt({"bits": "101"}) == "101 an odd number of ones? "
    for right, accuracy in ((True, 1.0), (False, 0.0)):
        pair = Responder(stored, FakeModel(answers(right)), "pair-x")
        assert [sc.accuracy for sc in evaluate(pair, [3, 8], 16)] == [accuracy, accuracy]
    rsi_code = [p for p in (REPO / "rsi").rglob("*.py") if "parity" in p.read_text() or "yes_no" in p.read_text()]
    assert rsi_code == []  # it touched no file of rsi


def test_the_task_generators_group_still_registers_families(install) -> None:
    """Families were registered in ``rsi.task_generators`` before ``rsi.families``: such a package still works."""
    from rsi.tasks import get_family

    install({"rsi.task_generators": {"parity": "tests.plugin_parity:family"}})
    assert get_family("parity").name == "parity"


def test_unknown_and_broken_plugins_are_user_errors_naming_the_fix(install) -> None:
    from rsi.backends import get_backend
    from rsi.run import load_config
    from rsi.tasks import get_family

    install({"rsi.families": {"broken": "tests.no_such_module:family", "notafamily": "tests.plugin_parity:make"}})
    with pytest.raises(UserError, match=r"unknown generation backend 'hff'; did you mean 'hf'\?; known backends: hf"):
        get_backend("hff")
    with pytest.raises(UserError, match=r"task family 'broken' \(entry point 'tests.no_such_module:family' in "
                                        r"rsi.families\) failed to load: ModuleNotFoundError"):
        get_family("broken")
    with pytest.raises(UserError, match="task family 'notafamily' is a function, not a rsi.tasks.TaskFamily"):
        get_family("notafamily")
    with pytest.raises(UserError, match=r"field 'train.trainer'.*unknown trainer 'lop'; known trainers: loop, trl"):
        load_config("tiny", train={"trainer": "lop"})
    with pytest.raises(UserError, match=r"field 'curriculum.rule'.*known rules: accelerated, plus_one"):
        load_config("tiny", curriculum={"rule": "plus_two"})


def test_listing_plugins_imports_no_model_code() -> None:
    """Backends register lazily: naming them, as a config's validation does, imports no torch."""
    code = ("import sys; from rsi import plugins; "
            "print(plugins.names('backend'), plugins.names('runner'), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.split() == ["['hf',", "'openai']", "['local',", "'ray']", "False"]


def test_a_selection_policy_from_another_package_chooses_the_examples(install) -> None:
    from rsi.run import load_config
    from rsi.select import Candidate, SelectionSpec, select

    attempts = [Candidate(trajectory_id=f"t{i}", task_id="a", level=1, prompt="p", completion=text, passed=ok)
                for i, (text, ok) in enumerate([("1", True), ("12345", False), ("123", True), ("12", True)])]

    def kept(spec: SelectionSpec) -> list[str]:
        return [e.trajectory_id for e in select(attempts, [], spec, frontier_levels={1}, seed=0).examples]

    assert kept(SelectionSpec()) == ["t0"]  # rsi's own: the first distinct passed completion (cap 1)
    assert kept(SelectionSpec(cap_per_task=3)) == ["t0", "t2", "t3"]
    with pytest.raises(UserError, match=r"field 'selection.policy'.*unknown selection policy 'longest'"):
        load_config("tiny", selection={"policy": "longest"})
    install({"rsi.selections": {"longest": "tests.plugin_parity:longest"}})
    assert load_config("tiny", selection={"policy": "longest"}).selection.policy == "longest"
    assert kept(SelectionSpec(policy="longest")) == ["t2"]  # the longest passed one; t1 is longer but failed


def test_a_field_added_at_its_default_keeps_the_stored_lineages_keys() -> None:
    """Every stage result is stored under a key that includes the config's digest: a config field added later
    (``selection.policy``) leaves the digest of a config at its default as it was, so an existing RSI_HOME
    continues its lineage instead of redoing its stages. The digest below is the tiny profile's before the field,
    with the harness proposers it had then (the default was ``addition``'s enumeration until the generic operators
    replaced it: a changed default is a changed config, and its digest changes)."""
    from rsi.run import load_config

    tiny = "650afb8a5ade21d32632a67e6cd84f80c79b7ac5189360521b5826f6844ae559"
    before = {"harness_search": {"proposers": ["addition"]}}
    assert load_config("tiny", **before).digest == tiny
    assert load_config("tiny", selection={"policy": "distinct_passed"}, **before).digest == tiny
    assert load_config("tiny", harness_search={"proposers": ["addition"], "gates": 2, "screen_n": 32},
                       start_adapter=None).digest == tiny  # the search's later fields, at their defaults
    assert load_config("tiny").digest != tiny


def test_a_family_package_ships_its_profile(install, tmp_path: Path) -> None:
    from rsi.run import load_config, profile_for

    install({**PARITY, "rsi.profiles": {"parity": "tests.plugin_parity:profile", "bad": "tests.plugin_parity:make"}})
    assert profile_for(None, "parity") == "parity" and profile_for(None, "nothing") == "demo"
    harness = parity_harness(tmp_path / "parity" / "v1")
    config = load_config(profile_for(None, "parity"), harness=str(harness.folder))
    assert (config.family, config.target_level, config.harness_search.proposers) == ("parity", 8, ("parity",))
    with pytest.raises(UserError, match="profile 'bad' is a function, not a mapping of config fields"):
        load_config("bad")
    with pytest.raises(UserError, match=r"unknown profile 'parityy'; did you mean 'parity'\?"):
        load_config("parityy")


def test_a_family_package_teaches_the_built_in_base_its_own_text(install, tmp_path: Path) -> None:
    """A family's base pretraining is a plugin too: the base learns parity as the package says (no harness), its
    build measured by the package's own measure; without it, a base of parity needs a harness (episodes)."""
    import json

    from rsi.basemodel import BaseRecipe, train_base

    small = {"family": "parity", "train_levels": (6, 8), "level_weights": (1.0, 1.0), "steps": 60, "warmup": 4,
             "batch_size": 16, "d_model": 64, "n_heads": 2, "intermediate_size": 128}
    with pytest.raises(ValueError, match="set harness for a family other than addition "):
        BaseRecipe(**small)
    install({**PARITY, "rsi.pretraining": {"parity": "tests.plugin_parity:pretraining"}})
    recipe = BaseRecipe(**small)
    with pytest.raises(ValueError, match="set harness for a family other than addition, parity"):
        BaseRecipe(**small, harness="parity/v1")
    losses: list[float] = []
    train_base(recipe, tmp_path / "base", progress=lambda step, total, loss: losses.append(loss), eval_n=64)
    meta = json.loads((tmp_path / "base" / "rsi_recipe.json").read_text())
    assert set(meta["greedy"]) == {"6", "8"} and meta["pass_at_8"] == {}  # the package's measure, its levels
    assert all(0.0 <= v <= 1.0 for v in meta["greedy"].values())
    assert len(losses) == 60 and sum(losses[-10:]) < sum(losses[:10])  # it learned from the package's batches
