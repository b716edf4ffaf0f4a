"""The external auditor: judges a stored trajectory against the HCP contract its harness declares.

It reads only the trajectory, the task (regenerated from its family to prove it is authentic), the
harness document and the family's verifier; it never talks to the model and trusts nothing the executor
reported about itself: token counts are recounted with the base model's tokenizer, the finish reason is
checked against what the recorded reply makes possible, and the trajectory's id must hash its content.
Each contract rule gives one ``RuleResult``; a verdict passes when all of them do. A rule that cannot
judge (a parser or template that raises, a missing tokenizer, anything) fails with the reason, so
``audit`` never raises for a trajectory and task that validate as models.

Token accounting (what executors must record, what the ``hf`` backend reports): ``tokens.prompt`` counts
the prompt text -- the leading system and user messages' contents, concatenated -- as a prompt (with
``<bos>``); in chat mode, the chat template's text of those messages with the harness's tools and the
assistant's turn opened (``rsi.chat.render``, as the backend sends it); ``tokens.completion`` counts every assistant message's text, plus one EOS for each turn before
the last, plus the last turn's ending: one EOS, or the stop string that ended it (generated, then cut from
the text by the backend), or nothing when cut by length.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cached_property
from itertools import takewhile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from rsi.chat import parse_tool_calls
from rsi.errors import UserError
from rsi.hcp import Harness, HCPDocument
from rsi.hcp.document import FAMILY_RULE
from rsi.hcp.syntax import parse_call, parse_reply, render_call
from rsi.models import Message, Pair, RuleResult, Task, Trajectory, Verdict
from rsi.parsers import Parsed
from rsi.substrate import Session, replay, result_text, schema_problem
from rsi.tasks import DERIVED_SEED, TaskFamily, get_family
from rsi.tokens import TokenCounter, token_counter


class Case:
    """What one audit looks at, with the parsed answer computed once."""

    def __init__(self, trajectory: Trajectory, task: Task, harness: Harness, family: TaskFamily, pair: Pair | None,
                 recorded: Harness | None = None):
        self.trajectory, self.task, self.harness, self.family, self.pair = trajectory, task, harness, family, pair
        self.recorded = recorded or harness  # the harness the trajectory was produced under (a re-audit differs)
        self.parsed: Parsed = parse_reply(trajectory.completion, harness.document.answer)

    @property
    def doc(self) -> HCPDocument:
        return self.harness.document

    @cached_property
    def counter(self) -> TokenCounter:
        return token_counter(self.doc.model.base, self.harness.path.parent)

    @cached_property
    def replayed(self) -> Session | None:
        """The episode's calls run again from the task's initial state (None: the family has no environment).
        Raises UserError when the harness exposes a tool the family does not declare (the rule fails)."""
        env = self.family.environment
        if env is None:
            return None
        calls = [(c.id, c.name, c.arguments) for m in self.trajectory.messages if m.role == "assistant"
                 for c in m.tool_calls]
        return replay(env, self.task.payload, self.harness.tool_schemas, calls)

    def outcome(self) -> Any:
        """What the family's verifier judges: the parsed answer, or for a tool family the episode's final
        state (replayed, never the recorded one) with the parsed answer."""
        session = self.replayed
        return self.parsed.value if session is None else {"state": session.state, "answer": self.parsed.value}


Rule = Callable[[Case], RuleResult]


def _result(rule: str, problems: list[str]) -> RuleResult:
    return RuleResult(rule=rule, passed=not problems, detail="; ".join(problems))


def prompt_roles(doc: HCPDocument) -> tuple[str, ...]:
    """The roles of the prompt messages the harness renders: an optional system message, then the user's."""
    return ("system", "user") if doc.prompt.system_template is not None else ("user",)


def prompt_messages(trajectory: Trajectory) -> list[Message]:
    """The leading system and user messages: what the model was given before it first replied."""
    return list(takewhile(lambda m: m.role in ("system", "user"), trajectory.messages))


