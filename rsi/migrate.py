"""Migration: the content of audited trajectories, written again under another harness of the same family.

A trajectory's content is its task and the answer the auditor parsed from the reply; an answer template
(``answer.template``) writes that answer in any harness's format. So a pair's own verified experience becomes
training data for a format it has never replied in: the harness search's migration step, and the replay of
earlier generations after a lineage changed harness.
"""

from __future__ import annotations

from collections.abc import Sequence

from rsi.pair.text import chat_format, model_input, training_parts
from rsi.errors import UserError
from rsi.hcp import Harness
from rsi.models import Task, Trajectory
from rsi.parsers import digits_lsb, get_parser
from rsi.select import Example
from rsi.tasks import TaskFamily


def rerender(trajectory: Trajectory, task: Task, source: Harness, target: Harness, kind: str = "replay") -> Example:
    """The example ``trajectory`` (recorded under ``source``) teaches, written under ``target``: the same task
    and answer in ``target``'s prompt and answer format. Unchanged when replies look the same under both."""
    if not changes_format(source, target):
        prompt, completion, turns = training_parts(trajectory.messages, chat_format(target))
        return Example(trajectory_id=trajectory.id, level=task.level, prompt=prompt, completion=completion,
                       source=kind, turns=turns, chat=target.chat)
    if trajectory.tool_log or source.document.tools:
        raise UserError(f"cannot migrate episode {trajectory.id} from {source.id} to {target.id}: re-rendering "
                        "writes one task's answer, not a tool episode")
    if source.document.family != target.document.family:
        raise UserError(f"cannot migrate a {source.document.family} trajectory to harness {target.id} of family "
                        f"{target.document.family}")
    answer = source.document.answer
    parsed = get_parser(answer.parser)(trajectory.completion, **answer.params)
    if not parsed.ok:
        raise UserError(f"trajectory {trajectory.id} has no parsable answer under {source.id} ({parsed.error}); "
                        "only passed trajectories can be migrated")
    return Example(trajectory_id=trajectory.id, level=task.level, prompt=model_input(target, task.payload),
                   completion=target.render_answer(task.payload, parsed.value), source=kind, chat=target.chat)


def true_example(trajectory: Trajectory, task: Task, harness: Harness, family: TaskFamily,
                 kind: str = "frontier") -> Example:
    """ABLATION (``labels = "truth"``): what ``trajectory``'s task should have taught: its true answer in
    ``harness``'s format, or for a tool harness the family's expert episode; the sample itself is not used."""
    from rsi.hcp.plays import demonstration

    if harness.document.tools:
        prompt, completion, turns = training_parts(demonstration(harness, family, task).messages, chat_format(harness))
        return Example(trajectory_id=trajectory.id, level=task.level, prompt=prompt, completion=completion,
                       source=kind, turns=turns, chat=harness.chat)
    answer = harness.document.answer
    if answer.template is None and answer.parser == "reversed_digits":  # addition/v1-v2 name no template
        completion = digits_lsb(task.answer, answer.params["width"])
    else:
        completion = harness.render_answer(task.payload, task.answer)
    return Example(trajectory_id=trajectory.id, level=task.level, prompt=model_input(harness, task.payload),
                   completion=completion, source=kind, chat=harness.chat)


def changes_format(source: Harness, target: Harness) -> bool:
    """Whether replies look different under ``target``: its prompt or its answer format differs (a plan or a
    decoding knob does not change what one call looks like)."""
    s, t = source.document, target.document
    return source.sources != target.sources or s.prompt != t.prompt or s.answer != t.answer


def migrate(pairs: Sequence[tuple[Trajectory, Task, Harness]], target: Harness, kind: str = "replay") -> list[Example]:
    """``rerender`` for each (trajectory, task, source harness), in order."""
    return [rerender(t, task, source, target, kind) for t, task, source in pairs]
