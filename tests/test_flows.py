"""What crosses a flow or task boundary: JSON parameters that rebuild exactly the config, `--set` overrides,
and typed stage results validated when read back (no Prefect run, no model)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("profile", ["demo", "tiny"])
def test_flow_parameters_rebuild_exactly_the_config(profile) -> None:
    from flows.cycle import flow_parameters
    from rsi.cycle import load_config, parse_sets

    config = load_config(profile, lineage="x", seed=3, **parse_sets(["train.steps=7", "gate.alpha=0.1"]))
    params = json.loads(json.dumps(flow_parameters(config)))  # what a deployment stores and hands back
    named = {k: params[k] for k in ("family", "lineage", "harness")}
    again = load_config(params["profile"], **{**params["overrides"], **named})
    assert again == config and again.digest == config.digest


def test_set_overrides_merge_into_the_profile_key_by_key() -> None:
    from rsi.cycle import load_config, parse_sets

    tiny = load_config("tiny")
    config = load_config("tiny", **parse_sets(["train.steps=60", "curriculum.rule=accelerated", "eval_n=256"]))
    assert config.train.steps == 60 and config.train.batch_size == tiny.train.batch_size  # the rest kept
    assert config.curriculum.rule == "accelerated" and config.curriculum.max_level == tiny.curriculum.max_level
    assert config.eval_n == 256


@pytest.mark.parametrize("sets, named", [
    (["trian.steps=3"], "trian"),
    (["train.steps=-1"], "train.steps"),
    (["train.steps"], "KEY=VALUE"),
    (["gate=1", "gate.alpha=0.1"], "gate"),
])
def test_bad_overrides_name_the_field(sets, named) -> None:
    from rsi.cycle import load_config, parse_sets
    from rsi.errors import UserError

    with pytest.raises(UserError, match=named):
        load_config("tiny", **parse_sets(sets))


def test_stage_results_are_validated_when_read_back() -> None:
    from rsi.cycle import Registered, RuntimeFailure, Selected, read_result

    stored = Selected(digest="d" * 64, size=3, corrupted=False, frontier=2, replay=1).model_dump(mode="json")
    assert read_result("select", 4, stored) == Selected.model_validate(stored)
    assert read_result("register", 4, {"version": "2", "promoted": True}) == Registered(version="2", promoted=True)
    with pytest.raises(RuntimeFailure, match=r"select result of generation 4 .*size"):
        read_result("select", 4, {**stored, "size": "many"})
    with pytest.raises(RuntimeFailure, match=r"register result of generation 4 .*promote"):
        read_result("register", 4, {"version": "2", "promote": True})  # a renamed key fails at once
