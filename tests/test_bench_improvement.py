"""bench/improvement.py: its statistics, and one real run of all its arms on the tiny profile."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_improvement", REPO / "bench/improvement.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mean_over_seeds_uses_a_t_interval_and_one_seed_its_wilson_interval():
    across_seeds = _bench().across_seeds
    cell = {"accuracy": 0.5, "ci_low": 0.3, "ci_high": 0.7, "n": 16}
    three = [{"scores": {"lineage": {4: {**cell, "accuracy": a}}}} for a in (0.4, 0.5, 0.6)]
    got = across_seeds(three, "lineage", 4)
    assert got["mean"] == pytest.approx(0.5)
    assert got["high"] - got["mean"] == pytest.approx(4.303 * 0.1 / 3**0.5)  # t(0.975, df=2) * sd / sqrt(3)
    one = across_seeds(three[:1], "lineage", 4)
    assert (one["low"], one["high"], one["interval"]) == (0.3, 0.7, "wilson95, one seed")


@pytest.mark.slow
def test_every_arm_runs_and_is_scored_on_every_level(tmp_path: Path):
    out = tmp_path / "improvement.json"
    subprocess.run([sys.executable, "bench/improvement.py", "--profile", "tiny", "--generations", "1", "--seeds", "1",
                    "--out", str(out)], cwd=REPO, check=True, timeout=1200)
    result = json.loads(out.read_text())
    assert result["arms"] == ["base", "lineage", "control", "label_free", "upper_bound"]
    seed = result["per_seed"][0]
    for arm in result["arms"]:
        assert list(seed["scores"][arm]) == [str(level) for level in range(1, 7)]  # tiny: levels 1..6
        assert all(0 <= c["ci_low"] <= c["accuracy"] <= c["ci_high"] <= 1 for c in seed["scores"][arm].values())
    assert len(seed["round_log"]["label_free"]) == len(seed["round_log"]["upper_bound"]) == result["rounds"][0]