def prompt_text(trajectory: Trajectory) -> str:
    """What the model was given before it replied: the contents of the leading system and user messages,
    concatenated (completion mode)."""
    return "".join(m.content for m in prompt_messages(trajectory))


def ids_consistent(case: Case) -> RuleResult:
    """The trajectory's id hashes its content (an edited trajectory is a new one, never inheriting a verdict),
    it names the task, harness and pair it was judged against, and the task is authentic."""
    t, problems = case.trajectory, []
    if t.id != t.content_id:
        problems.append(f"id {t.id} is not the hash of the trajectory's content ({t.content_id}): "
                        "edited after recording")
    if t.task_id != case.task.id:
        problems.append(f"task_id {t.task_id} is not the task's id {case.task.id}")
    problems += _task_problems(case.task, case.family)
    if t.harness_id != case.recorded.id:
        problems.append(f"harness_id {t.harness_id} is not {case.recorded.id}")
    if case.pair is not None:
        if case.pair.id != t.pair_id:
            problems.append(f"pair_id {t.pair_id} is not the stored pair's id {case.pair.id}")
        if case.pair.harness_hash != case.recorded.hash:
            problems.append("the pair was built with another version of this harness (hash differs)")
    return _result("ids_consistent", problems)


def _task_problems(task: Task, family: TaskFamily) -> list[str]:
    """Why ``task`` is not the one ``family`` generates at its (split, seed, level, index), if it is not."""
    if task.family != family.name:
        return [f"task family {task.family!r} is not {family.name!r}"]
    if task.family_version != family.version:
        return [f"task is from version {task.family_version} of {family.name!r}, which is now version {family.version}"]
    try:
        regenerated = (family.derive(task.payload) if task.seed == DERIVED_SEED else
                       family.task(task.split, task.seed, task.level, task.index))
    except UserError as exc:
        return [f"the family cannot regenerate this task: {exc}"]
    if regenerated != task:
        return ["task differs from the one its family generates at its (split, seed, level, index)"
                if task.seed != DERIVED_SEED else "derived task differs from the one its family derives from its payload"]
    return []


def prompt_rendered(case: Case) -> RuleResult:
    """The prompt the model saw is exactly what the harness renders for this task."""
    try:
        expected = [(m.role, m.content) for m in case.harness.prompt_messages(case.task.payload)]
    except UserError as exc:
        return _result("prompt_rendered", [f"the harness cannot render this task: {exc}"])
    got = [(m.role, m.content) for m in case.trajectory.messages[: len(expected)]]
    problems = [] if got == expected else [f"prompt {got!r} is not the rendered {expected!r}"]
    return _result("prompt_rendered", problems)


def messages_allowed(case: Case) -> RuleResult:
    """The message sequence is what the harness allows: its prompt messages, then assistant turns. With no
    tools declared that is exactly one assistant reply; with tools, each call of a turn is answered by one
    ``tool`` message (matching ``tool_call_id``) before the next turn, and the last turn makes no calls.
    Nothing else: no user or system message after the prompt, no unanswered or duplicate call ids, at most
    ``limits.max_steps`` assistant turns."""
    roles = prompt_roles(case.doc)
    messages = case.trajectory.messages
    head = tuple(m.role for m in messages[: len(roles)])
    problems = [] if head == roles else [f"the prompt must be {list(roles)} messages, got {list(head)}"]
    problems += [f"message {i}: prompt messages carry no tool calls or results"
                 for i, m in enumerate(messages[: len(roles)]) if m.tool_calls or m.tool_call_id is not None]
    problems += _turn_problems(messages, len(roles), bool(case.doc.tools))
    steps = sum(m.role == "assistant" for m in messages)
    if steps > case.doc.limits.max_steps:
        problems.append(f"{steps} assistant turns > max_steps {case.doc.limits.max_steps}")
    return _result("messages_allowed", problems)


