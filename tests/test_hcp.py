"""HCP documents: every shipped one is valid; each kind of bad document is named precisely."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rsi.errors import UserError
from rsi.hcp import CONTRACT_RULES, load_harness
from rsi.parsers import PARSERS, get_parser, parse_integer, parse_reversed_digits
from rsi.store import open_store
from rsi.store.harnesses import lock_harness, locked_hash

from .conftest import REPO

SHIPPED = sorted((REPO / "harness_versions").glob("*/*/hcp.toml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.parent.relative_to(REPO / "harness_versions")))
def test_every_shipped_document_is_valid(path: Path) -> None:
    harness = load_harness(path)
    assert harness.id == f"{path.parent.parent.name}/{path.parent.name}"
    assert len(harness.hash) == 64


def test_a_base_in_a_package_not_installed_is_a_warning_until_the_model_is_needed(doc2: Path) -> None:
    edit(doc2, 'base = "builtin"', 'base = "package:rsi_no_such_package/model.gguf"')
    harness = load_harness(doc2)  # an optional install (the smollm2 extra), not a broken document
    assert any("no installed Python package 'rsi_no_such_package'" in w for w in harness.warnings)
    with pytest.raises(UserError, match="no installed Python package 'rsi_no_such_package'; install it"):
        harness.base_model_dir()


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
    with pytest.raises(UserError, match=r"field 'contract.rules': unknown rules \['vibes'\]"):
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


# ---- documents as untrusted input (issue 8, item 4) -----------------------------------------------


@pytest.fixture
def doc2(tmp_path: Path) -> Path:
    """A writable copy of harness_versions/addition/v2 (contract version 2)."""
    dest = tmp_path / "h2"
    shutil.copytree(REPO / "harness_versions/addition/v2", dest)
    return dest


def _absolute_template(doc: Path) -> tuple[Path, str]:
    edit(doc, 'template = "templates/prompt.j2"', f'template = "{doc / "templates/prompt.j2"}"')
    return doc / "hcp.toml", "is absolute"


def _dotdot_template(doc: Path) -> tuple[Path, str]:
    (doc.parent / "outside.j2").write_text("{{ task.a }}+{{ task.b }}=")
    edit(doc, 'template = "templates/prompt.j2"', 'template = "templates/../../outside.j2"')
    return doc / "hcp.toml", "contains '..'"


def _symlink_out(doc: Path) -> tuple[Path, str]:
    (doc.parent / "outside.j2").write_text("{{ task.a }}+{{ task.b }}=")
    (doc / "templates/prompt.j2").unlink()
    (doc / "templates/prompt.j2").symlink_to(doc.parent / "outside.j2")
    return doc / "hcp.toml", "outside the harness folder"


def _unknown_family(doc: Path) -> tuple[Path, str]:
    edit(doc, 'family = "addition"', 'family = "subtraction"')
    return doc / "hcp.toml", "known families: addition"


def _negative_width(doc: Path) -> tuple[Path, str]:
    edit(doc, "params = { width = 11 }", "params = { width = -1 }")
    return doc / "hcp.toml", "greater than or equal to 1"


def _bad_tool_schema(doc: Path) -> tuple[Path, str]:
    edit(doc, "[contract]", '[[tools]]\nname = "calc"\nparameters = { type = "object", properties = 3 }\n\n[contract]')
    return doc / "hcp.toml", "not a valid JSON Schema"


def _render_time_failure(doc: Path) -> tuple[Path, str]:
    (doc / "templates/prompt.j2").write_text("{{ task.a // 0 }}=")
    return doc / "templates/prompt.j2", "ZeroDivisionError"


def _missing_payload_key(doc: Path) -> tuple[Path, str]:
    (doc / "templates/prompt.j2").write_text("{{ task.a }}+{{ task.missing_key }}=")
    return doc / "templates/prompt.j2", "missing_key"


def _no_rules(doc: Path) -> tuple[Path, str]:
    text = (doc / "hcp.toml").read_text()
    (doc / "hcp.toml").write_text(text[: text.index("rules = [")] + "rules = []\n")
    return doc / "hcp.toml", "passes every trajectory"


def _missing_required_rule(doc: Path) -> tuple[Path, str]:
    edit(doc, '    "messages_allowed",\n', "")
    return doc / "hcp.toml", "missing required rules ['messages_allowed']"


def _chat_mode_plan(doc: Path) -> tuple[Path, str]:
    edit(doc, 'mode = "completion"', 'mode = "chat"')
    edit(doc, "[contract]", '[plan]\nname = "digit_chunks"\n\n[contract]')
    return doc / "hcp.toml", "a plan poses its calls as completion prompts"


def _missing_gguf(doc: Path) -> tuple[Path, str]:
    edit(doc, 'base = "builtin"', 'base = "models/nowhere.gguf"')
    return doc / "hcp.toml", "no GGUF file at"


def _missing_file_in_package(doc: Path) -> tuple[Path, str]:
    edit(doc, 'base = "builtin"', 'base = "package:rsi/no_such_model.gguf"')
    return doc / "hcp.toml", "holds no file 'no_such_model.gguf'"


def _missing_model_dir(doc: Path) -> tuple[Path, str]:
    edit(doc, 'base = "builtin"', 'base = "models/nowhere"')
    return doc / "hcp.toml", "neither 'builtin' nor an existing directory"


# name -> (break the v2 copy; returns the file the error must name and a phrase it must hold), field named
BAD = {
    "absolute_template": (_absolute_template, "prompt.template"),
    "dotdot_template": (_dotdot_template, "prompt.template"),
    "symlink_out": (_symlink_out, "prompt.template"),
    "unknown_family": (_unknown_family, "family"),
    "negative_width": (_negative_width, "answer.params.width"),
    "bad_tool_schema": (_bad_tool_schema, "tools[0].parameters"),
    "render_time_failure": (_render_time_failure, "prompt.template"),
    "missing_payload_key": (_missing_payload_key, "prompt.template"),
    "no_rules": (_no_rules, "contract.rules"),
    "missing_required_rule": (_missing_required_rule, "contract.rules"),
    "chat_mode_plan": (_chat_mode_plan, "plan"),
    "missing_gguf": (_missing_gguf, "model.base"),
    "missing_file_in_package": (_missing_file_in_package, "model.base"),
    "missing_model_dir": (_missing_model_dir, "model.base"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_document_names_file_field_and_fix(doc2: Path, case: str) -> None:
    breaker, field = BAD[case]
    file, phrase = breaker(doc2)
    with pytest.raises(UserError) as exc:
        load_harness(doc2)
    msg = str(exc.value)
    assert str(file) in msg and f"field '{field}'" in msg and phrase in msg, msg


@pytest.mark.parametrize("case", BAD)
def test_cli_refuses_bad_document_with_exit_2(doc2: Path, case: str) -> None:
    breaker, field = BAD[case]
    file, phrase = breaker(doc2)
    result = subprocess.run([sys.executable, "-m", "rsi", "harness", "validate", str(doc2)], capture_output=True,
                            text=True, cwd=REPO, env=dict(os.environ), timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert str(file) in result.stderr and field in result.stderr and phrase in result.stderr
    assert "Traceback" not in result.stderr


def test_render_failure_names_the_task(doc2: Path) -> None:
    _render_time_failure(doc2)
    with pytest.raises(UserError, match=r"cannot render addition task task-[0-9a-f]+ \(train split, seed 0, level 1, "
                                        r"index \d+, payload \{\"a\": \d+, \"b\": \d+\}\): ZeroDivisionError"):
        load_harness(doc2)


def test_a_level_the_format_cannot_pose_is_not_an_error(doc2: Path) -> None:
    edit(doc2, "width = 10", "width = 1")  # levels 2.. do not fit one digit: a ceiling, not a broken template
    harness = load_harness(doc2)
    assert harness.prompt({"a": 3, "b": 4}) == "3+4="
    with pytest.raises(UserError, match="does not fit 1 unsigned digits"):
        harness.prompt({"a": 30, "b": 4})


def test_a_level_that_renders_only_in_part_is_an_error(doc2: Path) -> None:
    from rsi.hcp import SAMPLE_SEED, SAMPLE_TASKS
    from rsi.tasks import get_family

    a = get_family("addition").tasks("train", SAMPLE_SEED, 2, SAMPLE_TASKS)[0].payload["a"]
    template = "{% if task.a == A %}{{ task.nope }}{% endif %}{{ task.a }}=".replace("A", str(a))
    (doc2 / "templates/prompt.j2").write_text(template)
    with pytest.raises(UserError, match=r"level 2, .*UndefinedError.* of \d sample tasks of this level render: a "
                                        r"level must render for all its tasks or none"):
        load_harness(doc2)


def test_symlink_inside_the_folder_is_fine(doc2: Path) -> None:
    (doc2 / "templates/real.j2").write_text((doc2 / "templates/prompt.j2").read_text())
    (doc2 / "templates/prompt.j2").unlink()
    (doc2 / "templates/prompt.j2").symlink_to(doc2 / "templates/real.j2")
    assert load_harness(doc2).prompt({"a": 12, "b": 345}) == "2100000000+5430000000="


def test_tool_schema_must_be_a_local_object_schema(doc2: Path) -> None:
    edit(doc2, "[contract]", '[[tools]]\nname = "calc"\nparameters = { type = "string" }\n\n[contract]')
    with pytest.raises(UserError, match=r"field 'tools\[0\].parameters': tool arguments are a JSON object"):
        load_harness(doc2)
    edit(doc2, 'parameters = { type = "string" }', 'parameters = { type = "object", "$ref" = "https://x.test/s" }')
    with pytest.raises(UserError, match=r"field 'tools\[0\].parameters': \$ref 'https://x.test/s' is not local"):
        load_harness(doc2)
    edit(doc2, '"$ref" = "https://x.test/s"', 'properties = { x = { type = "integer" } }')
    # a well-formed schema; now the harness must be able to run the tool (the auditor replays every call)
    with pytest.raises(UserError, match=r"exposes tools but lacks \['results_replayed', 'states_replayed'\]"):
        load_harness(doc2)


@pytest.fixture
def sort_doc(tmp_path: Path) -> Path:
    """A writable copy of harness_versions/sorting/v1 (a tool harness)."""
    dest = tmp_path / "s1"
    shutil.copytree(REPO / "harness_versions/sorting/v1", dest)
    return dest


def test_a_tool_harness_must_be_playable(sort_doc: Path) -> None:
    assert [t.name for t in load_harness(sort_doc).document.tools] == ["swap"]
    edit(sort_doc, 'name = "swap"', 'name = "rotate"')
    with pytest.raises(UserError, match=r"field 'tools': family 'sorting' declares no tool 'rotate' \(its tools: swap\)"):
        load_harness(sort_doc)
    edit(sort_doc, 'name = "rotate"', 'name = "swap"')
    edit(sort_doc, '[tool_calls]\nsyntax = "python"\n', '')
    with pytest.raises(UserError, match=r"needs \[tool_calls\] \(how a call is written\)"):
        load_harness(sort_doc)
    edit(sort_doc, '[[tools]]', '[tool_calls]\nsyntax = "python"\n\n[[tools]]')
    edit(sort_doc, 'maximum = 5 }', 'maximum = 0 }')  # the expert's calls leave the schema
    with pytest.raises(UserError, match=r"cannot play sorting task .* the expert's call swap\(\d\) failed: error: "
                                        r"arguments of swap"):
        load_harness(sort_doc)


def test_contract_3_requires_text_matches_calls_and_sorting_v2_is_v1_under_it(sort_doc: Path) -> None:
    """sorting/v2 is sorting/v1 (same templates, decoding, limits, tool) under contract 3, which requires
    text_matches_calls; v1 (contract 2) stays loadable without it, unchanged."""
    v1, v2 = load_harness("sorting/v1"), load_harness("sorting/v2")
    assert (v1.contract_version, v2.contract_version, v1.warnings, v2.warnings) == ("2", "3", (), ())
    assert "text_matches_calls" not in v1.document.contract.rules
    assert v2.document.contract.rules == (*v1.document.contract.rules[:6], "text_matches_calls",
                                          *v1.document.contract.rules[6:])
    assert v2.sources == v1.sources
    assert v2.document.model_dump(exclude={"version", "description", "contract"}) == v1.document.model_dump(
        exclude={"version", "description", "contract"})
    edit(sort_doc, 'version = "2"', 'version = "3"')  # v1's rules under contract 3
    with pytest.raises(UserError, match=r"field 'contract.rules': missing required rules \['text_matches_calls'\]"):
        load_harness(sort_doc)
    edit(sort_doc, '    "tools_allowed",\n', '    "tools_allowed",\n    "text_matches_calls",\n')
    assert load_harness(sort_doc).contract_version == "3"


def test_parser_params_are_typed(doc2: Path) -> None:
    edit(doc2, "params = { width = 11 }", 'params = { width = "11" }')
    with pytest.raises(UserError, match=r"field 'answer.params.width': Input should be a valid integer"):
        load_harness(doc2)
    edit(doc2, 'params = { width = "11" }', "params = { width = 11, base = 2 }")
    with pytest.raises(UserError, match=r"field 'answer.params.base': unknown key; expected one of: width"):
        load_harness(doc2)
    edit(doc2, 'parser = "reversed_digits"', 'parser = "integer"')
    edit(doc2, "params = { width = 11, base = 2 }", "params = { width = 11 }")
    with pytest.raises(UserError, match=r"'answer.params.width': unknown key; expected one of: none \(parser 'integer"):
        load_harness(doc2)


def test_contract_rules_duplicates_and_versions(doc2: Path) -> None:
    edit(doc2, '    "answer_correct",\n]', '    "answer_correct",\n    "limits",\n]')
    with pytest.raises(UserError, match=r"field 'contract.rules': rules \['limits'\] listed more than once"):
        load_harness(doc2)
    edit(doc2, '    "limits",\n]', "]")
    edit(doc2, 'version = "2"', 'version = "7"')
    with pytest.raises(UserError, match=r"field 'contract.version': unknown contract version '7'; expected one of 1, "):
        load_harness(doc2)


def test_require_stop_needs_the_stopped_rule(doc2: Path) -> None:
    edit(doc2, '    "stopped",\n', "")
    with pytest.raises(UserError, match=r"require_stop = true but contract.rules lacks 'stopped'"):
        load_harness(doc2)
    edit(doc2, "require_stop = true", "require_stop = false")
    assert not load_harness(doc2).document.answer.require_stop


def test_model_base_must_hold_a_hugging_face_model(doc2: Path) -> None:
    (doc2 / "model").mkdir()
    edit(doc2, 'base = "builtin"', 'base = "model"')
    with pytest.raises(UserError, match=r"field 'model.base': .*holds no config.json"):
        load_harness(doc2)
    (doc2 / "model/config.json").write_text("{}")
    assert load_harness(doc2).base_model_dir() == (doc2 / "model").resolve()
    edit(doc2, 'adapter = "lineage"', 'adapter = "/some/dir"')
    with pytest.raises(UserError, match=r"field 'model.adapter': Input should be 'lineage' or 'none'"):
        load_harness(doc2)


def test_v1_is_a_loadable_legacy_contract_and_v2_renders_the_same_prompt() -> None:
    v1, v2 = load_harness(REPO / "harness_versions/addition/v1"), load_harness(REPO / "harness_versions/addition/v2")
    assert v1.contract_version == "1" and "legacy" in v1.warnings[0] and "messages_allowed" in v1.warnings[0]
    assert v2.warnings == () and v2.contract_version == "2" and v2.document.answer.require_stop
    # every rule but the two that replay tool calls (addition has no tools and no environment) and the one contract 3
    # added (text_matches_calls)
    assert v2.document.contract.rules == tuple(r for r in CONTRACT_RULES if r not in ("results_replayed",
                                                                                       "states_replayed",
                                                                                       "text_matches_calls"))
    assert v2.sources == v1.sources and v2.hash != v1.hash
    for payload in ({"a": 0, "b": 0}, {"a": 12, "b": 345}, {"a": 9_999_999_999, "b": 1}):
        assert v2.prompt(payload) == v1.prompt(payload)
        assert v2.prompt_messages(payload) == [("user", v1.prompt(payload))]


def test_system_template_comes_first_in_messages_and_prompt(doc2: Path) -> None:
    (doc2 / "templates/system.j2").write_text("Add {{ vars.width }}-digit numbers.{{ '\\n' }}\n")
    edit(doc2, 'mode = "completion"', 'mode = "completion"\nsystem_template = "templates/system.j2"')
    harness = load_harness(doc2)
    messages = harness.prompt_messages({"a": 12, "b": 345})
    assert messages == [("system", "Add 10-digit numbers.\n"), ("user", "2100000000+5430000000=")]
    assert messages[0].role == "system"
    assert harness.prompt({"a": 12, "b": 345}) == "Add 10-digit numbers.\n2100000000+5430000000="


def test_parsers_accept_ascii_digits_only_and_never_raise() -> None:
    for text in ("57²0", "٣٣٣٣", "５７００"):
        parsed = parse_reversed_digits(text, width=4)
        assert not parsed.ok and "non-ASCII digit" in parsed.error
    for text in ("²", "٣٣", "５", "-٣"):
        assert not parse_integer(text).ok and "non-ASCII digit" in parse_integer(text).error
    assert parse_integer("12²").extra == "²"  # the answer stops at the last ASCII digit
    for text in ("", "-", "²³", "\x00", "9" * 5000, "-" + "1" * 5000, "𝟗𝟗"):
        assert isinstance(parse_integer(text).ok, bool)
        assert isinstance(parse_reversed_digits(text, width=11).ok, bool)
    assert get_parser("reversed_digits") is parse_reversed_digits and PARSERS["integer"][0] is parse_integer


def test_lock_keeps_a_used_harness_version_immutable(db_url: str, doc2: Path) -> None:
    store = open_store(db_url)
    harness = load_harness(doc2)
    with store.session() as s:
        assert locked_hash(s, harness.id) is None
        lock_harness(s, harness)
    with store.session() as s:
        lock_harness(s, load_harness(doc2))  # the same content again: fine
        assert locked_hash(s, "addition/v2") == harness.hash
    edit(doc2, "temperature = 1.0", "temperature = 0.5")
    edited = load_harness(doc2)
    with pytest.raises(UserError) as exc, store.session() as s:
        lock_harness(s, edited)
    msg = str(exc.value)
    assert msg.startswith(f"harness addition/v2 ({doc2 / 'hcp.toml'}) was first used with hash {harness.hash[:12]}… "
                          f"and now hashes to {edited.hash[:12]}…")
    assert "(changed: decoding)" in msg and "a used harness version is immutable" in msg
    assert f"e.g. {doc2.parent / 'v3'}" in msg and "bump `version`" in msg
    with store.session() as s:
        assert locked_hash(s, "addition/v2") == harness.hash
    store.dispose()


# ---- shipped harness versions: found by id or family, packaged with rsi ---------------------------------

def test_resolve_harness_by_directory_id_family_and_legacy_path(tmp_path: Path) -> None:
    from rsi.hcp import resolve_harness, shipped_harnesses

    v2 = shipped_harnesses() / "addition/v2"
    assert resolve_harness("addition/v2") == v2
    assert resolve_harness("addition") == v2  # the newest v<N>
    assert resolve_harness("harness_versions/addition/v1") == shipped_harnesses() / "addition/v1"
    copy = tmp_path / "mine"
    shutil.copytree(v2, copy)
    assert resolve_harness(copy) == copy.resolve() == resolve_harness(copy / "hcp.toml")
    assert resolve_harness("sorting") == shipped_harnesses() / "sorting/v2"
    shipped = (r"shipped: addition/smollm2-v1, addition/v1, addition/v2, program_proposals/v1, programs/v1, "
               r"programs/v2, programs/v3, sorting/smollm2-v1, sorting/v1, sorting/v2\. Pass a harness directory")
    for bad in ("addition/v9", "subtraction", str(tmp_path / "nowhere"), ""):
        with pytest.raises(UserError, match=shipped):
            resolve_harness(bad)


@pytest.mark.slow
def test_the_wheel_ships_every_harness_version(tmp_path: Path) -> None:
    """A non-editable install finds the harness versions: they are package data of the wheel."""
    import zipfile

    source = tmp_path / "src"  # a copy: a build in the checkout would leave build/ behind, stale for the next
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "bench"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(source)], check=True, timeout=600, capture_output=True)
    names = set(zipfile.ZipFile(next(tmp_path.glob("rsi-*.whl"))).namelist())
    shipped = {f"rsi/{p.relative_to(REPO)}" for p in (REPO / "harness_versions").rglob("*")  # as rsi.harness_versions
               if p.is_file() and "__pycache__" not in p.parts}
    assert shipped and shipped <= names, sorted(shipped - names)


@pytest.mark.parametrize(("version", "pinned"), [("addition/v1", "25cddabf81cb6c06"),
                                                  ("addition/v2", "b331550ca9311d09")])
def test_a_shipped_version_keeps_its_hash_across_protocol_additions(version: str, pinned: str) -> None:
    """Stored lineages name these hashes (pairs, verdicts, the harness lock): a field added to HCPDocument later
    (answer.template) must not change the hash of a document that does not set it."""
    assert load_harness(version).hash.startswith(pinned)


def _numeric_fields(value: object, path: tuple = ()) -> list[tuple]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _numeric_fields(v, (*path, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _numeric_fields(v, (*path, i))]
    return [path] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def _load_with(tmp_path: Path, source: Path, document: dict, templates: dict[str, str] | None = None):
    """``source``'s harness folder with ``document`` as its hcp.toml (and ``templates`` written over its own),
    loaded: the harness, or the UserError; with the seconds it took."""
    import time

    import tomli_w

    folder = tmp_path / "h"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(source, folder)
    (folder / "hcp.toml").write_text(tomli_w.dumps(document))
    for rel, text in (templates or {}).items():
        (folder / rel).write_text(text)
    started = time.monotonic()
    try:
        outcome: object = load_harness(folder)
    except UserError as exc:
        outcome = exc
    return outcome, time.monotonic() - started


@pytest.mark.timeout(900)
def test_every_numeric_field_at_ten_to_the_k_validates_or_is_refused_within_the_budget(tmp_path: Path) -> None:
    """Each numeric field of the shipped documents (once per field path, in the first document that has it) set to
    10^k, k = 1..12: the document loads, or a UserError names a field (this one, or the template that would
    render too much with it; exit 2 at the CLI), within the validation
    budget (VALIDATE_S) plus the document's own checks. Before the bounds, prompt.vars.width = 10^9 took 10-18 s and
    10^10 exhausted the machine's memory; decoding.samples = 10^9 was valid."""
    import tomllib

    from rsi.hcp.document import VALIDATE_S

    seen, outcomes = set(), {}
    for hcp in sorted((REPO / "harness_versions").glob("*/*/hcp.toml")):
        base = tomllib.loads(hcp.read_text())
        for path in _numeric_fields(base):
            if path in seen:
                continue
            seen.add(path)
            for k in range(1, 13):
                document = tomllib.loads(hcp.read_text())
                node = document
                for key in path[:-1]:
                    node = node[key]
                node[path[-1]] = 10 ** k
                outcome, seconds = _load_with(tmp_path, hcp.parent, document)
                assert seconds < VALIDATE_S + 5, (path, k, seconds)
                if isinstance(outcome, UserError):
                    message = str(outcome)  # a field's bound, a template's render, or what the document would do
                    assert "Traceback" not in message and ("field '" in message or "hcp.toml" in message), (
                        path, k, message)
                outcomes[(".".join(map(str, path)), k)] = "valid" if not isinstance(outcome, UserError) else "refused"
    assert outcomes[("decoding.samples", 9)] == "refused" and outcomes[("prompt.vars.width", 9)] == "refused"
    assert outcomes[("decoding.samples", 2)] == "valid"


def test_a_template_that_renders_too_much_or_too_long_is_refused(tmp_path: Path, doc2: Path) -> None:
    """What the document's bounds cannot see: a repetition building a huge string, a render longer than
    MAX_RENDER_CHARS, nested loops that would run for hours; each refused naming the template field, the loops
    by the validation's time budget."""
    import tomllib

    document = tomllib.loads((doc2 / "hcp.toml").read_text())
    hostile = {
        "repetition": "{{ 'x' * 1000000000 }}",
        "power": "{{ 10 ** 100000 }}",
        "long": "{% for i in range(100000) %}{{ 'abcdefghijklmnopqrstuvwxyz' }}{% endfor %}",
        "loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
    }
    for name, text in hostile.items():
        outcome, seconds = _load_with(tmp_path, doc2, document, {"templates/prompt.j2": text})
        assert isinstance(outcome, UserError) and "Traceback" not in str(outcome), (name, outcome)
        if name == "loops":  # the time budget: no single step is too big, together they are
            assert "validating it took more than" in str(outcome) and seconds < 30, (seconds, outcome)
        else:
            assert "field 'prompt.template'" in str(outcome), (name, outcome)
