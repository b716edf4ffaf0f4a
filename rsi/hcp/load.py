"""Loading a harness version: ``load_harness`` validates all of an untrusted document (its TOML, every field, the
templates inside its folder, rendered on sample tasks; a plan dry-run with right answers; the family's expert
played as episodes) and raises a ``UserError`` naming the file, the field and what was expected.

Some checks refuse a document for what it would do, not for its form: decoding that writes past the contract's own
token limit, an answer template whose answers the harness's parser refuses, a family's expert that cannot finish
an episode under it. ``tolerating`` lets one such document load with those refusals as warnings, so that
``rsi harness repair`` can run it: its probe then shows the failures the refusals predicted, and every repair
drawn from them is validated in full."""

from __future__ import annotations

import json
import signal
import threading
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from jinja2 import TemplateSyntaxError, meta, nodes
from pydantic import BaseModel, ValidationError

from rsi.errors import UserError
from rsi.hcp.document import (ANSWER_NAMES, EPISODE_RULES, FAMILY_RULE, LEGACY_CONTRACTS, PLAN_LEVELS,
                              SAMPLE_LEVELS, SAMPLE_SEED, SAMPLE_TASKS, TEMPLATE_FIELDS, TEMPLATE_NAMES, TOOL_NAMES,
                              VALIDATE_S, HCPDocument)
from rsi.hcp.harness import Harness, TemplateRenderError, template_env
from rsi.hcp.plays import calls_with_gold, demonstration
from rsi.models import Task
from rsi.parsers import parser_names, parser_spec
from rsi.tasks import get_family


def _resolve(path: Path) -> Path:
    path = Path(path)
    if not path.exists():  # a shipped id, family or harness_versions/... path, found wherever rsi is installed
        try:
            path = resolve_harness(path)
        except UserError as exc:
            raise UserError(f"{path}: no such HCP document; pass a hcp.toml or the directory that holds one "
                            f"({str(exc).split('; ', 1)[1]})") from None
    if path.is_dir():
        path = path / "hcp.toml"
    if not path.is_file():
        raise UserError(f"{path}: no such HCP document; pass a hcp.toml or the directory that holds one")
    return path


