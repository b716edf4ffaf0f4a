"""HCP documents: every shipped one is valid; each kind of bad document is named precisely."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rsi.errors import UserError
from rsi.hcp import load_harness
from rsi.parsers import parse_reversed_digits

from .conftest import REPO

SHIPPED = sorted((REPO / "harness_versions").glob("*/*/hcp.toml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.parent.relative_to(REPO / "harness_versions")))
def test_every_shipped_document_is_valid(path: Path) -> None:
    harness = load_harness(path)
    assert harness.id == f"{path.parent.parent.name}/{path.parent.name}"
    assert len(harness.hash) == 64


def test_shipped_documents_exist() -> None:
    assert any(p.parent.parent.name == "addition" for p in SHIPPED)


@pytest.fixture
def doc(tmp_path: Path) -> Path:
    """A writable copy of harness_versions/addition/v1."""
    dest = tmp_path / "h"
    shutil.copytree(REPO / "harness_versions/addition/v1", dest)
    return dest


def edit(doc: Path, old: str, new: str, file: str = "hcp.toml") -> None:
    path = doc / file
    text = path.read_text()
    assert old in text, f"{old!r} not in {file}"
    path.write_text(text.replace(old, new, 1))


def test_addition_prompt_renders_reversed_fixed_width(doc: Path) -> None:
    assert load_harness(doc).prompt({"a": 12, "b": 345}) == "2100000000+5430000000="


def test_unknown_key_names_file_field_and_allowed_keys(doc: Path) -> None:
    edit(doc, "temperature = 1.0", "temprature = 1.0")
    with pytest.raises(UserError) as exc:
        load_harness(doc)
    msg = str(exc.value)
    assert str(doc / "hcp.toml") in msg and "'decoding.temprature'" in msg and "unknown key" in msg
    assert "temperature" in msg.split("expected one of:")[1]


def test_wrong_type_names_field(doc: Path) -> None:
    edit(doc, "max_new_tokens = 12", 'max_new_tokens = "twelve"')
    with pytest.raises(UserError, match=r"field 'decoding.max_new_tokens': .*integer"):
        load_harness(doc)


def test_missing_required_field(doc: Path) -> None:
    edit(doc, 'parser = "reversed_digits"\n', "")
    with pytest.raises(UserError, match=r"field 'answer.parser': required but missing"):
        load_harness(doc)


def test_unknown_parser_and_wrong_params(doc: Path) -> None:
    edit(doc, 'parser = "reversed_digits"', 'parser = "roman"')
    with pytest.raises(UserError, match=r"unknown parser 'roman'; expected one of .*reversed_digits"):
        load_harness(doc)


def test_unknown_contract_rule(doc: Path) -> None:
    edit(doc, '"answer_correct"]', '"answer_correct", "vibes"]')
    with pytest.raises(UserError, match=r"field 'contract': unknown rules \['vibes'\]"):
        load_harness(doc)


def test_missing_template_file(doc: Path) -> None:
    (doc / "templates/prompt.j2").unlink()
    with pytest.raises(UserError, match=r"field 'prompt.template': template file .*prompt.j2 does not exist"):
        load_harness(doc)


def test_template_syntax_error(doc: Path) -> None:
    (doc / "templates/prompt.j2").write_text("{{ task.a | digits_lsb(vars.width) }+\n")
    with pytest.raises(UserError, match=r"prompt.j2:1: field 'prompt.template': template syntax error"):
        load_harness(doc)


def test_template_undefined_variable(doc: Path) -> None:
    (doc / "templates/prompt.j2").write_text("{{ operand }}=\n")
    with pytest.raises(UserError) as exc:
        load_harness(doc)
    msg = str(exc.value)
    assert "prompt.j2" in msg and "field 'prompt.template'" in msg and "undefined variable 'operand'" in msg


def test_template_undeclared_var(doc: Path) -> None:
    (doc / "templates/prompt.j2").write_text("{{ task.a | digits_lsb(vars.wdth) }}=\n")
    with pytest.raises(UserError, match=r"undefined variable 'vars.wdth'; declare it under \[prompt.vars\]"):
        load_harness(doc)


def test_not_toml_and_not_found(doc: Path, tmp_path: Path) -> None:
    (doc / "hcp.toml").write_text("this is = = not toml")
    with pytest.raises(UserError, match="not valid TOML"):
        load_harness(doc)
    with pytest.raises(UserError, match="no such HCP document"):
        load_harness(tmp_path / "nowhere")


def test_sandbox_blocks_attribute_escape(doc: Path) -> None:
    (doc / "templates/prompt.j2").write_text("{{ task.__class__.__mro__ }}\n")
    with pytest.raises(UserError, match="cannot render"):
        load_harness(doc).prompt({"a": 1, "b": 2})


def test_operand_too_wide_fails_clearly(doc: Path) -> None:
    with pytest.raises(UserError, match="does not fit 10 unsigned digits"):
        load_harness(doc).prompt({"a": 10**12, "b": 1})


def test_hash_is_content_not_formatting(doc: Path) -> None:
    before = load_harness(doc).hash
    edit(doc, "[model]", "# a comment changes nothing\n[model]")
    assert load_harness(doc).hash == before
    edit(doc, "+", "+ ", file="templates/prompt.j2")
    assert load_harness(doc).hash != before


def test_reversed_digits_parser() -> None:
    assert parse_reversed_digits("5700", width=4).value == 75
    parsed = parse_reversed_digits("57001x", width=4)
    assert parsed.ok and parsed.extra == "1x"
    assert not parse_reversed_digits("57a0", width=4).ok
    assert not parse_reversed_digits("57", width=4).ok
