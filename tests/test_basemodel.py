"""The built-in base: its text format is the harness's, its tokenizer round-trips, its training is deterministic;
one base may be pretrained on several families (a joint base)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rsi.basemodel import (BaseRecipe, FamilyPart, base_dir_for, build_tokenizer, interleave, model_hash, read_recipe,
                           train_base)
from rsi.config import Settings
from rsi.run import load_config
from rsi.task_generators.addition import format_example
from rsi.hcp import load_harness
from rsi.parsers import parse_reversed_digits
from rsi.tasks import get_family

from .conftest import REPO

HARNESS = load_harness(REPO / "harness_versions/addition/v2")


def test_base_is_trained_in_the_harness_format() -> None:
    """The base learns exactly the text the harness renders and parses, at the harness's width."""
    width = HARNESS.document.prompt.vars["width"]
    assert BaseRecipe().width == width
    family = get_family("addition")
    for task in [family.task("train", 3, level, i) for level in (1, 2, 3, 7, 10) for i in range(20)]:
        prompt, completion = format_example(task.payload["a"], task.payload["b"], width)
        assert prompt == HARNESS.prompt(task.payload)
        parsed = parse_reversed_digits(completion, **HARNESS.document.answer.params)
        assert parsed.ok and parsed.value == task.answer and parsed.extra == ""


def test_tokenizer_round_trip_and_bos() -> None:
    tok = build_tokenizer()
    text = "2100000000+5430000000=75300000000"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_recipe_digest_changes_with_any_knob() -> None:
    assert BaseRecipe().digest() == BaseRecipe().digest()
    assert BaseRecipe(lr=2e-3).digest() != BaseRecipe().digest()
    with pytest.raises(ValueError, match="head_dim"):
        BaseRecipe(d_model=96, n_heads=4)


def test_training_is_deterministic(tmp_path: Path) -> None:
    """Same recipe, same bytes: two short builds give byte-identical weights and the same model hash."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe = BaseRecipe(steps=6, warmup=2, batch_size=16, d_model=64, n_heads=2, intermediate_size=128)
    train_base(recipe, tmp_path / "a", eval_n=8)
    train_base(recipe, tmp_path / "b", eval_n=8)
    assert (tmp_path / "a/model.safetensors").read_bytes() == (tmp_path / "b/model.safetensors").read_bytes()
    assert model_hash(tmp_path / "a") == model_hash(tmp_path / "b")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")  # plain transformers loads it
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert model.config.head_dim in (32, 64) and tok.eos_token == "<eos>"


SORTING_PART = FamilyPart(family="sorting", harness="sorting/v1", train_levels=(1, 2), level_weights=(1.0, 1.0),
                          mistakes=0.35, steps=40)


def test_recipes_without_also_keep_their_digests() -> None:
    """Bases built before ``also`` existed (the demo's, the sorting profile's) stay cached under the same digest."""
    assert BaseRecipe().digest() == "bfbaabc3313af777"
    assert BaseRecipe(**load_config("demo").base_recipe).digest() == "9fbb1f5fcc5603e8"
    assert BaseRecipe(**load_config("sorting").base_recipe).digest() == "99d1b99245bfe4e7"
    assert BaseRecipe(also=(SORTING_PART,)).digest() != BaseRecipe().digest()


def test_a_joint_recipe_checks_each_family() -> None:
    with pytest.raises(ValueError, match="set harness for a family other than addition"):
        FamilyPart(family="sorting", train_levels=(1,), level_weights=(1.0,), steps=10)
    with pytest.raises(ValueError, match="one weight per entry"):
        FamilyPart(family="sorting", harness="sorting/v1", train_levels=(1, 2), level_weights=(1.0,), steps=10)
    with pytest.raises(ValueError, match="sorting: train_levels must be non-empty and within 1..width=10"):
        BaseRecipe(also=(SORTING_PART.model_copy(update={"train_levels": (11,), "level_weights": (1.0,)}),))
    with pytest.raises(ValueError, match="each family once"):
        BaseRecipe(also=(SORTING_PART, SORTING_PART))
    joint = BaseRecipe(steps=50, also=(SORTING_PART,))
    assert joint.total_steps == 90 and [r.family for r in joint.families()] == ["addition", "sorting"]
    assert joint.trained_levels("sorting") == (1, 2) and joint.trained_levels("addition") == (1, 2, 3)


def test_interleave_gives_each_stream_its_steps_evenly() -> None:
    assert interleave([4, 2]) == [0, 1, 0, 0, 1, 0]
    assert interleave([3]) == [0, 0, 0]
    order = interleave([1500, 600])
    assert [order.count(k) for k in (0, 1)] == [1500, 600]
    assert order[:7] == [0, 1, 0, 0, 1, 0, 0]  # 5 addition steps to 2 sorting steps throughout


def test_the_mol_profiles_put_both_demo_lineages_on_one_base() -> None:
    addition, sorting = load_config("mol-addition"), load_config("mol-sorting", family="sorting")
    joint = BaseRecipe(**addition.base_recipe)
    assert joint.digest() == BaseRecipe(**sorting.base_recipe).digest()
    assert joint.digest() != BaseRecipe(**load_config("demo").base_recipe).digest()
    demo, alone = BaseRecipe(**load_config("demo").base_recipe), BaseRecipe(**load_config("sorting").base_recipe)
    assert (joint.lr, joint.warmup, joint.seed, joint.steps) == (demo.lr, demo.warmup, demo.seed, demo.steps)
    [part] = joint.also
    assert part.model_dump(exclude={"steps"}) == alone.model_dump(include=set(part.model_dump()) - {"steps"})
    assert part.steps == alone.steps
    assert (addition.family, sorting.family, sorting.harness) == ("addition", "sorting", "harness_versions/sorting/v2")


def test_a_joint_base_trains_both_families_and_measures_each(rsi_home: Path) -> None:
    """Addition and sorting steps interleaved in one build; rsi_recipe.json and `rsi base build` show each family."""
    from .test_cli import rsi

    small = {"steps": 40, "warmup": 4, "batch_size": 16, "d_model": 64, "n_heads": 2, "intermediate_size": 128,
             "also": [SORTING_PART.model_dump(mode="json")]}
    recipe = BaseRecipe(**load_config("tiny", base_recipe=small).base_recipe)
    path = base_dir_for(Settings(home=rsi_home), recipe)
    seen: list[tuple[int, int]] = []
    train_base(recipe, path, progress=lambda step, total, loss: seen.append((step, total)), eval_n=8)
    assert seen == [(step, 80) for step in range(1, 81)]
    assert read_recipe(path) == recipe
    meta = json.loads((path / "rsi_recipe.json").read_text())
    assert set(meta["greedy"]) == {"1", "2", "3", "4"} and set(meta["pass_at_8"]) == {"3"}  # addition, as before
    [part] = meta["also"]
    assert part["family"] == "sorting" and set(part["greedy"]) == {"1", "2", "3", "4"} and set(part["pass_at_8"]) == {"3"}
    result = rsi("base", "build", "--profile", "tiny", "--set", f"base_recipe={json.dumps(small)}")
    assert result.returncode == 0, result.stderr
    assert f"{path.name}: addition" in result.stdout and f"{path.name}: sorting" in result.stdout
    assert "(cached)" in result.stdout