def _turn_problems(messages: tuple[Message, ...], start: int, tools: bool) -> list[str]:
    """Problems in the turns after the prompt (``messages[start:]``): a small state machine over open calls."""
    problems: list[str] = []
    open_calls: set[str] = set()  # calls of the latest assistant turn not yet answered
    seen: set[str] = set()
    for i, m in enumerate(messages[start:], start=start):
        if m.role == "assistant":
            problems += _assistant_problems(i, m, open_calls, seen, tools)
            open_calls = {c.id for c in m.tool_calls}
            seen |= open_calls
        elif m.role == "tool":
            if m.tool_call_id not in open_calls:
                problems.append(f"message {i}: tool message answers no open call of the preceding assistant turn "
                                f"(tool_call_id {m.tool_call_id!r})")
            open_calls.discard(m.tool_call_id or "")
            if m.tool_calls:
                problems.append(f"message {i}: a tool message cannot make tool calls")
        else:
            problems.append(f"message {i}: a {m.role} message after the prompt "
                            "(only assistant and tool turns follow it)")
    if open_calls:
        problems.append(f"tool calls {sorted(open_calls)} were never answered")
    last = messages[-1] if len(messages) > start else None
    if last is None or last.role != "assistant" or last.tool_calls:
        problems.append("the trajectory must end with an assistant reply that makes no tool calls")
    return problems


def _assistant_problems(i: int, m: Message, open_calls: set[str], seen: set[str], tools: bool) -> list[str]:
    """Problems of one assistant turn given the calls still open before it and the call ids used so far."""
    problems = []
    if open_calls:
        problems.append(f"message {i}: assistant turn before calls {sorted(open_calls)} were answered")
    if m.tool_call_id is not None:
        problems.append(f"message {i}: an assistant message cannot answer a tool call")
    if m.tool_calls and not tools:
        problems.append(f"message {i}: tool calls, but the harness declares no tools")
    ids = [c.id for c in m.tool_calls]
    duplicates = sorted({c for c in ids if ids.count(c) > 1 or c in seen})
    if duplicates:
        problems.append(f"message {i}: duplicate tool call ids {duplicates}")
    return problems


def _endings(case: Case, reply: str) -> dict[str, int]:
    """Tokens the last turn's ending adds, by how it could have ended: EOS or a declared stop string for a
    ``stop`` (the backend cuts the stop string from the text, but generated it), nothing otherwise."""
    if case.trajectory.finish_reason != "stop":
        return {case.trajectory.finish_reason: 0}
    base = case.counter.text(reply)
    endings = {"EOS": 1}
    for stop in case.doc.decoding.stop:
        endings[f"stop string {stop!r}"] = case.counter.text(reply + stop) - base
    return endings


def completion_counts(case: Case) -> dict[str, int]:
    """The completion token counts the recorded text allows, by how the last turn ended."""
    replies = [m.content for m in case.trajectory.messages if m.role == "assistant"]
    if not replies:
        return {"no reply": 0}
    earlier = sum(case.counter.text(text) + 1 for text in replies[:-1])  # each earlier turn ended on EOS
    last = earlier + case.counter.text(replies[-1])
    return {how: last + extra for how, extra in _endings(case, replies[-1]).items()}


def _counted(counts: dict[str, int]) -> str:
    if len(set(counts.values())) == 1:
        return str(next(iter(counts.values())))
    return " or ".join(f"{n} (ended by {how})" for how, n in counts.items())


