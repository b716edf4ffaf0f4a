"""Operators for replies the harness cuts or refuses: token limits (cause ``limit_hit``) and the step limit of a
tool episode (``step_limit``). A limit the auditor reports exceeded is set to the largest count the failed
samples show; a limit decoding hit (the reply cut at ``max_new_tokens``, the episode at ``max_steps``) cannot show
how far the reply would have gone, so it is doubled, or quadrupled. The counts the evidence shows come first (the
search's screen keeps the first of equal candidates)."""

from __future__ import annotations

import re

from rsi.hcp import Harness
from rsi.proposers.base import Evidence, Proposal, Space, proposer, variant

_EXCEEDED = re.compile(r"(\d+) (prompt|completion) tokens > max_\2_tokens \d+")


@proposer("token_limits")
def token_limits(harness: Harness, space: Space, evidence: Evidence) -> list[Proposal]:
    cut = evidence.of("limit_hit")
    if not cut:
        return []
    doc, out = harness.document, []
    seen = {"prompt": [], "completion": []}
    for f in cut:
        for count, kind in _EXCEEDED.findall(f.rules.get("limits", "")):
            seen[kind].append(int(count))
    if seen["completion"] or seen["prompt"]:  # (first: a count the evidence shows, where a doubling guesses)
        changes = {f"limits.max_{kind}_tokens": max(counts) for kind, counts in seen.items() if counts}
        out.append(variant(harness, "limits", f"{len(cut)} replies over the auditor's token limits: "
                           + ", ".join(f"{k.removeprefix('limits.')} {v}" for k, v in changes.items()), changes,
                           cause="limit_hit"))
    if any(f.finish_reason == "length" for f in cut):
        out += _grown(harness, "decoding.max_new_tokens", f"{len(cut)} replies cut at max_new_tokens "
                      f"{doc.decoding.max_new_tokens}", "limit_hit")
    return out


@proposer("step_limits")
def step_limits(harness: Harness, space: Space, evidence: Evidence) -> list[Proposal]:
    stopped = evidence.of("step_limit")
    if not stopped:
        return []
    return _grown(harness, "limits.max_steps", f"{len(stopped)} episodes still calling tools at max_steps "
                  f"{harness.document.limits.max_steps}", "step_limit")


def _grown(harness: Harness, field: str, why: str, cause: str) -> list[Proposal]:
    """``field`` (``decoding.max_new_tokens`` or ``limits.max_steps``) doubled and quadrupled, with
    ``limits.max_completion_tokens`` raised to at least max_new_tokens x max_steps where that is more."""
    doc = harness.document
    now = doc.decoding.max_new_tokens if field == "decoding.max_new_tokens" else doc.limits.max_steps
    out = []
    for value in (now * 2, now * 4):
        tokens, steps = (value, doc.limits.max_steps) if field == "decoding.max_new_tokens" else \
            (doc.decoding.max_new_tokens, value)
        out.append(variant(harness, f"{field.rsplit('_', 1)[-1]}{value}", f"{why}: {value}",
                           {field: value, "limits.max_completion_tokens": max(doc.limits.max_completion_tokens,
                                                                               tokens * steps)}, cause=cause))
    return out
