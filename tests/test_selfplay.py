"""bench/selfplay.py's arms differ from ``self`` only in the proposer's fields, and its summary compares them
at the budget from each cell's last champion."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_selfplay", REPO / "bench/selfplay.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_arm_differs_from_self_only_in_the_proposer_fields() -> None:
    bench = _bench()
    mine = bench.arm_config("self", 1).model_dump(mode="json")
    for arm in bench.ARMS:
        diff = bench.config_diff(mine, bench.arm_config(arm, 1).model_dump(mode="json"))
        assert set(diff) == ({"proposer.source"} if arm != "self" else set()), (arm, diff)
    assert bench.arm_config("generator", 1).proposer.source == "generator"
    assert bench.arm_config("self", 1).proposer.harness  # the profile names the proposer's harness


def cell(arm: str, seed: int, means: list[float], levels: list[float | None], budget: float = 1000.0) -> dict:
    gens = [{"generation": i, "loop_cpu_s": 100.0 * i, "test": {"1": m, "2": m},
             "executed": {"mean_level": lv, "rejected_by_rule": {"novel": 1}} if i else {}}
            for i, (m, lv) in enumerate(zip(means, [None, *levels]))]
    return {"arm": arm, "seed": seed, "budget_cpu_s": budget, "generations": gens}


def test_the_summary_reads_each_cells_last_champion_and_the_trained_levels() -> None:
    bench = _bench()
    cells = [cell("self", 0, [0.2, 0.5, 0.7], [1.0, 3.5]), cell("self", 1, [0.2, 0.4, 0.6], [1.0, 2.0]),
             cell("generator", 1, [0.2, 0.3], [2.0]), cell("generator", 0, [0.2, 0.6], [1.0])]  # paired by seed
    summary = bench.summarize(cells)
    assert abs(summary["at_budget"]["self"]["mean"] - 0.65) < 1e-9
    assert abs(summary["at_budget"]["generator"]["mean"] - 0.45) < 1e-9
    assert abs(summary["differences"]["self - generator"]["mean"] - 0.2) < 1e-9
    assert abs(summary["differences"]["self - base"]["mean"] - 0.45) < 1e-9
    assert summary["executed_level_growth"]["self"]["mean"] == 1.75  # (2.5 + 1.0) / 2
    assert summary["rejected_by_rule"]["self"] == {"novel": 4}


def test_a_generation_that_ends_past_the_budget_does_not_count() -> None:
    bench = _bench()
    # generation 2 ended at 200 CPU-s, past a budget of 150: the champion at the budget is generation 1's
    over = cell("self", 0, [0.2, 0.5, 0.9], [1.0, 2.0], budget=150.0)
    assert bench.at_budget(over) == 0.5
    assert bench.at_budget(cell("self", 0, [0.2, 0.5, 0.9], [1.0, 2.0], budget=50.0)) == 0.2  # only the base
