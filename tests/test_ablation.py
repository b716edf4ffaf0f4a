"""bench/ablation.py's arms and the cycle switches they turn: every arm differs from ``full`` only in its own
fields; label-free scoring and selection use no ground truth; the truth labels are the true answers; a lineage
that trains no weights still searches harnesses (paired with the untrained base)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from rsi.backends.base import SamplingParams
from rsi.evaluate import agreed, evaluate
from rsi.hcp import load_harness
from rsi.models import Message, Timings, TokenCounts, Trajectory
from rsi.pair import Responder
from rsi.parsers import digits_lsb
from rsi.tasks import get_family

from .fakes import FakeModel, voters

REPO = Path(__file__).resolve().parent.parent
FAMILY = get_family("addition")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_ablation", REPO / "bench/ablation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dotted(overrides: dict, prefix: str = "") -> set[str]:
    return {p for k, v in overrides.items()
            for p in (dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}"})}


@pytest.mark.parametrize("profile", ["demo", "sorting"])
def test_every_arm_differs_from_full_only_in_the_fields_that_name_it(profile):
    bench = _bench()
    shared = {"generations": 3, "eval_n": 64, "curriculum": {"max_level": 12}}
    config = bench.arm_config("full", profile, shared, 1, 0)
    full = config.model_dump(mode="json")
    for arm, skipped in bench.arms_for(config).items():
        diff = bench.config_diff(full, bench.arm_config(arm, profile, shared, 1, 0).model_dump(mode="json"))
        assert set(diff) <= dotted(bench.ARMS[arm][0]), (arm, diff)  # a field full already has drops out
        assert bool(diff) is (arm != "full") or skipped, (arm, diff)
    assert bench.config_diff(full, bench.arm_config("full", profile, shared, 2, 0).model_dump(mode="json")) == {
        "base_recipe.seed": [1, 2]}  # a cell's seeds are not arm fields: they differ across cells, never arms


def test_the_stored_results_record_each_arms_diff_and_commit():
    bench = _bench()
    results = sorted((REPO / "bench/results").glob("ablation-*.json"))
    for path in results:
        result = json.loads(path.read_text())
        assert result["provenance"]["commit"] and result["provenance"]["clean"], path
        for cell in result["cells"]:
            for arm, record in cell["arms"].items():  # a field full already has drops out (sorting: no search)
                diff = set(record["config_diff"])
                assert diff <= dotted(bench.ARMS[arm][0]) and bool(diff) is (arm != "full"), (path, arm, diff)


def test_the_claimed_difference_is_over_cells_against_the_best_single_component_arm():
    bench = _bench()

    def cell(accs: dict[str, float]) -> dict:
        return {"arms": {a: {"test": {"levels": {"1": {"accuracy": v}, "2": {"accuracy": v}}}, "loop_cpu_s": 1.0,
                             "test_cpu_s": 1.0} for a, v in accs.items()}}

    arms = {"base": 0.1, "base+harness": 0.3, "weights": 0.5, "harness": 0.4, "full": 0.7, "control": 0.1,
            "label_free": 0.2, "upper_bound": 0.9}
    cells = [cell({a: v + d for a, v in arms.items()} | {"full": arms["full"] + 2 * d}) for d in (0.0, 0.02, 0.04)]
    summary = bench.summarize(cells)
    assert summary["best_single_component"] == "weights"
    claim = summary["differences"]["full - weights"]
    assert claim["mean"] == pytest.approx(0.22)  # per cell 0.2, 0.22, 0.24
    assert claim["high"] - claim["mean"] == pytest.approx(4.303 * 0.02 / 3**0.5)  # t(0.975, 2) * sd / sqrt(3)


def test_label_free_scores_self_agreement_and_never_the_truth():
    """A model always wrong the same way agrees with itself fully (and scores 0 against the truth); one split 4-4
    agrees on nothing: the score reads the samples, not the answers."""
    v2 = load_harness("addition/v2")
    wrong, split, right = FakeModel(voters(0)), FakeModel(voters(4)), FakeModel(voters(8))
    for backend, agreement, truth in ((wrong, 1.0, 0.0), (split, 0.0, None), (right, 1.0, 1.0)):
        pair = Responder(v2, backend, "pair-x", family=FAMILY)
        scored = evaluate(pair, [3, 4], 16, agreement=True)
        assert [sc.accuracy for sc in scored] == [agreement, agreement] and scored[0].decoding == "agreement"
        if truth is not None:
            assert [sc.accuracy for sc in evaluate(pair, [3], 16)] == [truth]
    tasks = FAMILY.tasks("heldout", 0, 3, 8)
    broken = [t.model_copy(update={"answer": -1}) for t in tasks]  # answers the scoring must not read
    params = SamplingParams(max_new_tokens=12, n=8, temperature=1.0)
    pair = Responder(v2, wrong, "pair-x", family=FAMILY)
    with_truth = agreed(pair, tasks, params)
    assert list(agreed(pair, broken, params).values()) == list(with_truth.values())


def trajectory(task, text: str, i: int) -> Trajectory:
    v2 = load_harness("addition/v2")
    return Trajectory(id=f"t{task.id}-{i}", task_id=task.id, pair_id="pair-x", harness_id=v2.id, sample_index=i,
                      seed=0, messages=(Message(role="user", content=v2.prompt(task.payload)),
                                        Message(role="assistant", content=text)),
                      tokens=TokenCounts(prompt=len(text), completion=len(text)), timings=Timings(generate_s=0.0))


def test_majority_selection_keeps_the_majority_answer_even_when_it_is_wrong_and_truth_writes_the_answer():
    from rsi.migrate import true_example
    from rsi.run.data import TrainingData

    v2 = load_harness("addition/v2")
    task = FAMILY.tasks("train", 0, 3, 1)[0]
    a, b = task.payload["a"], task.payload["b"]
    wrong, right = digits_lsb(a + b + 1, 11), digits_lsb(a + b, 11)
    samples = [trajectory(task, wrong, i) for i in range(5)] + [trajectory(task, right, i) for i in range(5, 8)]
    data = TrainingData(SimpleNamespace(store=None), harnesses=None, family=FAMILY)  # no DB: no verdict is read
    assert data.kept(samples, "majority", v2) == {t.id for t in samples[:5]}  # the wrong majority: no verifier asked
    assert data.kept(samples, "unverified", v2) == {t.id for t in samples}
    (first,) = data.kept(samples, "truth", v2)
    example = true_example(next(t for t in samples if t.id == first), task, v2, FAMILY)
    assert example.completion == right and example.prompt == v2.prompt(task.payload)


def test_a_lineage_that_trains_no_weights_searches_harnesses_for_the_untrained_base(prefect_api, tiny_base, rsi_home):
    """train.steps 0 (the ablation's harness arm): every generation searches; a plan candidate is paired with the
    base itself (no adapter), judged and registered; no adapter is ever trained."""
    from mlflow import MlflowClient

    from rsi.config import get_settings

    from .test_cycle import run_tiny, seed_home

    seed_home(rsi_home, tiny_base)
    search = {"space": {"chunk": [2]}, "proposers": ["addition"], "screen_margin": -1.0}  # the screen only ranks
    summaries, _ = run_tiny(1, train={"steps": 0}, harness_search=search)
    (searched,) = summaries
    assert [c.harness.split(".")[1].split("-")[0] for c in searched.harness_candidates] == ["chunks2"]
    assert searched.gate in ("promoted", "rejected") and searched.train_seconds is not None
    assert not any((rsi_home / "adapters").rglob("adapter_model.safetensors"))
    client = MlflowClient(get_settings().mlflow_uri)
    (version,) = client.search_model_versions("name = 'rsi-addition'")
    assert version.tags["adapter_hash"] == "None" and version.tags["harness_id"] == searched.harness