def limits(case: Case) -> RuleResult:
    """Steps and token counts within the harness's limits, the counts being the auditor's own (a recorded
    count that disagrees with the recount fails); the generation did not fail."""
    lim, t, problems = case.doc.limits, case.trajectory, []
    steps = sum(m.role == "assistant" for m in t.messages)
    if steps > lim.max_steps:
        problems.append(f"{steps} assistant steps > max_steps {lim.max_steps}")
    if steps == 0:
        problems.append("no assistant message")
    prompt = (case.counter.chat_prompt(prompt_messages(t), case.harness.chat_tools) if case.harness.chat
              else case.counter.prompt(prompt_text(t)))
    if t.tokens.prompt != prompt:
        problems.append(f"recorded {t.tokens.prompt} prompt tokens, counted {prompt}")
    if prompt > lim.max_prompt_tokens:
        problems.append(f"{prompt} prompt tokens > max_prompt_tokens {lim.max_prompt_tokens}")
    counts = completion_counts(case)
    if t.tokens.completion not in counts.values():
        problems.append(f"recorded {t.tokens.completion} completion tokens, counted {_counted(counts)}")
    completion = t.tokens.completion if t.tokens.completion in counts.values() else min(counts.values())
    if completion > lim.max_completion_tokens:
        problems.append(f"{completion} completion tokens > max_completion_tokens {lim.max_completion_tokens}")
    if t.finish_reason == "error":
        problems.append("generation ended in an error")
    return _result("limits", problems)


def stopped(case: Case) -> RuleResult:
    """The reply ended with a stop (EOS or a declared stop string), not cut by length, when
    ``answer.require_stop``; and a claimed stop is possible.

    What a stored trajectory lets the auditor verify: the recorded ``finish_reason``; that a ``stop`` fits
    -- the reply's counted tokens plus its ending (one EOS, or a declared stop string, which the backend
    generated and cut from the text) fit in ``decoding.max_new_tokens``, so a reply that filled the budget
    cannot claim a stop; and that the reply holds no declared stop string (decoding ends at the first one).
    What it cannot: whether the model really emitted EOS -- an executor that truncated a reply and claimed
    ``stop`` where the ending still fits is indistinguishable from the model stopping there; which stop
    string ended it; special tokens the model generated that decoding dropped from the text. Those need a
    replay of the model, which the auditor never runs."""
    t, decoding = case.trajectory, case.doc.decoding
    reply, problems = t.completion, []
    if case.doc.answer.require_stop and t.finish_reason != "stop":
        problems.append(f"finish_reason {t.finish_reason!r}: the reply did not end with EOS or a stop string")
    inside = [s for s in decoding.stop if s in reply]
    if inside:
        problems.append(f"the reply contains the stop string {inside[0]!r}, where decoding would have ended")
    if t.finish_reason == "stop":
        counts = {how: case.counter.text(reply) + extra for how, extra in _endings(case, reply).items()}
        if min(counts.values()) > decoding.max_new_tokens:
            problems.append(f"finish_reason 'stop' is impossible: the reply and its ending take {_counted(counts)} "
                            f"tokens > max_new_tokens {decoding.max_new_tokens}")
    return _result("stopped", problems)


def tools_allowed(case: Case) -> RuleResult:
    """Every tool call names an allowed tool and its arguments match that tool's JSON schema."""
    allowed = {tool.name: tool for tool in case.doc.tools}
    problems = []
    for message in case.trajectory.messages:
        for call in message.tool_calls:
            tool = allowed.get(call.name)
            if tool is None:
                problems.append(f"tool {call.name!r} is not in the allowlist {sorted(allowed)}")
                continue
            problem = schema_problem(call.arguments, tool.parameters)
            if problem:
                problems.append(f"arguments of {call.name!r}: {problem}")
    return _result("tools_allowed", problems)


