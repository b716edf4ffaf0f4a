"""An operator for levels the harness cannot pose (cause ``not_posable``): a whole number the prompt's template
reads (``[prompt] vars``), raised to the smallest value at which every such level can be posed (a dry run
renders a task of each; no model runs). Numbers of the answer's parameters and token limits that sit a step or two
above the varied one keep their distance to it (a width and the answer's width one more, say)."""

from __future__ import annotations

from rsi.hcp import Harness
from rsi.proposers.base import Evidence, Proposal, Space, in_memory, proposer, variant

GROWTH = 4  # the largest value tried: this many times the current one
NEAR = (1, 2)  # a number this far above the varied one moves with it


@proposer("pose_levels")
def pose_levels(harness: Harness, space: Space, evidence: Evidence) -> list[Proposal]:
    from rsi.evaluate import expressible
    from rsi.tasks import get_family

    if not evidence.unposable:
        return []
    family, doc, out = get_family(harness.document.family), harness.document, []
    followers = {f"answer.params.{k}": v for k, v in doc.answer.params.items() if _whole(v)} | {
        "decoding.max_new_tokens": doc.decoding.max_new_tokens,
        "limits.max_completion_tokens": doc.limits.max_completion_tokens}
    for name, now in doc.prompt.vars.items():
        if not _whole(now) or now < 1:
            continue
        near = {k: v - now for k, v in followers.items() if v - now in NEAR}
        for value in range(now + 1, now * GROWTH + 1):
            changes = {f"prompt.vars.{name}": value} | {k: value + d for k, d in near.items()}
            proposal = variant(harness, f"{name}{value}", f"levels {_levels(evidence.unposable)} not posable: "
                               f"prompt.vars.{name} {value} (was {now})", changes, cause="not_posable")
            candidate = in_memory(proposal, harness)
            if candidate is not None and all(expressible(candidate, family, lv) for lv in evidence.unposable):
                out.append(proposal)
                break
    return out


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _levels(levels: tuple[int, ...]) -> str:
    return ", ".join(map(str, levels))
