"""An operator for replies that start with text the format does not expect (causes ``format_violation``,
``tool_misuse``, and ``limit_hit`` where the extra text is what ran the reply over its token limit): where the
failed replies parse once a short prefix is taken off (``>swap(3)`` is the call ``swap(3)``), the pair is writing
what it expected the prompt to end with. A prefix that at least half of them share is appended to the template
rendered just before that turn: the prompt's for a first turn, the tool result's for a later one. And where
most episodes fail on one kind of turn (after a tool result, or on the first), that turn's template is made to
end as the other kind's does."""

from __future__ import annotations

from collections import Counter

from rsi.hcp import Harness
from rsi.hcp.syntax import parse_call, parse_reply
from rsi.proposers.base import Evidence, Proposal, Space, proposer, variant

LONGEST = 3  # characters of a prefix


@proposer("template_endings")
def template_endings(harness: Harness, space: Space, evidence: Evidence) -> list[Proposal]:
    found: Counter[tuple[str, str]] = Counter()  # (template field, prefix) -> failed samples
    causes: dict[tuple[str, str], Counter[str]] = {}
    failures = [f for f in evidence.of("format_violation", "tool_misuse", "limit_hit") if f.replies]
    for f in failures:
        reply = f.replies[-1].strip()
        field = "prompt.template" if len(f.replies) == 1 else "prompt.tool_template"
        prefix = next((reply[:n] for n in range(1, LONGEST + 1) if _reads(harness, reply[n:])), None)
        if prefix is not None and prefix.strip():
            found[field, prefix] += 1
            causes.setdefault((field, prefix), Counter())[f.cause] += 1
    out = []
    for (field, prefix), count in found.most_common():
        rel = harness.document.model_dump()["prompt"][field.split(".")[1]]
        if rel is None or rel not in harness.sources or count * 2 < len(failures):
            continue
        source = harness.sources[rel]
        body = source.rstrip("\n")
        out.append(variant(harness, "ending", f"{count} of {len(failures)} refused replies start "
                           f"with {prefix!r} and read well without it: {rel} ends with {prefix!r}", {},
                           {rel: body + prefix + source[len(body):]},
                           cause=causes[field, prefix].most_common(1)[0][0]))
    return out + _alike(harness, [f for f in evidence.failures if f.replies])


def _alike(harness: Harness, failures: list) -> list[Proposal]:
    """Where most failed episodes (any cause) fail on one kind of turn, the first (after the prompt) or a later one
    (after a tool result), and the other kind's template ends with text this one lacks (the text after its last
    expression, ``>`` say): that turn's template is made to end so too, so every turn the pair reads the state
    as it reads it on the turns it does well."""
    prompt, tool = harness.document.prompt.template, harness.document.prompt.tool_template
    if tool is None or tool not in harness.sources or prompt not in harness.sources:
        return []
    out = []
    for failing, rel, other, turn in ((lambda f: len(f.replies) > 1, tool, prompt, "after a tool result"),
                                      (lambda f: len(f.replies) == 1, prompt, tool, "on the first turn")):
        those = [f for f in failures if failing(f)]
        ending = harness.sources[other].rstrip("\n").rpartition("}}")[2]
        source = harness.sources[rel]
        body = source.rstrip("\n")
        if not those or len(those) * 2 < len(failures) or not ending.strip() or body.endswith(ending):
            continue
        out.append(variant(harness, "alike", f"{len(those)} of {len(failures)} refused episodes fail {turn}: {rel} "
                           f"ends with {ending!r} as {other} does", {}, {rel: body + ending + source[len(body):]},
                           cause=Counter(f.cause for f in those).most_common(1)[0][0]))
    return out


def _reads(harness: Harness, text: str) -> bool:
    """Whether ``text`` is a call to one of the harness's tools or a final reply its parser takes cleanly."""
    call = parse_call(harness, text) if harness.document.tools else None
    if call is not None:
        return call[0] in harness.tool_schemas
    parsed = parse_reply(text, harness.document.answer)
    return parsed.ok and not parsed.extra
