"""HCP (Harness Context Protocol) documents: ``harness_versions/<family>/<version>/hcp.toml``.

A document names the model it drives, its prompt templates, decoding, tools, limits, the answer
format and the contract the auditor checks. ``load_harness`` validates all of it, templates included,
and raises a ``UserError`` naming the file, the field and what was expected.
"""

from __future__ import annotations

import tomllib
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from jinja2 import StrictUndefined, TemplateError, TemplateSyntaxError, meta, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, model_validator

from rsi.errors import UserError
from rsi.hashing import digest, digest_bytes
from rsi.parsers import PARSERS, digits_lsb

HCP_VERSIONS = ("1.0",)
CONTRACT_RULES = (
    "ids_consistent",
    "prompt_rendered",
    "limits",
    "tools_allowed",
    "answer_format",
    "no_extra_content",
    "answer_correct",
)
TEMPLATE_NAMES = ("task", "vars", "tools")


class Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelSource(Section):
    base: str = Field("builtin", description="'builtin' or a local Hugging Face model directory")
    adapter: str = Field("lineage", description="'none', 'lineage' (the lineage's champion) or a directory")


class Prompt(Section):
    mode: Literal["completion", "chat"] = "completion"
    template: str = Field(description="path of the user/prompt template, relative to hcp.toml")
    system_template: str | None = None
    vars: dict[str, JsonValue] = Field(default_factory=dict)


class Decoding(Section):
    temperature: float = Field(1.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(ge=1)
    samples: int = Field(1, ge=1)
    stop: tuple[str, ...] = ()


class Limits(Section):
    max_steps: int = Field(1, ge=1)
    max_prompt_tokens: int = Field(ge=1)
    max_completion_tokens: int = Field(ge=1)


class Answer(Section):
    parser: str
    params: dict[str, JsonValue] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known_parser(self) -> Answer:
        if self.parser not in PARSERS:
            raise ValueError(f"unknown parser {self.parser!r}; expected one of {', '.join(sorted(PARSERS))}")
        expected = PARSERS[self.parser][1]
        if set(self.params) != expected:
            raise ValueError(
                f"parser {self.parser!r} takes params {sorted(expected)}, got {sorted(self.params)}"
            )
        return self


class Tool(Section):
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    description: str = ""
    parameters: dict[str, JsonValue] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class Contract(Section):
    version: str = Field(min_length=1)
    rules: tuple[str, ...] = CONTRACT_RULES

    @model_validator(mode="after")
    def _known_rules(self) -> Contract:
        unknown = sorted(set(self.rules) - set(CONTRACT_RULES))
        if unknown:
            raise ValueError(f"unknown rules {unknown}; expected a subset of {list(CONTRACT_RULES)}")
        return self


class HCPDocument(Section):
    """The validated content of one ``hcp.toml``."""

    hcp_version: Literal[HCP_VERSIONS] = Field(description="protocol version")  # type: ignore[valid-type]
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")
    version: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    family: str
    description: str = ""
    model: ModelSource = ModelSource()
    prompt: Prompt
    decoding: Decoding
    limits: Limits
    answer: Answer
    tools: tuple[Tool, ...] = ()
    contract: Contract

    @model_validator(mode="after")
    def _limits_cover_decoding(self) -> HCPDocument:
        if self.decoding.max_new_tokens > self.limits.max_completion_tokens:
            raise ValueError("decoding.max_new_tokens exceeds limits.max_completion_tokens")
        return self


def template_env() -> ImmutableSandboxedEnvironment:
    """The only environment harness templates are rendered in: sandboxed, strict about undefined names."""
    env = ImmutableSandboxedEnvironment(undefined=StrictUndefined, autoescape=False, keep_trailing_newline=False)
    env.filters["digits_lsb"] = digits_lsb
    return env


class Harness:
    """A loaded harness version: the document, its directory and its compiled templates."""

    def __init__(self, path: Path, document: HCPDocument, sources: dict[str, str]):
        self.path = path
        self.document = document
        self.sources = sources
        env = template_env()
        self._templates = {name: env.from_string(src) for name, src in sources.items()}

    @property
    def id(self) -> str:
        return f"{self.document.id}/{self.document.version}"

    @cached_property
    def hash(self) -> str:
        """Digest of the document's content and its templates' bytes; comments and key order do not count."""
        files = digest_bytes([(name, src.encode()) for name, src in self.sources.items()])
        return digest({"document": self.document.model_dump(mode="json"), "templates": files})

    @property
    def contract_version(self) -> str:
        return self.document.contract.version

    def render(self, field: str, task_payload: dict[str, Any]) -> str:
        """Render the template named by ``prompt.<field>`` for one task."""
        name = getattr(self.document.prompt, field)
        context = {
            "task": task_payload,
            "vars": self.document.prompt.vars,
            "tools": [t.model_dump(mode="json") for t in self.document.tools],
        }
        try:
            return self._templates[name].render(context)
        except (TemplateError, ValueError, TypeError) as exc:
            raise UserError(f"{self.path.parent / name}: prompt.{field}: cannot render: {exc}") from None

    def prompt(self, task_payload: dict[str, Any]) -> str:
        return self.render("template", task_payload)


def _resolve(path: Path) -> Path:
    path = Path(path)
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


def _explain(path: Path, exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        field = ".".join(str(p) for p in loc) or "(document)"
        if err["type"] == "extra_forbidden":
            owner = _field_model(HCPDocument, loc)
            allowed = ", ".join(owner.model_fields) if owner else "see the HCP documentation"
            lines.append(f"{path}: field {field!r}: unknown key; expected one of: {allowed}")
        elif err["type"] == "missing":
            lines.append(f"{path}: field {field!r}: required but missing")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{path}: field {field!r}: {msg} (got {err.get('input')!r})")
    return "\n".join(lines)


def _check_template(path: Path, field: str, rel: str, doc: HCPDocument) -> str:
    """Read and statically check one template; return its source."""
    file = path.parent / rel
    if not file.is_file():
        raise UserError(f"{path}: field 'prompt.{field}': template file {file} does not exist")
    source = file.read_text(encoding="utf-8")
    env = template_env()
    try:
        ast = env.parse(source, name=rel)
    except TemplateSyntaxError as exc:
        raise UserError(f"{file}:{exc.lineno}: field 'prompt.{field}': template syntax error: {exc.message}") from None
    undefined = sorted(meta.find_undeclared_variables(ast) - set(TEMPLATE_NAMES))
    if undefined:
        raise UserError(
            f"{file}: field 'prompt.{field}': template uses undefined variable {undefined[0]!r}; "
            f"templates may use {', '.join(TEMPLATE_NAMES)} (constants go in [prompt.vars])"
        )
    for node in ast.find_all((nodes.Getattr, nodes.Getitem)):
        if isinstance(node.node, nodes.Name) and node.node.name == "vars":
            key = node.attr if isinstance(node, nodes.Getattr) else getattr(node.arg, "value", None)
            if isinstance(key, str) and key not in doc.prompt.vars:
                raise UserError(
                    f"{file}: field 'prompt.{field}': template uses undefined variable 'vars.{key}'; "
                    f"declare it under [prompt.vars] (declared: {', '.join(doc.prompt.vars) or 'none'})"
                )
    return source


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
        raise UserError(_explain(file, exc)) from None
    sources = {}
    for field in ("template", "system_template"):
        rel = getattr(doc.prompt, field)
        if rel is not None:
            sources[rel] = _check_template(file, field, rel, doc)
    return Harness(file, doc, sources)
