"""Traffic becomes experience: the turns a specialist answered through ``rsi serve`` that pose a task of its family,
each judged again as the loop judges its own trajectories.

What is read, and what is trusted:

- Only assistant messages the proxy itself wrote: a stored message names the specialist that answered it, and the
  proxy keeps with it the record of how the pair made the reply (``rsi.mol.views.answered``: the pair, its
  harness, the trajectories of the run: the model's own messages and tool log under the harness). A client's
  messages (its history, its claimed answers) carry neither, whatever they say.
- The task is derived again from the person's message by the family's view, never taken from the record; a task
  outside the ``train`` split is never harvested (held-out and test tasks stay unseen by training).
- Each recorded trajectory is audited under the specialist's harness contract against that derived task: its
  ids, prompt (rendered from the derived payload), limits, format and answer, and for a tool family every call
  replayed on the family's environment against the logged results. A record edited after the fact fails there.

A turn the proxy answered in the harness's own format (no view read it) keeps no record, and a plan's turn is
left out: its trajectories are the plan's calls, not the posed task's (both: ``skipped`` says so). The cycle trains on
the harvest (``rsi run FAMILY --from-traffic``: ``rsi.run.proposals.Proposer.traffic``); a key opts out with ``rsi
keys harvest NAME --off``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select


@dataclass(frozen=True)
class Harvested:
    """One turn judged again: where it came from, the task derived from its message, its trajectory, the verdict."""

    conversation_id: str
    position: int
    task: Any
    trajectory: Any
    verdict: Any = None


@dataclass
class Harvest:
    """The turns that pass the audit (``passed``), those that do not (``failed``), those read but left for a later
    audit (``unjudged``: ``harvest(judge=False)``), and the rest by why they were not read (``skipped``)."""

    passed: list[Harvested] = field(default_factory=list)
    failed: list[Harvested] = field(default_factory=list)
    unjudged: list[Harvested] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)


def harvest(store: Any, harness: Any, pair_id: str, specialists: Collection[Any],
            exclude_keys: Collection[str] = (), upto: int | None = None, judge: bool = True) -> Harvest:
    """The turns the pair ``pair_id`` under ``harness`` answered as one of ``specialists`` (registry
    ``Specialist`` rows, usually one lineage's), judged again. Read: conversations of keys that did not opt out
    (``rsi keys harvest NAME --off``) and are not in ``exclude_keys``; where a specialist is private to a key, that
    key's conversations only (a tenant's adapter learns from its own traffic); ``upto``: messages stored up to
    that id only. ``judge=False``: each turn's audit is left to the caller (the cycle's audit stage judges every
    trajectory it stores), so a turn is audited once."""
    from rsi.audit import audit
    from rsi.errors import UserError
    from rsi.models import Trajectory
    from rsi.mol.proxy import RECORD
    from rsi.mol.views import VIEWS, posed_task
    from rsi.pair import Responder
    from rsi.store.schema import ApiKeyRow, ConversationMessageRow, ConversationRow
    from rsi.tasks import get_family

    family = get_family(harness.document.family)
    view = VIEWS.get(family.name)
    owners = {s.name: s.owner_key for s in specialists}
    private = {o for o in owners.values() if o is not None}
    pair = Responder(harness, None, pair_id, None, family)  # derives tasks, decodes nothing
    out = Harvest()
    with store.session() as s:
        query = (select(ConversationMessageRow.conversation_id, ConversationMessageRow.position,
                        ConversationMessageRow.message, ConversationMessageRow.specialist, ConversationRow.api_key)
                 .join(ConversationRow, ConversationRow.id == ConversationMessageRow.conversation_id)
                 .join(ApiKeyRow, ApiKeyRow.name == ConversationRow.api_key)
                 .where(ApiKeyRow.harvest.is_(True), ConversationRow.api_key.not_in(list(exclude_keys)))
                 .order_by(ConversationMessageRow.conversation_id, ConversationMessageRow.position))
        query = query.where(ConversationMessageRow.id <= upto) if upto is not None else query
        rows = s.execute(query.where(ConversationRow.api_key.in_(private)) if private else query).all()
    last_user: dict[str, str] = {}
    for conversation, position, message, who, key in rows:
        if message.get("role") == "user":
            last_user[conversation] = message.get("content") if isinstance(message.get("content"), str) else ""
            continue
        if message.get("role") != "assistant" or who not in owners or owners[who] not in (None, key):
            continue
        record = message.get(RECORD)
        if not isinstance(record, dict):
            out.skipped["no record (answered in the harness's own format)"] += 1
            continue
        if record.get("plan"):
            out.skipped["a plan's turn"] += 1
            continue
        if record.get("harness") != harness.hash:
            out.skipped["answered under another harness"] += 1
            continue
        if record.get("pair") != pair_id:
            out.skipped["answered by another pair (an earlier champion)"] += 1
            continue
        text = last_user.get(conversation, "")
        try:
            task = posed_task(view, pair, text) if view is not None else None
        except UserError:
            task = None
        if task is None:
            out.skipped["no task in the message"] += 1
            continue
        if task.split != "train":
            out.skipped[f"task in the {task.split} split"] += 1
            continue
        try:
            trajectories = [Trajectory.model_validate(t) for t in record.get("trajectories") or ()]
        except ValidationError:
            trajectories = []
        if len(trajectories) != 1:
            out.skipped["unreadable record"] += 1
            continue
        if not judge:
            out.unjudged.append(Harvested(conversation, position, task, trajectories[0]))
            continue
        judged = Harvested(conversation, position, task, trajectories[0], audit(trajectories[0], task, harness, family))
        (out.passed if judged.verdict.passed else out.failed).append(judged)
    return out
