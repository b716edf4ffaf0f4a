"""Splits by construction: train, heldout and test share no task at any level, whatever their seeds, and the
base never trains on a held-out or test pair. The overlap check is shown to catch a broken partition."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import subprocess
import sys

import pytest

from rsi.basemodel import BaseRecipe
from rsi.models import SPLITS
from rsi.task_generators.addition import pretraining_pairs
from rsi.tasks import TaskFamily, get_family

from .conftest import REPO

FAMILY = get_family("addition")


def pairs(family: TaskFamily, split: str, level: int, n: int, seeds: range = range(2)) -> set[tuple[int, int]]:
    """Operand pairs (both orders: a+b and b+a are one problem) drawn from ``split`` under several seeds."""
    found = set()
    for seed in seeds:
        for t in family.tasks(split, seed, level, n):
            a, b = t.payload["a"], t.payload["b"]
            found |= {(a, b), (b, a)}
    return found


def overlaps(family: TaskFamily, levels: range, n: int) -> dict[tuple[int, str, str], int]:
    """Shared pairs between every two splits, per level (empty when the partition holds)."""
    found = {}
    for level in levels:
        drawn = {split: pairs(family, split, level, n) for split in SPLITS}
        for x, y in itertools.combinations(SPLITS, 2):
            if shared := drawn[x] & drawn[y]:
                found[(level, x, y)] = len(shared)
    return found


def test_splits_share_no_pair_at_levels_1_to_12() -> None:
    assert overlaps(FAMILY, range(1, 13), 2000) == {}


def test_the_overlap_check_catches_a_broken_partition() -> None:
    """A family whose split key is not a function of the task (a broken partition) overlaps at once."""
    rng = random.Random(0)
    broken = dataclasses.replace(FAMILY, split_key=lambda payload: rng.random())
    assert overlaps(broken, range(1, 3), 200)


def test_base_pretraining_draws_train_pairs_only() -> None:
    """Every pair of the base's pretraining stream (the demo recipe, replayed) is a train pair."""
    recipe = BaseRecipe()
    held = set().union(*(pairs(FAMILY, split, level, 2000, range(3)) for split in ("heldout", "test")
                         for level in recipe.train_levels))
    seen = set()
    for a, b in pretraining_pairs(recipe):
        seen.add((a, b))
    assert len(seen) > 1000 and not seen & held
    assert {FAMILY.split_of({"a": a, "b": b}) for a, b in seen} == {"train"}


def test_sets_are_distinct_and_a_small_split_says_how_many_it_has() -> None:
    level1 = {split: sum(FAMILY.split_of({"a": a, "b": b}) == split for a in range(10) for b in range(10))
              for split in SPLITS}
    assert sum(level1.values()) == 100 and min(level1.values()) > 0
    for split in SPLITS:
        tasks = FAMILY.tasks(split, 0, 1, 256)
        assert len(tasks) == level1[split] == len({json.dumps(t.payload, sort_keys=True) for t in tasks})
        assert {t.split for t in tasks} == {split}
    big = FAMILY.tasks("heldout", 0, 5, 300)
    assert len(big) == 300 and len({(t.payload["a"], t.payload["b"]) for t in big}) == 300


def test_a_task_regenerates_from_its_coordinates() -> None:
    task = FAMILY.tasks("test", 5, 7, 3)[2]
    assert FAMILY.task(task.split, task.seed, task.level, task.index) == task


@pytest.mark.parametrize("split", ["heldout", "test"])
def test_cli_samples_a_split_and_reports_the_distinct_count(split: str) -> None:
    run = lambda s: subprocess.run([sys.executable, "-m", "rsi", "tasks", "sample", "addition", "--level", "2",  # noqa: E731
                                    "-n", "2000", "--split", s], capture_output=True, text=True, cwd=REPO, check=True)
    drawn = {s: run(s) for s in (split, "train")}
    got = {s: {(t["payload"]["a"], t["payload"]["b"]) for t in map(json.loads, r.stdout.splitlines())}
           for s, r in drawn.items()}
    assert not got[split] & got["train"]
    assert f"{len(got[split])} distinct {split} task(s) at level 2" in drawn[split].stderr
    bad = subprocess.run([sys.executable, "-m", "rsi", "tasks", "sample", "addition", "--level", "2", "--split", "dev"],
                         capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "expected one of train, heldout, test" in bad.stderr
