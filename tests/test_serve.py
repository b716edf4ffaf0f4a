"""Mixture-of-LoRA serving (``rsi.mol``): the specialist registry, the routers, and ``rsi serve`` answering the
official ``openai`` client over HTTP, on the tiny base with two real LoRA specialists (addition, sorting).

The specialists' lineages are state DB rows written here (a lineage, its harness, a pair, a promoted
generation) around adapters trained with ``rsi.train`` on the families' own answers, which takes seconds; the
cycle that would promote them is tested in test_cycle.py.
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from .conftest import REPO

ADDITION_LEVELS = (1, 2, 3)
SORTING_LEVELS = (1, 2)


def _train(base: Path, examples: list, out: Path, steps: int) -> Path:
    from rsi.select import Dataset
    from rsi.train import TrainSpec, train_adapter

    spec = TrainSpec(steps=steps, batch_size=16, warmup=4, lr=1e-2, lora_r=8, lora_alpha=16)
    train_adapter(base, None, Dataset(examples=tuple(examples)), spec, out, seed=0)
    return out


def addition_examples() -> list:
    from rsi.hcp import load_harness
    from rsi.parsers import digits_lsb
    from rsi.select import Example
    from rsi.tasks import get_family

    harness, family = load_harness("addition/v2"), get_family("addition")
    return [Example(trajectory_id=t.id, level=t.level, prompt=harness.prompt(t.payload),
                    completion=digits_lsb(t.answer, 11), source="frontier")
            for lvl in ADDITION_LEVELS for t in family.tasks("train", 11, lvl, 48)]


def sorting_examples() -> list:
    """The first turn of the expert's episodes: a list, then the call the expert makes first."""
    from rsi.episodes import demonstration
    from rsi.hcp import load_harness
    from rsi.select import Example
    from rsi.tasks import get_family

    harness, family = load_harness("sorting/v1"), get_family("sorting")
    return [Example(trajectory_id=t.id, level=lvl, prompt=harness.prompt(t.payload),
                    completion=demonstration(harness, family, t).messages[1].content, source="frontier")
            for lvl in SORTING_LEVELS for t in family.tasks("train", 11, lvl, 48)]


