"""HCP (Harness Context Protocol) documents: ``harness_versions/<family>/<version>/hcp.toml``.

A document names the model it drives, its prompt templates, decoding, tools, limits, the answer
format and the contract the auditor checks. Documents are untrusted input: ``load_harness`` validates
all of it (templates stay inside the harness folder and are rendered on sample tasks of the family,
parser parameters and tool schemas are typed, the contract holds the rules a verdict needs, every field
is one rsi honours) and raises a ``UserError`` naming the file, the field and what was expected.
"""

from __future__ import annotations

import json
import tomllib
from functools import cached_property
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Literal, NamedTuple

import jsonschema
from jinja2 import StrictUndefined, TemplateSyntaxError, meta, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import (BaseModel, ConfigDict, Field, JsonValue, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from rsi.errors import UserError
from rsi.hashing import digest, digest_bytes
from rsi.models import Task
from rsi.parsers import PARSERS, digits_lsb
from rsi.tasks import get_family

HCP_VERSIONS = ("1.0",)
CONTRACT_RULES = (
    "ids_consistent",
    "prompt_rendered",
    "messages_allowed",
    "limits",
    "stopped",
    "tools_allowed",
    "results_replayed",
    "states_replayed",
    "answer_format",
    "no_extra_content",
    "answer_correct",
)
# A harness that exposes tools must list these: the auditor replays every call on the family's environment.
EPISODE_RULES = ("tools_allowed", "results_replayed", "states_replayed")
# Without these a verdict means nothing: the task is authentic, the model saw the harness's prompt and
# nothing else, and the answer is right.
REQUIRED_RULES = ("ids_consistent", "prompt_rendered", "messages_allowed", "answer_correct")
# Contract version -> the rules a contract of that version must list. Version 1 predates messages_allowed
# and stopped; its documents (addition/v1) stay loadable, with a warning, because they are immutable.
CONTRACT_VERSIONS: dict[str, tuple[str, ...]] = {
    "1": ("ids_consistent", "prompt_rendered", "answer_correct"),
    "2": REQUIRED_RULES,
}
LEGACY_CONTRACTS = {
    "1": "it does not require messages_allowed, so a trajectory with messages beyond the rendered prompt "
         "and one reply can pass; new harness versions use contract version 2",
}
# (section, field) added after documents were first hashed: hashed only when set (see Harness.hash)
LATER_FIELDS = (("answer", "template"), ("plan",), ("prompt", "tool_template"), ("tool_calls",))
TEMPLATE_NAMES = ("task", "vars", "tools")
ANSWER_NAMES = (*TEMPLATE_NAMES, "answer")  # an answer template also sees the answer it writes
TOOL_NAMES = (*TEMPLATE_NAMES, "call", "result")  # a tool template writes one call's result
TEMPLATE_FIELDS = ("template", "system_template")
# Validation renders every template on SAMPLE_TASKS train tasks of each of the family's lowest SAMPLE_LEVELS.
SAMPLE_LEVELS, SAMPLE_TASKS, SAMPLE_SEED = 3, 3, 0
PLAN_LEVELS = 25  # a plan is dry-run (right answers fed to its calls) on sample tasks of every level up to this


def required_rules(contract_version: str) -> tuple[str, ...]:
    """The rules a contract of ``contract_version`` must list (REQUIRED_RULES for the current version)."""
    return CONTRACT_VERSIONS.get(contract_version, REQUIRED_RULES)


class Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelSource(Section):
    base: str = Field("builtin", description=(
        "'builtin' (rsi's own small model, built from the profile's base recipe), a local Hugging Face model "
        "directory holding a config.json or a .gguf file (absolute or relative to the harness folder), or "
        "'package:<python package>/<file>', a file an installed package ships (rsi.bases)"))
    adapter: Literal["lineage", "none"] = Field("lineage", description=(
        "'lineage': the model runs with the lineage's champion adapter (none until a first candidate is "
        "promoted) and training continues from it; 'none': the base model alone, with no adapter loaded "
        "or trained under this harness (a fixed baseline)"))


class Prompt(Section):
    mode: Literal["completion", "chat"] = Field("completion", description=(
        "'completion': the model's input is the rendered system_template (if any) followed by the rendered "
        "template, concatenated with nothing between them. 'chat': the messages (system_template as the system "
        "message, template as the user's, tool_template as tool messages) go through the base model's chat "
        "template, and tool calls are written in the model's own format (no [tool_calls] section)"))
    template: str = Field(description="path of the user/prompt template, relative to hcp.toml, inside its folder")
    system_template: str | None = Field(None, description=(
        "path of a system template, relative to hcp.toml; in completion mode its text comes first, so end "
        "it with the separator you want (Jinja drops one trailing newline of a file: write {{ '\\n' }})"))
    vars: dict[str, JsonValue] = Field(default_factory=dict)
    tool_template: str | None = Field(None, description=(
        "path of the template that writes a tool message (``result``: the tool's result as text; ``call``: its "
        "name and arguments), relative to hcp.toml; required when the harness exposes tools. In completion "
        "mode an episode reads as the prompt, then each assistant turn followed by EOS, each tool message "
        "as this template writes it"))


class Decoding(Section):
    temperature: float = Field(1.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(ge=1)
    samples: int = Field(1, ge=1, description="completions per task when the harness's own k is used")
    stop: tuple[str, ...] = ()


class Limits(Section):
    max_steps: int = Field(1, ge=1)
    max_prompt_tokens: int = Field(ge=1)
    max_completion_tokens: int = Field(ge=1)


class Answer(Section):
    parser: str
    params: dict[str, JsonValue] = Field(default_factory=dict, description="checked against the parser's params model")
    require_stop: bool = Field(True, description="a reply must end with EOS or a stop string, not be cut by length")
    template: str | None = Field(None, description=(
        "path of a template that writes a task's answer (``answer``) in this harness's format, relative to "
        "hcp.toml: what a correct reply looks like, so audited answers can be re-rendered under this harness "
        "(migration) and gold answers rendered; the parser must read back what it writes"))

    @field_validator("parser")
    @classmethod
    def _known_parser(cls, name: str) -> str:
        if name not in PARSERS:
            raise ValueError(f"unknown parser {name!r}; expected one of {', '.join(sorted(PARSERS))}")
        return name

    @field_validator("params")
    @classmethod
    def _typed_params(cls, params: dict[str, JsonValue], info: ValidationInfo) -> dict[str, JsonValue]:
        spec = PARSERS.get(info.data.get("parser", ""))
        if spec is None:  # the parser's own error says what is wrong
            return params
        return spec.params.model_validate(params).model_dump(mode="json")


class Plan(Section):
    name: str = Field(description=(
        "a decomposition the task family declares (its ``plans``): how a task is posed as model calls this "
        "harness can pose, e.g. a long addition as additions of digit chunks; the parts are tasks of the "
        "family, audited like any other, and the task's answer is composed from their answers"))
    params: dict[str, JsonValue] = Field(default_factory=dict, description="the plan's own settings")


class ToolCalls(Section):
    syntax: Literal["python"] = Field("python", description=(
        "how an assistant turn writes a tool call: 'python' is one call per turn, ``name(v1, v2, ...)``, the "
        "values JSON literals given in the order of the tool's schema properties; a turn that is not a call "
        "is the final reply"))


class Tool(Section):
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    description: str = ""
    parameters: dict[str, JsonValue] = Field(default_factory=lambda: {"type": "object", "properties": {}})

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, schema: dict[str, JsonValue]) -> dict[str, JsonValue]:
        validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            where = "/".join(str(p) for p in exc.absolute_path) or "(top)"
            raise ValueError(f"not a valid JSON Schema ({validator.__name__}) at {where}: {exc.message}") from None
        if schema.get("type") != "object":
            raise ValueError('tool arguments are a JSON object: the schema needs "type": "object" (and "properties")')
        remote = _remote_refs(schema)
        if remote:
            raise ValueError(f"$ref {remote[0]!r} is not local; only '#/...' references are allowed")
        return schema


def _remote_refs(value: Any) -> list[str]:
    """``$ref``/``$dynamicRef`` values that point outside the schema (the auditor must never fetch them)."""
    if isinstance(value, dict):
        refs = [v for k, v in value.items() if k in ("$ref", "$dynamicRef") and not str(v).startswith("#")]
        return refs + [r for v in value.values() for r in _remote_refs(v)]
    if isinstance(value, list):
        return [r for v in value for r in _remote_refs(v)]
    return []


class Contract(Section):
    version: str = Field(description=f"contract version, one of {', '.join(CONTRACT_VERSIONS)}")
    rules: tuple[str, ...] = CONTRACT_RULES

    @field_validator("version")
    @classmethod
    def _known_version(cls, version: str) -> str:
        if version not in CONTRACT_VERSIONS:
            raise ValueError(f"unknown contract version {version!r}; expected one of {', '.join(CONTRACT_VERSIONS)}")
        return version

    @field_validator("rules")
    @classmethod
    def _meaningful_rules(cls, rules: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        required = required_rules(info.data.get("version", ""))
        if not rules:
            raise ValueError(f"no rules: such a contract passes every trajectory; list at least {list(required)}")
        unknown = sorted(set(rules) - set(CONTRACT_RULES))
        if unknown:
            raise ValueError(f"unknown rules {unknown}; expected a subset of {list(CONTRACT_RULES)}")
        duplicates = sorted({r for r in rules if rules.count(r) > 1})
        if duplicates:
            raise ValueError(f"rules {duplicates} listed more than once; list each rule once")
        missing = [r for r in required if r not in rules]
        if missing:
            raise ValueError(f"missing required rules {missing}: without them a verdict means nothing; "
                             f"a contract must list {list(required)}")
        return rules


class HCPDocument(Section):
    """The validated content of one ``hcp.toml``."""

    hcp_version: Literal[HCP_VERSIONS] = Field(description="protocol version")  # type: ignore[valid-type]
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")
    version: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    family: str = Field(description="a registered task family (rsi tasks list)")
    description: str = ""
    model: ModelSource = ModelSource()
    prompt: Prompt
    decoding: Decoding
    limits: Limits
    answer: Answer
    tools: tuple[Tool, ...] = ()
    contract: Contract
    plan: Plan | None = Field(None, description="pose each task through the family's plan (None: in one call)")
    tool_calls: ToolCalls | None = Field(None, description="how tool calls are written; required with tools")

    @field_validator("plan", "tool_calls")
    @classmethod
    def _completion_mode_only(cls, value: Any, info: ValidationInfo) -> Any:
        prompt = info.data.get("prompt")
        if value is not None and prompt is not None and prompt.mode == "chat":
            why = ("a plan poses its calls as completion prompts" if info.field_name == "plan" else
                   "in chat mode a model writes tool calls in its own chat format (the backend parses them)")
            raise ValueError(f"{why}; drop [{info.field_name}] or use prompt.mode = 'completion'")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> HCPDocument:
        if self.decoding.max_new_tokens > self.limits.max_completion_tokens:
            raise ValueError("decoding.max_new_tokens exceeds limits.max_completion_tokens")
        names = [t.name for t in self.tools]
        if len(set(names)) < len(names):
            raise ValueError(f"tools: duplicate tool names {sorted({n for n in names if names.count(n) > 1})}")
        contract = self.contract
        if self.answer.require_stop and "stopped" not in contract.rules and contract.version not in LEGACY_CONTRACTS:
            raise ValueError("answer.require_stop = true but contract.rules lacks 'stopped', the rule that checks "
                             "it; add 'stopped' or set require_stop = false")
        return self


def template_env() -> ImmutableSandboxedEnvironment:
    """The only environment harness templates are rendered in: sandboxed, strict about undefined names."""
    env = ImmutableSandboxedEnvironment(undefined=StrictUndefined, autoescape=False, keep_trailing_newline=False)
    env.filters["digits_lsb"] = digits_lsb
    return env


class PromptMessage(NamedTuple):
    role: Literal["system", "user"]
    content: str


class TemplateRenderError(UserError):
    """A template failed for one task; ``rsi.evaluate.expressible`` reads this as 'level not posable'."""

    def __init__(self, file: Path, field: str, cause: BaseException):
        self.file, self.field = file, field
        self.detail = f"{type(cause).__name__}: {cause}"
        where = field if "." in field else f"prompt.{field}"
        super().__init__(f"{file}: field '{where}': cannot render: {self.detail}")


class Harness:
    """A loaded harness version: the document, its directory and its compiled templates."""

    def __init__(self, path: Path, document: HCPDocument, sources: dict[str, str], warnings: tuple[str, ...] = ()):
        self.path = path
        self.document = document
        self.sources = sources
        self.warnings = warnings  # legacy but loadable: the CLI shows these
        env = template_env()
        self._templates = {name: env.from_string(src) for name, src in sources.items()}

    @property
    def id(self) -> str:
        return f"{self.document.id}/{self.document.version}"

    @property
    def folder(self) -> Path:
        return self.path.parent

    @cached_property
    def hash(self) -> str:
        """Digest of the document's content and its templates' bytes; comments and key order do not count.
        A field added to the protocol later counts only when set (``LATER_FIELDS``), so the documents hashed
        before it existed keep their hash: a used harness stays the same harness."""
        files = digest_bytes([(name, src.encode()) for name, src in self.sources.items()])
        document = self.document.model_dump(mode="json")
        for *path, field in LATER_FIELDS:
            node = document
            for key in path:
                node = node[key]
            if node.get(field) is None:
                node.pop(field, None)
        return digest({"document": document, "templates": files})

    @cached_property
    def tool_schemas(self) -> dict[str, dict[str, Any]]:
        """The JSON schema of each tool the harness exposes, by name (what the environment checks calls against)."""
        return {t.name: t.parameters for t in self.document.tools}

    @property
    def contract_version(self) -> str:
        return self.document.contract.version

    @property
    def chat(self) -> bool:
        return self.document.prompt.mode == "chat"

    def base_model_dir(self, home: Path | None = None) -> Path | None:
        """The Hugging Face model directory ``model.base`` names (a GGUF file converted once into ``home``'s
        cache, rsi.bases); None for 'builtin'."""
        from rsi.bases import model_dir

        return model_dir(self.document.model.base, self.folder, home)

    @cached_property
    def chat_tools(self) -> list[dict[str, Any]]:
        """The tools in the OpenAI/Hugging Face chat format (``tools=`` of a chat template or request)."""
        return [{"type": "function", "function": t.model_dump(mode="json")} for t in self.document.tools]

    def render(self, field: str, task_payload: dict[str, Any]) -> str:
        """Render the template named by ``prompt.<field>`` for one task."""
        name = getattr(self.document.prompt, field)
        if name is None:
            raise UserError(f"{self.path}: field 'prompt.{field}' is not set; nothing to render")
        context = {
            "task": task_payload,
            "vars": self.document.prompt.vars,
            "tools": [t.model_dump(mode="json") for t in self.document.tools],
        }
        try:
            return self._templates[name].render(context)
        except Exception as exc:  # an untrusted template may fail in any way; report it, never a traceback
            raise TemplateRenderError(self.folder / name, field, exc) from None

    def render_answer(self, task_payload: dict[str, Any], answer: Any) -> str:
        """A correct reply to the task in this harness's format (``answer.template``), without EOS."""
        name = self.document.answer.template
        if name is None:
            raise UserError(f"{self.path}: field 'answer.template' is not set, so answers cannot be written in "
                            "this harness's format; add an answer template")
        context = {"task": task_payload, "vars": self.document.prompt.vars, "answer": answer,
                   "tools": [t.model_dump(mode="json") for t in self.document.tools]}
        try:
            return self._templates[name].render(context)
        except Exception as exc:  # noqa: BLE001 - as for prompts: a failed render is reported, never raised raw
            raise TemplateRenderError(self.folder / name, "answer.template", exc) from None

    def render_tool(self, task_payload: dict[str, Any], call: dict[str, Any], result: str) -> str:
        """A tool message: the result of ``call`` (name, arguments) as the model reads it."""
        name = self.document.prompt.tool_template
        if name is None:
            raise UserError(f"{self.path}: field 'prompt.tool_template' is not set, so tool results cannot be "
                            "shown to the model; add a tool template")
        context = {"task": task_payload, "vars": self.document.prompt.vars, "call": call, "result": result,
                   "tools": [t.model_dump(mode="json") for t in self.document.tools]}
        try:
            return self._templates[name].render(context)
        except Exception as exc:  # noqa: BLE001 - as for prompts: a failed render is reported, never raised raw
            raise TemplateRenderError(self.folder / name, "prompt.tool_template", exc) from None

    def prompt_messages(self, task_payload: dict[str, Any]) -> list[PromptMessage]:
        """What the model is shown for one task: ("system", ...) if there is a system_template, then ("user", ...)."""
        messages = []
        if self.document.prompt.system_template is not None:
            messages.append(PromptMessage("system", self.render("system_template", task_payload)))
        messages.append(PromptMessage("user", self.render("template", task_payload)))
        return messages

    def prompt(self, task_payload: dict[str, Any]) -> str:
        """The model's input text (completion mode): the contents of ``prompt_messages``, concatenated in
        order with nothing between them."""
        return "".join(m.content for m in self.prompt_messages(task_payload))


# ---- loading and validation ----------------------------------------------------------------------


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
                allowed = ", ".join(PARSERS[parser].params.model_fields) or f"none (parser {parser!r} takes no params)"
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
    env = template_env()
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
    top = min(family.min_level + SAMPLE_LEVELS - 1, family.max_level)
    for level in range(family.min_level, top + 1):
        try:
            tasks = family.tasks("train", SAMPLE_SEED, level, SAMPLE_TASKS)
        except UserError as exc:
            raise UserError(f"{path}: field 'family': cannot draw sample tasks: {exc}") from None
        failures = [(t, err) for t in tasks if (err := _render_failure(harness, t)) is not None]
        # (a tool family judges the final state: its answer template is checked on demonstrations instead)
        if not failures and harness.document.answer.template is not None and family.environment is None:
            for task in tasks:
                _check_answer_round_trip(path, harness, family, task)
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


def _check_answer_round_trip(path: Path, harness: Harness, family: Any, task: Task) -> None:
    """The answer template writes the task's answer so that the harness's own parser reads back a value the
    family's verifier accepts: otherwise re-rendered answers would teach the model wrong replies."""
    from rsi.parsers import get_parser

    answer = harness.document.answer
    where = f"{path}: field 'answer.template'"
    text = harness.render_answer(task.payload, task.answer)
    parsed = get_parser(answer.parser)(text, **answer.params)
    if not parsed.ok or parsed.extra or not family.verify(task, parsed.value):
        got = (parsed.error if not parsed.ok else f"extra content {parsed.extra!r}" if parsed.extra
               else f"the value {parsed.value!r}, which the verifier rejects")
        raise UserError(f"{where}: renders the answer of {family.name} task {task.id} (level {task.level}, "
                        f"answer {task.answer!r}) as {text!r}, and parser {answer.parser!r} reads back {got}; "
                        "make the template write what the parser reads")


def shipped_harnesses() -> Path:
    """The folder of the harness versions rsi ships (package data; the checkout's ``harness_versions/``)."""
    import harness_versions

    return Path(harness_versions.__file__).resolve().parent


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


def load_harness(path: str | Path) -> Harness:
    """Load and validate a harness version; every problem is a ``UserError`` naming file and field."""
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
    _check_renders(file, harness)
    if doc.plan is not None:
        _check_plan(file, harness)
    if doc.tools:
        _check_episodes(file, harness)
    return harness


def _check_episodes(path: Path, harness: Harness) -> None:
    """The family has an environment with every tool the harness exposes, and the family's demonstrations of
    sample tasks play out under this harness: each call is written in its syntax, parsed back as the same call,
    its result rendered, and the final state verified."""
    from rsi.episodes import demonstration

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
                raise UserError(f"{path}: cannot play {family.name} task {task.id} (level {level}, payload "
                                f"{json.dumps(task.payload)}) as an episode: {exc}") from None


def _check_plan(path: Path, harness: Harness) -> None:
    """The plan is one the family declares, and on sample tasks of every level up to ``PLAN_LEVELS``, fed the
    right answer to each call, it poses only calls this harness can render and composes the task's answer."""
    from rsi.plans import calls_with_gold

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
