"""Harness proposers: candidate harness documents, drawn from what a probe of the pair showed or from a declared
search space.

A proposer is a function ``(harness, space, evidence) -> [Proposal]``, a plugin (``rsi.plugins`` kind
"proposer"). The generic ones are mutation operators, one module each in this package, each keyed to a failure
cause (``rsi.attribution``) and reading only the harness and the ``Evidence``: the pair's pass rates, the levels it
cannot pose, its failed samples with their causes and replies. None names a family, and none reads another stored
harness to find an answer. A family may ship its own proposer in its own module, by entry point in
``rsi.proposers`` (addition's ``formats`` knows its prompt and answer formats and reads ``space``: the lineage's
``harness_search.space``, knob -> values). A proposal is a whole HCP document plus its templates; the harness
search stores each one (validated like a shipped harness, immutable, content-addressed) before anything runs
under it.
"""

from rsi.proposers.base import (
    NO_EVIDENCE, Evidence, Failure, Proposal, Proposer, Space, gather, get_proposer, in_memory, propose, proposer,
    variant,
)
from rsi.proposers import answers, limits, plans, posing, prefixes  # noqa: E402, F401 (the generic operators register)

__all__ = [
    "NO_EVIDENCE", "Evidence", "Failure", "Proposal", "Proposer", "Space", "gather", "get_proposer", "in_memory",
    "propose", "proposer", "variant",
]