@pytest.fixture(scope="module")
def adapters(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two real LoRA specialists on the tiny base, trained once for this module."""
    root = tmp_path_factory.mktemp("specialists")
    return {"addition": _train(tiny_base, addition_examples(), root / "addition", 30),
            "sorting": _train(tiny_base, sorting_examples(), root / "sorting", 40)}


def promote(store, lineage: str, family: str, harness_ref: str, adapter: Path, base: Path, number: int = 1) -> None:
    """State DB rows of a lineage whose generation ``number`` is promoted with ``adapter`` on ``base``."""
    from rsi.basemodel import model_hash
    from rsi.cycle import load_config
    from rsi.hcp import load_harness
    from rsi.models import Pair
    from rsi.store.harnesses import lock_harness
    from rsi.store.schema import Generation, Lineage, PairRow
    from rsi.train import adapter_hash

    harness = load_harness(harness_ref)
    pair = Pair(base_model_hash=model_hash(base), adapter_hash=adapter_hash(adapter), harness_id=harness.id,
                harness_hash=harness.hash)
    with store.session() as s:
        lock_harness(s, harness)
        if s.get(Lineage, lineage) is None:
            s.add(Lineage(name=lineage, family=family, spec=load_config("tiny", family=family, lineage=lineage,
                                                                       harness=harness_ref).model_dump(mode="json")))
        if s.get(PairRow, pair.id) is None:
            s.add(PairRow(id=pair.id, lineage=lineage, base_model_hash=pair.base_model_hash,
                          adapter_hash=pair.adapter_hash, adapter_uri=str(adapter), harness_id=harness.id,
                          harness_hash=harness.hash))
        s.add(Generation(lineage=lineage, number=number, candidate_pair_id=pair.id, status="promoted"))


def seed_home(home: Path, base: Path) -> None:
    target = home / "models" / base.name
    if not target.exists():
        shutil.copytree(base, target)


@pytest.fixture
def served(adapters: dict[str, Path], tiny_base: Path, rsi_home: Path):
    """A state DB (SQLite in RSI_HOME) with the addition and sorting specialists admitted and an ngram router."""
    from rsi.mol.registry import Registry, add_specialist
    from rsi.mol.routers import train_router
    from rsi.store import open_store

    seed_home(rsi_home, tiny_base)
    store = open_store()
    promote(store, "addition", "addition", "harness_versions/addition/v2", adapters["addition"], tiny_base)
    promote(store, "sorting", "sorting", "harness_versions/sorting/v1", adapters["sorting"], tiny_base)
    add_specialist(store, "addition", description="adds two numbers", levels=ADDITION_LEVELS)
    add_specialist(store, "sorting", description="sorts digits by swaps", levels=SORTING_LEVELS)
    train_router("ngram", Registry(store, rsi_home).champions(), rsi_home, per_level=16)
    yield store
    store.dispose()


def test_registry_resolves_champions_and_follows_promotions(db_url, adapters, tiny_base, rsi_home) -> None:
    """Specialists are rows; the champion comes from the state DB and a new promotion is seen without a new
    Registry; bad names are user errors naming the fix. Keys verify by hash and stop at revocation."""
    from rsi.errors import UserError
    from rsi.mol import state
    from rsi.mol.registry import Registry, add_specialist, list_specialists, remove_specialist
    from rsi.store import open_store

    seed_home(rsi_home, tiny_base)
    store = open_store(db_url)
    with pytest.raises(UserError, match="lineage 'addition' is not in the state DB"):
        add_specialist(store, "addition")
    promote(store, "addition", "addition", "harness_versions/addition/v2", adapters["addition"], tiny_base)
    add_specialist(store, "addition", description="adds")
    with pytest.raises(UserError, match="exists already"):
        add_specialist(store, "addition")
    with pytest.raises(UserError, match="specialist name"):
        add_specialist(store, "addition", name="Bad Name")
    registry = Registry(store, rsi_home)
    first = registry.champions()["addition"]
    assert (first.generation, first.adapter_dir, first.harness.id) == (1, adapters["addition"], "addition/v2")
    promote(store, "addition", "addition", "harness_versions/addition/v2", adapters["sorting"], tiny_base, number=2)
    second = registry.champions()["addition"]
    assert (second.generation, second.adapter_dir) == (2, adapters["sorting"])
    assert [s.name for s in list_specialists(store)] == ["addition"]
    remove_specialist(store, "addition")
    assert registry.champions() == {}
    with pytest.raises(UserError, match="no specialist 'addition'"):
        remove_specialist(store, "addition")

    key = state.create_key(store, "alice")
    assert state.key_owner(store, key) == "alice" and state.key_owner(store, key + "x") is None
    assert key not in str(state.list_keys(store))
    state.revoke_key(store, "alice")
    assert state.key_owner(store, key) is None
    conv = state.new_conversation(store, "alice")
    state.append_messages(store, conv, [({"role": "user", "content": "hi"}, None)])
    state.append_messages(store, conv, [({"role": "assistant", "content": "yo"}, "addition")])
    assert state.conversation_messages(store, conv, "alice") == [
        ({"role": "user", "content": "hi"}, None), ({"role": "assistant", "content": "yo"}, "addition")]
    with pytest.raises(LookupError):
        state.conversation_messages(store, conv, "bob")  # another key's conversation is not found
    store.dispose()


def test_routers_on_the_heldout_routing_set(served, rsi_home, monkeypatch) -> None:
    """The ngram router separates the families on held-out tasks it never saw (macro-F1 >= 0.98) and sends
    small talk to the base; the route adapter picks by log P(name) and is as good on this pair of families."""
    from rsi.mol.evaluation import evaluate_router
    from rsi.mol.routers import LoraRouter, decide, load_router, routing_examples, train_router
    from rsi.mol.registry import Registry

    champions = Registry(served, rsi_home).champions()
    train = {e.task_id for e in routing_examples(champions, "train", 16)}
    heldout = routing_examples(champions, "heldout", 8)
    assert heldout and not train & {e.task_id for e in heldout}
    report = evaluate_router(served, rsi_home, "ngram", 8, 0.5, answers=False)
    assert report.macro_f1 >= 0.98 and report.n == len(heldout), report.confusion
    assert sum(report.confusion["addition"].values()) == sum(e.specialist == "addition" for e in heldout)
    ngram = load_router("ngram", rsi_home)
    assert decide(ngram, "hello, how are you today?", list(champions), 0.5).specialist is None

    monkeypatch.setattr(LoraRouter, "steps", 30)
    manifest = train_router("lora", champions, rsi_home, per_level=8)
    assert manifest["names"] == ["addition", "sorting"] and len(manifest["digest"]) == 64
    lora = evaluate_router(served, rsi_home, "lora", 8, 0.5, answers=False)
    assert lora.macro_f1 >= 0.98, lora.confusion
