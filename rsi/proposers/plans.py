"""An operator for levels the harness cannot pose (cause ``not_posable``): pose them through a plan the family
declares (``TaskFamily.plans``), at each setting of its declared parameters (``TaskFamily.plan_params``) under
which every such level can be posed and every call the plan makes for it lies at a level the pair already passes
(pass@1 of at least ``ABLE`` in the probe). The family says what its plans take; the pair's own pass rates say
which settings it can carry out; the screen picks among them. A candidate samples one reply per task
(``decoding.samples = 1``): its calls lie at levels the pair passes, so more samples of each would multiply the
calls (a task of level 16 at chunk 3 makes 11) and teach little."""

from __future__ import annotations

import itertools

from rsi.hcp import Harness
from rsi.proposers.base import Evidence, Proposal, Space, in_memory, proposer, variant

ABLE = 0.5


@proposer("plan_params")
def plan_params(harness: Harness, space: Space, evidence: Evidence) -> list[Proposal]:
    from rsi.evaluate import expressible
    from rsi.hcp.plays import calls_with_gold
    from rsi.tasks import get_family

    family = get_family(harness.document.family)
    able = {lv for lv, rates in evidence.pass_rates.items() if rates["pass@1"] >= ABLE}
    if not evidence.unposable or not able:
        return []
    out = []
    for name, grid in family.plan_params.items():
        for values in itertools.product(*grid.values()):
            params = dict(zip(grid, values))
            slug = "-".join(f"{k}{v}" for k, v in params.items())
            proposal = variant(harness, f"{name.replace('_', '')}-{slug}", f"levels {list(evidence.unposable)} not "
                               f"posable: plan {name} with {params}, its calls at levels the pair passes "
                               f"({sorted(able)})", {"plan": {"name": name, "params": params}, "decoding.samples": 1},
                               cause="not_posable")
            candidate = in_memory(proposal, harness)
            if candidate is None or not all(expressible(candidate, family, lv) for lv in evidence.unposable):
                continue
            calls = [c for lv in evidence.unposable for c in calls_with_gold(candidate, family,
                                                                             family.task("train", 0, lv, 0))[0]]
            if calls and all(c.level in able for c in calls):
                out.append(proposal)
    return out
