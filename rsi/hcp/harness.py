"""A loaded harness version (``Harness``): its document, folder and compiled templates, and what it renders: the
prompt messages of a task, a tool message, a correct answer in its format."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any, Literal, NamedTuple

from jinja2 import StrictUndefined
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rsi import plugins
from rsi.errors import UserError
from rsi.hashing import digest, digest_bytes
from rsi.hcp.document import LATER_FIELDS, MAX_RENDER_CHARS, HCPDocument
from rsi.parsers import digits_lsb



class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox (ranges bounded, no attribute escapes), and repetition (``'x' * n``) and powers
    bounded too: one expression cannot build a value larger than a rendered template may be."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        from jinja2.exceptions import SecurityError

        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
            raise SecurityError(f"a power with exponent {right} (at most 64)")
        if operator == "*":
            size = next((len(a) * b for a, b in ((left, right), (right, left))
                         if isinstance(a, (str, list, tuple)) and isinstance(b, int)), 0)
            if size > MAX_RENDER_CHARS:
                raise SecurityError(f"a repetition of {size:,} items (at most {MAX_RENDER_CHARS:,})")
        return super().call_binop(context, operator, left, right)


def template_env(family: str | None = None) -> ImmutableSandboxedEnvironment:
    """The only environment harness templates are rendered in: sandboxed (``_Sandbox``), strict about undefined
    names; with ``family``, its filters too (``TaskFamily.filters``; an unknown family has none: the document's
    check names it)."""
    env = _Sandbox(undefined=StrictUndefined, autoescape=False, keep_trailing_newline=False)
    env.filters["digits_lsb"] = digits_lsb
    if family is not None and family in plugins.names("family"):
        from rsi.tasks import get_family

        env.filters.update(get_family(family).filters)
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
        env = template_env(document.family)
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
        return self._render(name, field, context)

    def _render(self, name: str, field: str, context: dict[str, Any]) -> str:
        """Template ``name`` rendered; any failure, or a text longer than MAX_RENDER_CHARS, a TemplateRenderError
        naming ``field``."""
        try:
            text = self._templates[name].render(context)
        except Exception as exc:  # an untrusted template may fail in any way; report it, never a traceback
            raise TemplateRenderError(self.folder / name, field, exc) from None
        if len(text) > MAX_RENDER_CHARS:
            raise TemplateRenderError(self.folder / name, field, ValueError(
                f"renders {len(text):,} characters, more than {MAX_RENDER_CHARS:,}"))
        return text

    def render_answer(self, task_payload: dict[str, Any], answer: Any) -> str:
        """A correct reply to the task in this harness's format (``answer.template``), without EOS."""
        name = self.document.answer.template
        if name is None:
            raise UserError(f"{self.path}: field 'answer.template' is not set, so answers cannot be written in "
                            "this harness's format; add an answer template")
        context = {"task": task_payload, "vars": self.document.prompt.vars, "answer": answer,
                   "tools": [t.model_dump(mode="json") for t in self.document.tools]}
        return self._render(name, "answer.template", context)

    def render_tool(self, task_payload: dict[str, Any], call: dict[str, Any], result: str) -> str:
        """A tool message: the result of ``call`` (name, arguments) as the model reads it."""
        name = self.document.prompt.tool_template
        if name is None:
            raise UserError(f"{self.path}: field 'prompt.tool_template' is not set, so tool results cannot be "
                            "shown to the model; add a tool template")
        context = {"task": task_payload, "vars": self.document.prompt.vars, "call": call, "result": result,
                   "tools": [t.model_dump(mode="json") for t in self.document.tools]}
        return self._render(name, "prompt.tool_template", context)

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