def _field_model(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model that owns the last key of ``loc`` (for listing the keys it accepts)."""
    for key in loc[:-1]:
        if isinstance(key, int):
            continue
        field = model.model_fields.get(str(key))
        if field is None:
            return None
        inner = field.annotation
        args = getattr(inner, "__args__", ()) or ()
        candidates = [inner, *args]
        sub = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if sub is None:
            return None
        model = sub
    return model


def _field_name(loc: tuple[Any, ...]) -> str:
    """('tools', 0, 'parameters') -> 'tools[0].parameters'."""
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else f".{part}" if name else str(part)
    return name or "(document)"


def _explain(path: Path, exc: ValidationError, raw: dict[str, Any]) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        field = _field_name(loc)
        if err["type"] == "extra_forbidden":
            if loc[:2] == ("answer", "params") and len(loc) == 3:
                parser = str((raw.get("answer") or {}).get("parser"))
                fields = parser_spec(parser).params.model_fields if parser in parser_names() else {}
                allowed = ", ".join(fields) or f"none (parser {parser!r} takes no params)"
            else:
                owner = _field_model(HCPDocument, loc)
                allowed = ", ".join(owner.model_fields) if owner else "see the HCP documentation"
            lines.append(f"{path}: field {field!r}: unknown key; expected one of: {allowed}")
        elif err["type"] == "missing":
            lines.append(f"{path}: field {field!r}: required but missing")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{path}: field {field!r}: {msg} (got {err.get('input')!r})")
    return "\n".join(lines)


def _template_file(path: Path, field: str, rel: str) -> Path:
    """The template file ``rel`` names, which must lie inside the harness folder (symlinks resolved)."""
    where = f"{path}: field '{_qualified(field)}'"
    if PurePosixPath(rel).is_absolute() or PureWindowsPath(rel).anchor:
        raise UserError(f"{where}: template path {rel!r} is absolute; give a path relative to {path.parent}")
    if ".." in PurePosixPath(rel.replace("\\", "/")).parts:
        raise UserError(f"{where}: template path {rel!r} contains '..'; templates must live inside {path.parent}")
    file = path.parent / rel
    root, target = path.parent.resolve(), file.resolve()
    if not target.is_relative_to(root):
        raise UserError(f"{where}: template {file} resolves to {target}, outside the harness folder {root} "
                        "(a symlink?); copy the template into the harness folder")
    if not target.is_file():
        raise UserError(f"{where}: template file {file} does not exist")
    return target


def _qualified(field: str) -> str:
    return field if "." in field else f"prompt.{field}"


def _check_template(path: Path, field: str, rel: str, doc: HCPDocument) -> str:
    """Read and statically check one template; return its source."""
    file, where = _template_file(path, field, rel), _qualified(field)
    names = {"answer.template": ANSWER_NAMES, "prompt.tool_template": TOOL_NAMES}.get(where, TEMPLATE_NAMES)
    try:
        source = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{file}: field '{where}': template is not UTF-8 text") from None
    env = template_env(doc.family)
    try:
        ast = env.parse(source, name=rel)
    except TemplateSyntaxError as exc:
        raise UserError(f"{file}:{exc.lineno}: field '{where}': template syntax error: {exc.message}") from None
    undefined = sorted(meta.find_undeclared_variables(ast) - set(names))
    if undefined:
        raise UserError(
            f"{file}: field '{where}': template uses undefined variable {undefined[0]!r}; "
            f"templates may use {', '.join(names)} (constants go in [prompt.vars])"
        )
    for node in ast.find_all((nodes.Getattr, nodes.Getitem)):
        if isinstance(node.node, nodes.Name) and node.node.name == "vars":
            key = node.attr if isinstance(node, nodes.Getattr) else getattr(node.arg, "value", None)
            if isinstance(key, str) and key not in doc.prompt.vars:
                raise UserError(
                    f"{file}: field '{where}': template uses undefined variable 'vars.{key}'; "
                    f"declare it under [prompt.vars] (declared: {', '.join(doc.prompt.vars) or 'none'})"
                )
    return source


def _check_model_base(path: Path, doc: HCPDocument) -> tuple[str, ...]:
    """The base exists (a GGUF file is converted only when a model is needed, not here). A base in a package that
    is not installed is a warning: the document is sound, the model an optional install (the error comes when
    the model is needed)."""
    from rsi.bases import PACKAGE, base_path, package_installed

    base = doc.model.base
    try:
        base_path(base, path.parent)
    except UserError as exc:
        if base.startswith(PACKAGE) and not package_installed(base):
            return (f"{path}: field 'model.base': {exc}",)
        raise UserError(f"{path}: field 'model.base': {exc}") from None
    return ()


def _render_failure(harness: Harness, task: Task) -> TemplateRenderError | None:
    for field in TEMPLATE_FIELDS:
        if getattr(harness.document.prompt, field) is not None:
            try:
                harness.render(field, task.payload)
            except TemplateRenderError as exc:
                return exc
    return None


def _check_renders(path: Path, harness: Harness) -> None:
    """Render every template on sample train tasks of the family's lowest levels. The lowest level must
    render; a higher one may fail whole (a fixed-width format has a ceiling) but not in part."""
    try:
        family = get_family(harness.document.family)
    except UserError as exc:
        raise UserError(f"{path}: field 'family': {exc}") from None
    top, round_trip = min(family.min_level + SAMPLE_LEVELS - 1, family.max_level), None
    for level in range(family.min_level, top + 1):
        try:
            tasks = family.tasks("train", SAMPLE_SEED, level, SAMPLE_TASKS)
        except UserError as exc:
            raise UserError(f"{path}: field 'family': cannot draw sample tasks: {exc}") from None
        failures = [(t, err) for t in tasks if (err := _render_failure(harness, t)) is not None]
        # (a tool family judges the final state: its answer template is checked on demonstrations instead)
        if not failures and harness.document.answer.template is not None and family.environment is None:
            round_trip = round_trip or next(filter(None, (_answer_round_trip(path, harness, family, task)
                                                          for task in tasks)), None)
        if not failures or (level > family.min_level and len(failures) == len(tasks)):
            continue
        task, err = failures[0]
        why = ("the family's lowest level must render" if level == family.min_level else
               f"{len(tasks) - len(failures)} of {len(tasks)} sample tasks of this level render: a level must "
               "render for all its tasks or none")
        raise UserError(
            f"{err.file}: field 'prompt.{err.field}': cannot render {family.name} task {task.id} (train split, "
            f"seed {task.seed}, level {level}, index {task.index}, payload {json.dumps(task.payload)}): "
            f"{err.detail}; {why}"
        )
    if round_trip:
        raise _Behaviour(round_trip)


def _answer_round_trip(path: Path, harness: Harness, family: Any, task: Task) -> str | None:
    """Where the answer template writes the task's answer so that the harness's own parser reads back a value the
    family's verifier rejects (re-rendered answers would teach the model wrong replies): what is wrong."""
    from rsi.parsers import get_parser

    answer = harness.document.answer
    where = f"{path}: field 'answer.template'"
    text = harness.render_answer(task.payload, task.answer)
    parsed = get_parser(answer.parser)(text, **answer.params)
    if not parsed.ok or parsed.extra or not family.verify(task, parsed.value):
        got = (parsed.error if not parsed.ok else f"extra content {parsed.extra!r}" if parsed.extra
               else f"the value {parsed.value!r}, which the verifier rejects")
        return (f"{where}: renders the answer of {family.name} task {task.id} (level {task.level}, "
                f"answer {task.answer!r}) as {text!r}, and parser {answer.parser!r} reads back {got}; "
                "make the template write what the parser reads")
    return None


def shipped_harnesses() -> Path:
    """The folder of the harness versions rsi ships (package data; the checkout's ``harness_versions/``)."""
    import rsi.harness_versions

    return Path(rsi.harness_versions.__file__).resolve().parent


def resolve_harness(ref: str | Path) -> Path:
    """The harness version directory ``ref`` names: a directory (or its hcp.toml), a shipped id such as
    ``addition/v2``, ``harness_versions/addition/v2``, or a family alone (its newest shipped version ``v<N>``)."""
    shipped = shipped_harnesses()
    text = str(ref)
    for candidate in (Path(ref), shipped / text, shipped.parent / text):
        if (candidate / "hcp.toml").is_file() or (candidate.name == "hcp.toml" and candidate.is_file()):
            return (candidate.parent if candidate.name == "hcp.toml" else candidate).resolve()
    numbered = [(int(p.parent.name[1:]), p.parent) for p in (shipped / text).glob("v*/hcp.toml")
                if p.parent.name[1:].isdigit()] if "/" not in text and text not in ("", ".", "..") else []
    if numbered:
        return max(numbered)[1]
    known = sorted(f"{p.parent.parent.name}/{p.parent.name}" for p in shipped.glob("*/*/hcp.toml"))
    raise UserError(f"harness {text!r}: not a directory holding hcp.toml, nor a shipped harness id or family; "
                    f"shipped: {', '.join(known) or 'none'}. Pass a harness directory or one of those ids")


_TOLERATED: set[str] = set()  # hashes of documents whose behavioural refusals are warnings (``tolerating``)


def load_harness(path: str | Path) -> Harness:
    """Load and validate a harness version; every problem is a ``UserError`` naming file and field."""
    return _load(path, tolerate=False)


@contextmanager
def tolerating(path: str | Path) -> Iterator[Harness]:
    """While inside, the harness at ``path`` (its content as it is now, wherever it is loaded from) loads though
    checks of what it would do refuse it; each refusal is one of its ``warnings``. Any other content still loads
    only when it passes every check."""
    harness = _load(path, tolerate=True)
    added = harness.hash not in _TOLERATED
    _TOLERATED.add(harness.hash)
    try:
        yield harness
    finally:
        if added:
            _TOLERATED.discard(harness.hash)


def _load(path: str | Path, tolerate: bool) -> Harness:
    file = _resolve(Path(path))
    try:
        raw = tomllib.loads(file.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{file}: not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise UserError(f"{file}: not UTF-8 text") from None
    try:
        doc = HCPDocument.model_validate(raw)
    except ValidationError as exc:
        raise UserError(_explain(file, exc, raw)) from None
    sources = {}
    for field in TEMPLATE_FIELDS:
        rel = getattr(doc.prompt, field)
        if rel is not None:
            sources[rel] = _check_template(file, field, rel, doc)
    if doc.answer.template is not None:
        sources[doc.answer.template] = _check_template(file, "answer.template", doc.answer.template, doc)
    if doc.prompt.tool_template is not None:
        sources[doc.prompt.tool_template] = _check_template(file, "tool_template", doc.prompt.tool_template, doc)
    warnings = _check_model_base(file, doc)
    legacy = LEGACY_CONTRACTS.get(doc.contract.version)
    warnings += (f"{file}: contract version {doc.contract.version!r} is legacy: {legacy}",) if legacy else ()
    harness = Harness(file, doc, sources, warnings)
    tolerate = tolerate or harness.hash in _TOLERATED
    _check_family_rules(file, doc)
    refusals = _refused(lambda: _check_limits(file, doc), tolerate)
    with _time_budget(file, VALIDATE_S):
        refusals += _refused(lambda: _check_renders(file, harness), tolerate)
        if doc.plan is not None:
            _check_plan(file, harness)
        if doc.tools:
            refusals += _refused(lambda: _check_episodes(file, harness), tolerate)
    harness.warnings += tuple(f"tolerated for repair: {r}" for r in refusals)
    return harness


class _OverBudget(BaseException):
    """The validation's time budget ran out (a BaseException: a template's own error handling cannot keep it)."""


@contextmanager
def _time_budget(path: Path, seconds: float) -> Iterator[None]:
    """What runs inside gets ``seconds`` (SIGALRM; in the main thread only, elsewhere it runs unbounded: the proxy
    and the stages load harnesses that were validated when they were first used). A timer already set (a test's
    timeout) is kept: the earlier of the two fires, the other's time goes on."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _OverBudget

    started, handler = time.monotonic(), signal.signal(signal.SIGALRM, expire)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    if 0 < outer < seconds:  # an outer timer due first: it fires as it would have
        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, outer)
    try:
        yield
    except _OverBudget:
        raise UserError(f"{path}: validating it took more than {seconds:g} s (its templates rendered on sample "
                        "tasks, its plan and the family's episodes dry-run under it): a template or a size the "
                        "document sets does too much work; make it do less") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, handler)
        if outer > 0:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 1e-3))


def _refused(check: Any, tolerate: bool) -> tuple[str, ...]:
    """Run a check of what the harness would do: its refusal raised, or (``tolerate``) returned."""
    try:
        check()
    except _Behaviour as exc:
        if not tolerate:
            raise
        return (str(exc),)
    return ()


class _Behaviour(UserError):
    """A refusal for what the harness would do (``tolerating`` makes it a warning)."""


def _check_limits(path: Path, doc: HCPDocument) -> None:
    if doc.decoding.max_new_tokens > doc.limits.max_completion_tokens:
        raise _Behaviour(f"{path}: field 'decoding.max_new_tokens': decoding.max_new_tokens "
                         f"({doc.decoding.max_new_tokens}) exceeds limits.max_completion_tokens "
                         f"({doc.limits.max_completion_tokens}): replies longer than the limit would all fail the "
                         "contract's 'limits' rule; lower the one or raise the other")


def _check_family_rules(path: Path, doc: HCPDocument) -> None:
    """Every ``family:<name>`` rule of the contract is one the family declares."""
    asked = [r.removeprefix(FAMILY_RULE) for r in doc.contract.rules if r.startswith(FAMILY_RULE)]
    family = get_family(doc.family) if asked else None
    unknown = [name for name in asked if name not in family.rules]
    if unknown:
        raise UserError(f"{path}: field 'contract.rules': family {doc.family!r} declares no rule {unknown[0]!r} "
                        f"(its rules: {', '.join(FAMILY_RULE + r for r in family.rules) or 'none'})")


def _check_episodes(path: Path, harness: Harness) -> None:
    """The family has an environment with every tool the harness exposes, and the family's demonstrations of
    sample tasks play out under this harness: each call is written in its syntax, parsed back as the same call,
    its result rendered, and the final state verified."""
    doc, family = harness.document, get_family(harness.document.family)
    missing = [r for r in EPISODE_RULES if r not in doc.contract.rules]
    if missing:
        raise UserError(f"{path}: field 'contract.rules': the harness exposes tools but lacks {missing}: the auditor "
                        "must check the calls and replay them on the family's environment")
    if (doc.tool_calls is None and not harness.chat) or doc.prompt.tool_template is None:
        raise UserError(f"{path}: a harness that exposes tools needs [tool_calls] (how a call is written) and "
                        "prompt.tool_template (how a result reads); in chat mode only the tool_template")
    if doc.plan is not None:
        raise UserError(f"{path}: field 'plan': a plan poses a task as one-call parts, a harness with tools runs "
                        "episodes; use one or the other")
    env = family.environment
    if env is None:
        raise UserError(f"{path}: field 'tools': family {family.name!r} has no environment, so no tool can run")
    unknown = sorted({t.name for t in harness.document.tools} - set(env.tools))
    if unknown:
        raise UserError(f"{path}: field 'tools': family {family.name!r} declares no tool {unknown[0]!r} "
                        f"(its tools: {', '.join(sorted(env.tools)) or 'none'})")
    if family.expert is None or harness.chat:  # (a demonstration writes calls in the [tool_calls] syntax)
        return
    for level in range(family.min_level, min(family.min_level + SAMPLE_LEVELS - 1, family.max_level) + 1):
        for task in family.tasks("train", SAMPLE_SEED, level, SAMPLE_TASKS):
            try:
                demonstration(harness, family, task)
            except UserError as exc:
                raise _Behaviour(f"{path}: cannot play {family.name} task {task.id} (level {level}, payload "
                                f"{json.dumps(task.payload)}) as an episode: {exc}") from None


def _check_plan(path: Path, harness: Harness) -> None:
    """The plan is one the family declares, and on sample tasks of every level up to ``PLAN_LEVELS``, fed the
    right answer to each call, it poses only calls this harness can render and composes the task's answer."""
    plan, family = harness.document.plan, get_family(harness.document.family)
    if plan.name not in family.plans:
        known = ", ".join(sorted(family.plans)) or "none"
        raise UserError(f"{path}: field 'plan.name': family {family.name!r} declares no plan {plan.name!r} "
                        f"(its plans: {known})")
    for level in range(family.min_level, min(PLAN_LEVELS, family.max_level) + 1):
        for task in family.tasks("train", SAMPLE_SEED, level, SAMPLE_TASKS):
            try:
                calls, answer = calls_with_gold(harness, family, task)
                for call in calls:
                    harness.prompt(call.payload)
            except UserError as exc:
                raise UserError(f"{path}: field 'plan': cannot pose {family.name} task {task.id} (level {level}, "
                                f"payload {json.dumps(task.payload)}): {exc}") from None
            if not family.verify(task, answer):
                raise UserError(f"{path}: field 'plan': plan {plan.name!r} composes {answer!r} for {family.name} "
                                f"task {task.id} (level {level}) from right answers to its calls, not {task.answer!r}")
