"""A task family that lives outside rsi, as another package would ship one: ``parity`` (is the number of 1s in a
bit string odd?), with its own answer parser (``yes_no``) and harness proposer (``parity``). ``tests/test_plugins.py``
installs it as a throwaway distribution whose entry points (``rsi.families``, ``rsi.parsers``, ``rsi.proposers``)
are all that tells rsi about it: no file of rsi names it."""

from __future__ import annotations

import random
import re
from typing import Any

from pydantic import BaseModel

from rsi.parsers import Parsed, ParserSpec
from rsi.proposers import Proposal, variant
from rsi.tasks import TaskFamily


def make(rng: random.Random, level: int) -> tuple[dict[str, Any], Any]:
    bits = "".join(rng.choice("01") for _ in range(level))
    return {"bits": bits}, bits.count("1") % 2 == 1


family = TaskFamily(name="parity", version="1", description="is the number of 1s in a bit string of n bits odd?",
                    make=make, verify=lambda task, answer: answer is task.answer, max_level=64,
                    solve=lambda payload: payload["bits"].count("1") % 2 == 1,
                    level_of=lambda payload: len(payload["bits"]))


class NoParams(BaseModel):
    pass


def parse_yes_no(text: str) -> Parsed:
    m = re.match(r"(yes|no)\b", text)
    if m is None:
        return Parsed(ok=False, error=f"expected 'yes' or 'no', got {text[:20]!r}")
    return Parsed(ok=True, value=m.group() == "yes", extra=text[m.end():])


yes_no = ParserSpec(parse_yes_no, NoParams)


def propose(harness, space: dict[str, list]) -> list[Proposal]:
    """The harness with each question of the space as its prompt's wording."""
    return [variant(harness, f"q{i}", f"asks {question!r}", {"prompt.vars": {"question": question}})
            for i, question in enumerate(space.get("question", []))]


def longest(attempts: list, spec: Any) -> list:
    """A selection policy: the passed attempt with the longest completion, one per task."""
    passed = [c for c in attempts if c.passed]
    return [max(passed, key=lambda c: len(c.completion))] if passed else []


# The family's profile: what `rsi run parity` runs under (a harness of its own is given on the command line).
profile = {"family": "parity", "target_level": 8, "curriculum": {"rule": "plus_one", "max_level": 8},
           "harness_search": {"proposers": ["parity"], "space": {"question": ["odd?"]}}}
