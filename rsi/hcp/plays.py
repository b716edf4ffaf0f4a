"""A harness played with right answers, no model: a plan's calls fed the right answer to each (``calls_with_gold``,
whether the harness can pose a task at all), and the family's expert written as this harness's episode
(``demonstration``). Validation dry-runs both; the cycle uses them to pose tasks and to teach formats.

A plan (``[plan]`` in hcp.toml) is a program the family declares (``TaskFamily.plans``): it gets a task's payload,
never its answer or the family, yields rounds of call payloads and is sent their parsed answers; it returns the
composed answer. A call payload is a task of the family (``TaskFamily.derive``), or the task itself when the
call poses it whole.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, NamedTuple

from rsi.errors import UserError
from rsi.hcp.syntax import parse_call, parse_reply, render_call
from rsi.models import Message, Task, ToolCall, ToolRecord
from rsi.substrate import Session, result_text

if TYPE_CHECKING:
    from rsi.hcp.harness import Harness
    from rsi.tasks import Plan, TaskFamily


def plan_of(harness: Harness, family: TaskFamily) -> Plan:
    name = harness.document.plan.name
    if name not in family.plans:
        raise UserError(f"{harness.path}: field 'plan.name': family {family.name!r} declares no plan {name!r} "
                        f"(its plans: {', '.join(sorted(family.plans)) or 'none'})")
    return family.plans[name]


def call_task(family: TaskFamily, task: Task, payload: dict[str, Any]) -> Task:
    """The task a call of ``task``'s plan poses: ``task`` itself when the call poses it whole (so its trajectory
    is the one a one-call harness makes), else the payload's derived task."""
    return task if payload == task.payload else family.derive(payload)


def calls_with_gold(harness: Harness, family: TaskFamily, task: Task) -> tuple[list[Task], Any]:
    """The calls the plan makes for ``task`` when every call is answered right, and the answer it composes
    (validation, and whether a harness can pose a task at all)."""
    program = plan_of(harness, family)(task.payload, harness.document.plan.params)
    calls: list[Task] = []
    try:
        payloads = next(program)
        while True:
            round_ = [call_task(family, task, payload) for payload in payloads]
            calls += round_
            payloads = program.send([call.answer for call in round_])
    except StopIteration as done:
        return calls, done.value


def poses(harness: Harness, family: TaskFamily, task: Task) -> bool:
    """Whether the harness can pose ``task``: render its prompt, or, with a plan, render every call."""
    try:
        if harness.document.plan is None:
            harness.prompt(task.payload)
        else:
            for call in calls_with_gold(harness, family, task)[0]:
                harness.prompt(call.payload)
    except UserError:
        return False
    return True


class Demonstration(NamedTuple):
    messages: list[Message]
    tool_log: list[ToolRecord]
    mistaken: frozenset[int] = frozenset()  # indices of the messages that are the expert's mistakes


def demonstration(harness: Harness, family: TaskFamily, task: Task, mistakes: float = 0.0) -> Demonstration:
    """The family's expert solution of ``task`` as this harness's episode: each call written in the harness's
    syntax (and parsed back as the same call), run on the environment, its result rendered; then the final
    reply the harness's answer template writes. With ``mistakes`` > 0 the expert errs at that rate per turn and
    recovers (seeded by the task). An answer family's (no environment) is the prompt and the right answer in
    the harness's format. Raises ``UserError`` when the harness cannot play it or the final state fails the
    verifier."""
    if family.environment is None:
        answer = harness.render_answer(task.payload, task.answer)
        parsed = parse_reply(answer, harness.document.answer)
        if not parsed.ok or not family.verify(task, parsed.value):
            raise UserError(f"the answer template writes {answer!r} for {task.answer!r}; the verifier rejects it")
        return Demonstration([*(Message(role=role, content=content) for role, content in
                                harness.prompt_messages(task.payload)), Message(role="assistant", content=answer)], [])
    if family.expert is None:
        raise UserError(f"family {family.name!r} has an environment but no expert demonstrations")
    session = Session(family.environment, task.payload, harness.tool_schemas)
    messages = [Message(role=role, content=content) for role, content in harness.prompt_messages(task.payload)]
    mistaken = set()
    for step, (name, arguments, mistake) in enumerate(family.expert(task.payload, mistakes,
                                                                    random.Random(f"mistakes:{task.id}")), start=1):
        text = render_call(harness, name, arguments)
        if parse_call(harness, text) != (name, arguments):
            raise UserError(f"the call {text!r} does not parse back as {name}{arguments}")
        call_id = f"call_{step}"
        if mistake:
            mistaken.add(len(messages))
        messages.append(Message(role="assistant", content=text,
                                tool_calls=(ToolCall(id=call_id, name=name, arguments=arguments),)))
        record = session.call(call_id, name, arguments)
        if isinstance(record.result, str) and record.result.startswith("error:"):
            raise UserError(f"the expert's call {text} failed: {record.result}")
        messages.append(Message(role="tool", content=harness.render_tool(
            task.payload, {"name": name, "arguments": arguments}, result_text(record.result)), tool_call_id=call_id))
    final = harness.render_answer(task.payload, task.answer)
    messages.append(Message(role="assistant", content=final))
    parsed = parse_reply(final, harness.document.answer)
    if not parsed.ok:
        raise UserError(f"the expert's final reply {final!r} (the answer template's) is refused by parser "
                        f"{harness.document.answer.parser!r} with answer.params {harness.document.answer.params}: "
                        f"{parsed.error}")
    if not family.verify(task, {"state": session.state, "answer": parsed.value}):
        raise UserError(f"the expert's episode ends in a state the verifier rejects: {session.state}")
    return Demonstration(messages, session.records, frozenset(mistaken))
