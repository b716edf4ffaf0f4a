"""Gain decomposition (``rsi.decomposition``): the 2x2 of adapters x harnesses plus the untrained base, per task."""

from __future__ import annotations

import pytest

from rsi.decomposition import Decomposition, level_gain, metrics, over_no_training, rows
from rsi.evaluate import score


def scores(*outcomes: str, exhaustive: bool = False):
    return [score(3, [c == "1" for c in o], exhaustive=exhaustive) for o in outcomes]


def test_gains_are_paired_contrasts_that_add_up_to_the_total() -> None:
    # per task: parent (P,h), adapter only (C,h), harness only (P,H), candidate (C,H), base (B,H)
    parent, adapter_only, harness_only, candidate, base = scores(
        "00001111", "00111111", "01001111", "11111110", "00000011")
    g = level_gain(parent, adapter_only, harness_only, candidate, base)
    assert g.weights.value == pytest.approx(2 / 8) and g.harness.value == pytest.approx(1 / 8)
    assert g.interaction.value == pytest.approx((7 - 6 - 5 + 4) / 8)
    assert g.weights.value + g.harness.value + g.interaction.value == pytest.approx(g.candidate - g.parent)
    assert g.base == 2 / 8 and not g.exact
    # a normal interval of the mean contrast: weights' per-task contrasts are 0,0,1,1,0,0,0,0
    assert g.weights.low < g.weights.value < g.weights.high
    assert g.weights.high - g.weights.value == pytest.approx(1.959964 * (0.4629100 / 8 ** 0.5), rel=1e-5)


def test_every_task_of_the_split_scored_gives_exact_gains() -> None:
    g = level_gain(*scores("0011", "0111", "0011", "0111", "0001", exhaustive=True))
    assert g.exact and g.weights.low == g.weights.high == 0.25 and g.harness.low == g.harness.high == 0.0


def test_scores_of_other_tasks_are_refused() -> None:
    with pytest.raises(ValueError, match="same tasks"):
        level_gain(*scores("0011", "0111", "0011", "0111", "000"))


def test_clean_tasks_metrics_and_rows() -> None:
    g = level_gain(*scores("0000", "0000", "1100", "1110", "1000"), clean=[True, False, True, False])
    assert g.clean_n == 2 and g.clean_candidate == 1.0  # tasks 0 and 2: both solved by the candidate
    d = Decomposition(parent_pair_id="p", candidate_pair_id="c", parent_harness="h", harness="H",
                      splits={"test": (g,)})
    m = metrics(d)
    assert m["test_gain_harness_level_3"] == 0.5 and m["test_acc_base_level_3"] == 0.25
    assert m["test_acc_clean_level_3"] == 1.0
    assert over_no_training(d) == pytest.approx(0.75 - 0.25) and over_no_training(d, "heldout") is None
    (row,) = rows(d, "test")
    assert row["clean tasks"] == "1.000 of 2" and row["harness"].startswith("+0.500 [")
    assert Decomposition.model_validate(d.model_dump(mode="json")) == d
