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
