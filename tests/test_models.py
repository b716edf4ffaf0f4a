"""Domain models and content hashes: stable across runs and machines, frozen where they are facts."""

from __future__ import annotations

import pydantic
import pytest

from rsi.hashing import canonical_json, digest
from rsi.models import Message, Pair, Task, TokenCounts, Timings, Trajectory


def test_canonical_json_ignores_key_order() -> None:
    assert canonical_json({"b": 1, "a": [1, "é"]}) == b'{"a":[1,"\\u00e9"],"b":1}'
    assert digest({"b": 1, "a": 2}) == digest({"a": 2, "b": 1})


def test_digests_are_the_same_bytes_everywhere() -> None:
    """Golden values: a change here changes every stored id, so it must be deliberate."""
    assert digest({"a": 1}) == "015abd7f5cc57a2dd94b7590f04ad8084273905ee33ec5cebeae62276a97f862"
    pair = Pair(base_model_hash="b", adapter_hash=None, harness_id="addition/v1", harness_hash="h")
    assert pair.id == "pair-" + digest(pair.model_dump(mode="json"))[:24]
    assert pair.id == Pair(**pair.model_dump()).id
    task = Task(family="addition", split="train", level=2, seed=0, index=3, payload={"a": 12, "b": 34}, answer=46)
    assert task.id == Task.model_validate_json(task.model_dump_json()).id
    assert task.id != task.model_copy(update={"index": 4}).id


def test_models_are_frozen_and_strict() -> None:
    task = Task(family="addition", split="train", level=1, seed=0, index=0, payload={"a": 1, "b": 2}, answer=3)
    with pytest.raises(pydantic.ValidationError):
        task.level = 2  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        Task(family="addition", split="train", level=0, seed=0, index=0, payload={}, answer=0)
    with pytest.raises(pydantic.ValidationError):
        Message(role="robot", content="hi")  # type: ignore[arg-type]


def test_trajectory_completion_is_last_assistant_message() -> None:
    traj = Trajectory(
        id="t", task_id="task", pair_id="pair", harness_id="addition/v1", sample_index=0, seed=0,
        messages=(Message(role="user", content="1+2="), Message(role="assistant", content="3")),
        tokens=TokenCounts(prompt=4, completion=2), timings=Timings(generate_s=0.01),
    )
    assert traj.completion == "3"
    assert Trajectory.model_validate_json(traj.model_dump_json()) == traj
