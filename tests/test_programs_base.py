"""bench/programs_base.py's research device: programs padded with no-op pairs, and a base build that learns from
them while every other draw of the family stays its own."""

from __future__ import annotations

import random

from bench import programs_base as bench
import rsi.basemodel as basemodel
from rsi.basemodel import BaseRecipe, build_tokenizer
from rsi.task_generators import programs


def test_pad_writes_the_same_program_longer() -> None:
    """No-op pairs inserted: the output on every input, the canonical program, its level and its split stay; each
    pair is a step more of the run. A program with jumps comes back as it is."""
    rng = random.Random(0)
    for level in (1, 2, 5, 9):
        for task in programs.family.tasks("train", 0, level, 20):
            padded = bench.pad(rng, task.payload, 4)
            assert len(padded["program"].split()) == len(task.payload["program"].split()) + 8
            assert programs.canonical(padded["program"]) == programs.canonical(task.payload["program"])
            assert programs.level_of(padded) == level and programs.family.split_of(padded) == "train"
            assert [programs.run(padded["program"], x).output for x in range(-3, 10)] == \
                [programs.run(task.payload["program"], x).output for x in range(-3, 10)]
    jumps = {"program": "x jz:1 1 2 add", "input": 0}
    assert bench.pad(rng, jumps, 3) == jumps


def test_rewritten_demonstrations_are_the_same_tasks_written_longer() -> None:
    """Inside ``rewritten``, the base's demonstrations are its tasks' programs padded (longer, the same canonical
    program and answer, the run of the padded program taught); outside, the family draws its own tasks again.
    (The build's batches read the module's ``_demonstrations``, as this test does.)"""
    recipe = BaseRecipe(family="programs", harness="programs/v2", train_levels=(2,), level_weights=(1.0,),
                        max_position_embeddings=1024)
    tok = build_tokenizer()
    rows = basemodel._demonstrations(recipe)[2]
    with bench.rewritten(3):
        longer = basemodel._demonstrations(recipe)[2]
    assert basemodel._demonstrations(recipe)[2] == rows and programs.family.tasks("test", 0, 3, 5) == \
        programs.family.tasks("test", 0, 3, 5)
    assert len(longer) == len(rows) > 100
    assert sum(len(ids) for ids, _ in longer) > 1.5 * sum(len(ids) for ids, _ in rows)
    padded_rows = 0
    for long_ids, labels in longer[:200]:
        padded, x = tok.decode(long_ids[1:]).split(" =", 1)[0].split(" ; x=")
        payload = {"program": padded, "input": int(x)}
        assert programs.level_of(payload) == 2 and programs.family.split_of(payload) == "train"
        taught = tok.decode([t for t in labels if t != -100]).replace("<eos>", "").strip()
        assert taught == programs.worked(payload)  # the padded program's run, ending in its output
        assert taught.rsplit(" ", 1)[-1] == str(programs.run(padded, int(x)).output)
        padded_rows += padded != programs.canonical(padded)
    assert padded_rows > 100  # k = 0 for about a quarter
