"""The external auditor: judges a stored trajectory against the HCP contract its harness declares.

It reads only the trajectory, the task (regenerated from its family to prove it is authentic), the
harness document and the family's verifier; it never talks to the model or trusts the executor's
own judgement. Each contract rule gives one ``RuleResult``; a verdict passes when all of them do.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jsonschema
from pydantic import BaseModel, ConfigDict, ValidationError

from rsi.errors import UserError
from rsi.hcp import Harness
from rsi.models import Pair, RuleResult, Task, Trajectory, Verdict
from rsi.parsers import Parsed, get_parser
from rsi.tasks import TaskFamily, get_family


class Case:
    """What one audit looks at, with the parsed answer computed once."""

    def __init__(self, trajectory: Trajectory, task: Task, harness: Harness, family: TaskFamily, pair: Pair | None):
        self.trajectory, self.task, self.harness, self.family, self.pair = trajectory, task, harness, family, pair
        answer = harness.document.answer
        self.parsed: Parsed = get_parser(answer.parser)(trajectory.completion, **answer.params)


Rule = Callable[[Case], RuleResult]


def _result(rule: str, problems: list[str]) -> RuleResult:
    return RuleResult(rule=rule, passed=not problems, detail="; ".join(problems))


def ids_consistent(case: Case) -> RuleResult:
    """The trajectory names the task, harness and pair it was judged against, and the task is authentic."""
    t, problems = case.trajectory, []
    if t.task_id != case.task.id:
        problems.append(f"task_id {t.task_id} is not the task's id {case.task.id}")
    if case.task.family != case.family.name:
        problems.append(f"task family {case.task.family!r} is not {case.family.name!r}")
    else:
        regenerated = case.family.task(case.task.seed, case.task.level, case.task.index)
        if regenerated != case.task:
            problems.append("task differs from the one its family generates at its (seed, level, index)")
    if t.harness_id != case.harness.id:
        problems.append(f"harness_id {t.harness_id} is not {case.harness.id}")
    if case.pair is not None:
        if case.pair.id != t.pair_id:
            problems.append(f"pair_id {t.pair_id} is not the stored pair's id {case.pair.id}")
        if case.pair.harness_hash != case.harness.hash:
            problems.append("the pair was built with another version of this harness (hash differs)")
    return _result("ids_consistent", problems)


def prompt_rendered(case: Case) -> RuleResult:
    """The prompt the model saw is exactly what the harness renders for this task."""
    doc, messages = case.harness.document, case.trajectory.messages
    expected = []
    try:
        if doc.prompt.system_template:
            expected.append(("system", case.harness.render("system_template", case.task.payload)))
        expected.append(("user", case.harness.prompt(case.task.payload)))
    except UserError as exc:
        return _result("prompt_rendered", [f"the harness cannot render this task: {exc}"])
    got = [(m.role, m.content) for m in messages[: len(expected)]]
    problems = [] if got == expected else [f"prompt {got!r} is not the rendered {expected!r}"]
    return _result("prompt_rendered", problems)


def limits(case: Case) -> RuleResult:
    """Steps and token counts within the harness's limits; the generation did not fail."""
    lim, t, problems = case.harness.document.limits, case.trajectory, []
    steps = sum(1 for m in t.messages if m.role == "assistant")
    if steps > lim.max_steps:
        problems.append(f"{steps} assistant steps > max_steps {lim.max_steps}")
    if steps == 0:
        problems.append("no assistant message")
    if t.tokens.prompt > lim.max_prompt_tokens:
        problems.append(f"{t.tokens.prompt} prompt tokens > {lim.max_prompt_tokens}")
    if t.tokens.completion > lim.max_completion_tokens:
        problems.append(f"{t.tokens.completion} completion tokens > {lim.max_completion_tokens}")
    if t.finish_reason == "error":
        problems.append("generation ended in an error")
    return _result("limits", problems)


def tools_allowed(case: Case) -> RuleResult:
    """Every tool call names an allowed tool and its arguments match that tool's JSON schema."""
    allowed = {tool.name: tool for tool in case.harness.document.tools}
    problems = []
    for message in case.trajectory.messages:
        for call in message.tool_calls:
            tool = allowed.get(call.name)
            if tool is None:
                problems.append(f"tool {call.name!r} is not in the allowlist {sorted(allowed)}")
                continue
            try:
                jsonschema.validate(call.arguments, tool.parameters)
            except jsonschema.ValidationError as exc:
                problems.append(f"arguments of {call.name!r}: {exc.message}")
    return _result("tools_allowed", problems)


def answer_format(case: Case) -> RuleResult:
    """The completion parses under the harness's answer format."""
    return _result("answer_format", [] if case.parsed.ok else [case.parsed.error])


def no_extra_content(case: Case) -> RuleResult:
    """Nothing follows the answer (the model stopped where the format ends)."""
    extra = case.parsed.extra if case.parsed.ok else ""
    return _result("no_extra_content", [f"extra content after the answer: {extra[:40]!r}"] if extra else [])


def answer_correct(case: Case) -> RuleResult:
    """The family's verifier accepts the parsed answer."""
    if not case.parsed.ok:
        return _result("answer_correct", ["no parsable answer"])
    ok = case.family.verify(case.task, case.parsed.value)
    return _result("answer_correct", [] if ok else [f"answer {case.parsed.value!r} is wrong"])


RULES: dict[str, Rule] = {
    "ids_consistent": ids_consistent,
    "prompt_rendered": prompt_rendered,
    "limits": limits,
    "tools_allowed": tools_allowed,
    "answer_format": answer_format,
    "no_extra_content": no_extra_content,
    "answer_correct": answer_correct,
}


def audit(
    trajectory: Trajectory, task: Task, harness: Harness, family: TaskFamily, pair: Pair | None = None
) -> Verdict:
    """Judge one trajectory under the contract of ``harness``: one result per rule the contract lists."""
    case = Case(trajectory, task, harness, family, pair)
    rules = tuple(RULES[name](case) for name in harness.document.contract.rules)
    return Verdict(
        trajectory_id=trajectory.id, contract_version=harness.contract_version, harness_hash=harness.hash, rules=rules
    )


class AuditedLine(BaseModel):
    """One line of a JSONL audit: its verdict, or why the line could not be audited."""

    model_config = ConfigDict(frozen=True)

    line: int
    verdict: Verdict | None = None
    error: str = ""


class AuditRecord(BaseModel):
    """The JSONL line format: a trajectory with the task it claims, and optionally the pair."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trajectory: Trajectory
    task: Task
    pair: Pair | None = None


def audit_jsonl(path: Path, harness: Harness) -> tuple[list[AuditedLine], list[AuditRecord]]:
    """Audit every line of ``path``; a malformed line is reported with its number and skipped."""
    family = get_family(harness.document.family)
    results, records = [], []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read trajectories ({exc}); pass a UTF-8 JSONL file") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = AuditRecord.model_validate_json(line)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "line"
            results.append(AuditedLine(line=number, error=f"{where}: {first['msg']} ({exc.error_count()} error(s))"))
            continue
        verdict = audit(record.trajectory, record.task, harness, family, record.pair)
        results.append(AuditedLine(line=number, verdict=verdict))
        records.append(record)
    return results, records