def text_matches_calls(case: Case) -> RuleResult:
    """Each assistant turn's text, which training reads, writes exactly the calls the turn records, which the replay
    ran: read as the pair reads it (the harness's ``[tool_calls] syntax``; in chat mode the model's own format, as
    the ``hf`` backend reads it), the same calls in order with the same arguments as JSON (``2``, ``2.0`` and
    ``true`` differ), none where it records none; in completion mode a call is the text the syntax renders for it.
    Nothing to check where the harness exposes no tools (messages_allowed fails any recorded call there)."""
    if not case.doc.tools:
        return _result("text_matches_calls", [])
    problems = []
    for i, m in enumerate(case.trajectory.messages):
        if m.role != "assistant":
            continue
        recorded = _calls_text([(c.name, c.arguments) for c in m.tool_calls])
        written = _calls_text(_written_calls(case.harness, m.content))
        if written != recorded:
            problems.append(f"message {i}: the text {m.content[:60]!r} writes {written}, the turn records {recorded}")
        elif m.tool_calls and not case.harness.chat:
            try:
                rendered = render_call(case.harness, m.tool_calls[0].name, m.tool_calls[0].arguments)
            except UserError:  # a tool the harness does not expose, or an argument it does not know: tools_allowed's
                rendered = m.content
            if m.content != rendered:
                problems.append(f"message {i}: the text {m.content[:60]!r} is not its call as the harness writes it, "
                                f"{rendered!r}")
    return _result("text_matches_calls", problems)


def _written_calls(harness: Harness, text: str) -> list[tuple[str, dict[str, Any]]]:
    """The calls an assistant turn's text writes, as the pair reads them."""
    if harness.chat:
        return [(c.name, c.arguments) for c in parse_tool_calls(text)]
    call = parse_call(harness, text)
    return [] if call is None else [call]


def _calls_text(calls: list[tuple[str, dict[str, Any]]]) -> str:
    return "; ".join(f"{name}{json.dumps(arguments, sort_keys=True)}" for name, arguments in calls) or "no call"


def results_replayed(case: Case) -> RuleResult:
    """Every call of the episode is logged once, in order, with the result a replay on the family's environment
    gives, and the tool message answering it shows that result as the harness renders it: no forged result."""
    session, log, problems = case.replayed, case.trajectory.tool_log, []
    calls = [c for m in case.trajectory.messages if m.role == "assistant" for c in m.tool_calls]
    if session is None:
        return _result("results_replayed", [f"{len(calls)} tool calls, but family {case.family.name!r} has no "
                                            "environment to run them"] if calls or log else [])
    if [(r.call_id, r.name, r.arguments) for r in log] != [(c.id, c.name, c.arguments) for c in calls]:
        problems.append(f"the tool log ({len(log)} records) is not the episode's {len(calls)} calls in order")
    for mine, theirs in zip(session.records, log):
        if mine.result != theirs.result:
            problems.append(f"call {theirs.call_id}: logged result {theirs.result!r}, replay gives {mine.result!r}")
    shown = {m.tool_call_id: m.content for m in case.trajectory.messages if m.role == "tool"}
    for record, call in zip(session.records, calls):
        want = case.harness.render_tool(case.task.payload, {"name": call.name, "arguments": call.arguments},
                                        result_text(record.result))
        if call.id in shown and shown[call.id] != want:
            problems.append(f"call {call.id}: the tool message shows {shown[call.id]!r}, replay gives {want!r}")
    return _result("results_replayed", problems)


def states_replayed(case: Case) -> RuleResult:
    """The logged state hashes are the replay's: the episode starts from the task's initial state and only its
    calls changed it (no state edited between or during calls)."""
    session, log = case.replayed, case.trajectory.tool_log
    if session is None:
        return _result("states_replayed", ["a tool log, but the family has no environment"] if log else [])
    problems = []
    if log and log[0].state_before != session.initial_hash:
        problems.append(f"call {log[0].call_id}: starts from state {log[0].state_before}, not the task's initial "
                        f"state {session.initial_hash}")
    for mine, theirs in zip(session.records, log):
        if (mine.state_before, mine.state_after) != (theirs.state_before, theirs.state_after):
            problems.append(f"call {theirs.call_id}: logged states {theirs.state_before} -> {theirs.state_after}, "
                            f"replay gives {mine.state_before} -> {mine.state_after}")
    return _result("states_replayed", problems)


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
    ok = case.family.verify(case.task, case.outcome())
    return _result("answer_correct", [] if ok else [f"answer {case.parsed.value!r} is wrong"])


