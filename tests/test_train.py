"""LoRA training: the plain loop is deterministic; TRL's SFTTrainer path trains the same batches to the same
losses and weights (prompt tokens masked the same way), warm-starts from a parent adapter, reports each step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rsi.errors import UserError
from rsi.select import Dataset, Example
from rsi.train import TrainSpec, adapter_hash, lr_at, train_adapter

from .conftest import REPO

SPEC = TrainSpec(steps=3, batch_size=16, warmup=1, lora_r=8, lora_alpha=16)
# The loop's per-step losses on the fixtures below (torch 2.13 CPU); a changed loop shows here first.
LOOP_LOSSES = (2.5112, 2.5303, 2.5484)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small base, trained a few dozen steps on levels 1-2 (seconds)."""
    from rsi.basemodel import BaseRecipe, train_base

    path = tmp_path_factory.mktemp("train") / "base"
    train_base(BaseRecipe(steps=30, warmup=3, batch_size=32, d_model=64, n_heads=2, intermediate_size=128,
                          train_levels=(1, 2), level_weights=(1.0, 2.0)), path, eval_n=8)
    return path


@pytest.fixture(scope="module")
def dataset() -> Dataset:
    """True answers rendered by the harness: level 3 as the frontier pool, levels 1-2 as replay."""
    from rsi.hcp import load_harness
    from rsi.parsers import digits_lsb
    from rsi.tasks import get_family

    harness, family = load_harness(REPO / "harness_versions/addition/v2"), get_family("addition")
    width = harness.document.answer.params["width"]
    return Dataset(examples=tuple(
        Example(trajectory_id=f"label-{t.id}", level=t.level, prompt=harness.prompt(t.payload),
                completion=digits_lsb(t.answer, width), source="frontier" if t.level == 3 else "replay")
        for level in (1, 2, 3) for t in family.tasks("train", 0, level, 24)))


def train(base: Path, dataset: Dataset, out: Path, trainer: str = "loop", parent: Path | None = None):
    steps: list[tuple[int, float, float]] = []
    result = train_adapter(base, parent, dataset, SPEC.model_copy(update={"trainer": trainer}), out, seed=7,
                           on_step=lambda step, loss, lr: steps.append((step, loss, lr)))
    return result, steps


def weights(adapter: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(adapter / "adapter_model.safetensors")


def test_loop_is_deterministic_and_pinned(base: Path, dataset: Dataset, tmp_path: Path) -> None:
    first, steps = train(base, dataset, tmp_path / "a")
    again, _ = train(base, dataset, tmp_path / "b")
    assert first.adapter_hash == again.adapter_hash == adapter_hash(tmp_path / "a")
    assert [s for s, _, _ in steps] == [0, 1, 2]
    assert [loss for _, loss, _ in steps] == pytest.approx(LOOP_LOSSES, abs=2e-3)


def test_trl_trains_the_same_batches_to_the_same_weights(base: Path, dataset: Dataset, tmp_path: Path) -> None:
    """Same batches, init, optimizer and schedule: any difference in masking, EOS or loss normalisation
    would show in the first step's loss; the weights agree to float rounding."""
    pytest.importorskip("trl")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loop, loop_steps = train(base, dataset, tmp_path / "loop")
    trl, trl_steps = train(base, dataset, tmp_path / "trl", trainer="trl")
    assert [s for s, _, _ in trl_steps] == [0, 1, 2]  # on_step once per step, in order
    assert [lr for _, _, lr in trl_steps] == pytest.approx([lr_at(s, SPEC) for s in range(3)])
    assert trl_steps[0][1] == pytest.approx(loop_steps[0][1], rel=1e-5)
    assert [loss for _, loss, _ in trl_steps] == pytest.approx([loss for _, loss, _ in loop_steps], rel=1e-4)
    assert (trl.first_loss, trl.final_loss, trl.steps, trl.examples) == pytest.approx(
        (loop.first_loss, loop.final_loss, loop.steps, loop.examples), rel=1e-4)
    a, b = weights(tmp_path / "loop"), weights(tmp_path / "trl")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "trl")
    assert model.peft_config["default"].r == SPEC.lora_r


def test_trl_warm_starts_from_the_parent_adapter(base: Path, dataset: Dataset, tmp_path: Path) -> None:
    pytest.importorskip("trl")
    parent, _ = train(base, dataset, tmp_path / "parent")
    loop, loop_steps = train(base, dataset, tmp_path / "loop", parent=tmp_path / "parent")
    trl, trl_steps = train(base, dataset, tmp_path / "trl", trainer="trl", parent=tmp_path / "parent")
    # same seed, same first batch: a fresh LoRA would give the parent's first loss (the base's) again
    assert trl_steps[0][1] == pytest.approx(loop_steps[0][1], rel=1e-5)
    assert abs(trl.first_loss - parent.first_loss) > 1e-4
    a, b = weights(tmp_path / "loop"), weights(tmp_path / "trl")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_trl_missing_is_a_user_error(base: Path, dataset: Dataset, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "trl", None)  # import trl raises ImportError
    with pytest.raises(UserError, match=r"pip install 'rsi\[trl\]'"):
        train(base, dataset, tmp_path / "x", trainer="trl")
    assert not (tmp_path / "x").exists()


def test_trainer_is_part_of_the_spec() -> None:
    assert TrainSpec().trainer == "loop"
    assert TrainSpec(trainer="trl").model_dump()["trainer"] == "trl"
    with pytest.raises(ValueError, match="trainer"):
        TrainSpec(trainer="sgd")
