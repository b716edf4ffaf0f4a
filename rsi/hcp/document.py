"""The HCP document's schema: the sections of one ``hcp.toml`` as typed, validated models, and the protocol's
constants (contract rules and versions, the names a template may use)."""

from __future__ import annotations

from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationInfo, field_validator, model_validator

from rsi.parsers import parser_names, parser_spec

HCP_VERSIONS = ("1.0",)
CONTRACT_RULES = (
    "ids_consistent",
    "prompt_rendered",
    "messages_allowed",
    "limits",
    "stopped",
    "tools_allowed",
    "text_matches_calls",
    "results_replayed",
    "states_replayed",
    "answer_format",
    "no_extra_content",
    "answer_correct",
)
# A family's own rules (``TaskFamily.rules``) are listed as ``family:<name>``; loading checks the family declares
# each one (``rsi.hcp.load``), the auditor judges them (``rsi.audit``).
FAMILY_RULE = "family:"
# A harness that exposes tools must list these: the auditor replays every call on the family's environment.
EPISODE_RULES = ("tools_allowed", "results_replayed", "states_replayed")
# Without these a verdict means nothing: the task is authentic, the model saw the harness's prompt and
# nothing else, what training reads of each turn is the call the replay ran, and the answer is right.
REQUIRED_RULES = ("ids_consistent", "prompt_rendered", "messages_allowed", "text_matches_calls", "answer_correct")
# Contract version -> the rules a contract of that version must list. Version 1 predates messages_allowed
# and stopped; its documents (addition/v1) stay loadable, with a warning, because they are immutable. Version 2
# predates text_matches_calls: its documents stay as they are (their stored verdicts too); new versions use 3.
CONTRACT_VERSIONS: dict[str, tuple[str, ...]] = {
    "1": ("ids_consistent", "prompt_rendered", "answer_correct"),
    "2": ("ids_consistent", "prompt_rendered", "messages_allowed", "answer_correct"),
    "3": REQUIRED_RULES,
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


# A harness is untrusted input: every size a document sets is bounded, and so is what its templates render
# (``rsi.hcp.harness``) and the time its validation takes (``rsi.hcp.load``).
MAX_TOKENS = 1 << 20  # decoding.max_new_tokens, limits.max_prompt_tokens, limits.max_completion_tokens
MAX_SAMPLES = 1024  # decoding.samples
MAX_STEPS = 1024  # limits.max_steps
MAX_NUMBER = 10**6  # the magnitude of a number in prompt.vars, answer.params or plan.params
MAX_SETTINGS_CHARS = 100_000  # prompt.vars, answer.params, plan.params, each as JSON
MAX_RENDER_CHARS = 1_000_000  # one rendered prompt, tool message or answer
VALIDATE_S = 5.0  # the time budget of a document's validation (its templates rendered on sample tasks)


def bounded(settings: dict[str, Any], what: str) -> dict[str, Any]:
    """``settings`` (JSON values a template or parser reads), refused where a number's magnitude exceeds
    MAX_NUMBER or the whole exceeds MAX_SETTINGS_CHARS as JSON: sizes a document sets stay sizes a run can
    afford."""
    import json

    def numbers(value: Any, where: str) -> None:
        if isinstance(value, (dict, list)):
            for key, item in value.items() if isinstance(value, dict) else enumerate(value):
                numbers(item, f"{where}.{key}" if where else str(key))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > MAX_NUMBER:
            raise ValueError(f"{what}.{where} = {value}: numbers here are at most {MAX_NUMBER:,} in magnitude (a "
                             "size a template renders or a parser checks)")

    numbers(settings, "")
    size = len(json.dumps(settings))
    if size > MAX_SETTINGS_CHARS:
        raise ValueError(f"{what} is {size:,} characters as JSON; at most {MAX_SETTINGS_CHARS:,}")
    return settings


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

    @field_validator("vars")
    @classmethod
    def _bounded_vars(cls, value: dict[str, JsonValue]) -> dict[str, JsonValue]:
        return bounded(value, "prompt.vars")


class Decoding(Section):
    temperature: float = Field(1.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(ge=1, le=MAX_TOKENS)
    samples: int = Field(1, ge=1, le=MAX_SAMPLES, description="completions per task when the harness's own k is used")
    stop: tuple[str, ...] = ()


class Limits(Section):
    max_steps: int = Field(1, ge=1, le=MAX_STEPS)
    max_prompt_tokens: int = Field(ge=1, le=MAX_TOKENS)
    max_completion_tokens: int = Field(ge=1, le=MAX_TOKENS)


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
        if name not in parser_names():
            raise ValueError(f"unknown parser {name!r}; expected one of {', '.join(parser_names())}")
        return name

    @field_validator("params")
    @classmethod
    def _typed_params(cls, params: dict[str, JsonValue], info: ValidationInfo) -> dict[str, JsonValue]:
        if info.data.get("parser") not in parser_names():  # the parser's own error says what is wrong
            return params
        spec = parser_spec(info.data["parser"])
        return spec.params.model_validate(bounded(params, "answer.params")).model_dump(mode="json")


class Plan(Section):
    name: str = Field(description=(
        "a decomposition the task family declares (its ``plans``): how a task is posed as model calls this "
        "harness can pose, e.g. a long addition as additions of digit chunks; the parts are tasks of the "
        "family, audited like any other, and the task's answer is composed from their answers"))
    params: dict[str, JsonValue] = Field(default_factory=dict, description="the plan's own settings")

    @field_validator("params")
    @classmethod
    def _bounded_params(cls, value: dict[str, JsonValue]) -> dict[str, JsonValue]:
        return bounded(value, "plan.params")


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
        unknown = sorted(r for r in set(rules) - set(CONTRACT_RULES) if not r.startswith(FAMILY_RULE))
        if unknown:
            raise ValueError(f"unknown rules {unknown}; expected a subset of {list(CONTRACT_RULES)} or the family's "
                             f"own rules as '{FAMILY_RULE}<name>'")
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
        names = [t.name for t in self.tools]
        if len(set(names)) < len(names):
            raise ValueError(f"tools: duplicate tool names {sorted({n for n in names if names.count(n) > 1})}")
        contract = self.contract
        if self.answer.require_stop and "stopped" not in contract.rules and contract.version not in LEGACY_CONTRACTS:
            raise ValueError("answer.require_stop = true but contract.rules lacks 'stopped', the rule that checks "
                             "it; add 'stopped' or set require_stop = false")
        return self
