"""The built-in base: its text format is the harness's, its tokenizer round-trips, its training is deterministic."""

from __future__ import annotations

from pathlib import Path

import pytest

from rsi.basemodel import BaseRecipe, build_tokenizer, format_example, model_hash, train_base
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