RULES: dict[str, Rule] = {
    "ids_consistent": ids_consistent,
    "prompt_rendered": prompt_rendered,
    "messages_allowed": messages_allowed,
    "limits": limits,
    "stopped": stopped,
    "tools_allowed": tools_allowed,
    "text_matches_calls": text_matches_calls,
    "results_replayed": results_replayed,
    "states_replayed": states_replayed,
    "answer_format": answer_format,
    "no_extra_content": no_extra_content,
    "answer_correct": answer_correct,
}


def family_rule(name: str, case: Case) -> RuleResult:
    """One of the family's own rules (``family:<name>`` in the contract) on the parsed answer; an answer that
    did not parse cannot be judged, and fails."""
    if not case.parsed.ok:
        return RuleResult(rule=name, passed=False, detail=f"cannot judge: no answer ({case.parsed.error})")
    passed, detail = case.family.rules[name.removeprefix(FAMILY_RULE)](case.task, case.parsed.value)
    return RuleResult(rule=name, passed=passed, detail=detail)


def judge(name: str, case: Case) -> RuleResult:
    """Apply one rule; a rule that raises could not judge, and that fails the rule with the reason."""
    try:
        return family_rule(name, case) if name.startswith(FAMILY_RULE) else RULES[name](case)
    except Exception as exc:  # noqa: BLE001 - a crash in a rule is a failed verdict, never a failed audit
        return RuleResult(rule=name, passed=False, detail=f"cannot judge: {type(exc).__name__}: {exc}")


def audit(
    trajectory: Trajectory, task: Task, harness: Harness, family: TaskFamily, pair: Pair | None = None,
    recorded: Harness | None = None,
) -> Verdict:
    """Judge one trajectory under the contract of ``harness``: one result per rule the contract lists.
    ``recorded``: the harness the trajectory names, when it is judged under another one (a re-audit: every
    rule is ``harness``'s, only the ids rule checks the trajectory against the harness it was produced under)."""
    case = Case(trajectory, task, harness, family, pair, recorded)
    rules = tuple(judge(name, case) for name in harness.document.contract.rules)
    return Verdict(
        trajectory_id=trajectory.id, contract_version=harness.contract_version, harness_hash=harness.hash, rules=rules
    )


class AuditRecord(BaseModel):
    """The JSONL line format: a trajectory with the task it claims, and optionally the pair."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trajectory: Trajectory
    task: Task
    pair: Pair | None = None


class AuditedLine(BaseModel):
    """One line of a JSONL audit: its record and verdict, or why the line could not be audited."""

    model_config = ConfigDict(frozen=True)

    line: int
    record: AuditRecord | None = None
    verdict: Verdict | None = None
    error: str = ""

    @property
    def storable(self) -> bool:
        """Whether the record may be stored: its trajectory's id is its content hash. An edited trajectory
        carrying an old id must not take (or shadow) the stored trajectory of that id."""
        return self.record is not None and self.record.trajectory.id == self.record.trajectory.content_id

    def summary(self) -> dict[str, Any]:
        """The line's outcome as plain data (``rsi audit --json``)."""
        v = self.verdict
        return {"line": self.line, "trajectory_id": v.trajectory_id if v else None, "passed": v.passed if v else None,
                "failed_rules": v.failed_rules() if v else [], "error": self.error}


def audit_jsonl(path: Path, harness: Harness) -> list[AuditedLine]:
    """Audit every line of ``path``; a malformed line is reported with its number and skipped."""
    family = get_family(harness.document.family)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read trajectories ({exc}); pass a UTF-8 JSONL file") from None
    results = []
    # Lines end at "\n" only: str.splitlines would also split inside JSON strings holding U+2028 and the like.
    for number, line in enumerate(text.split("\n"), start=1):
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
        results.append(AuditedLine(line=number, record=record, verdict=verdict))
    return results
