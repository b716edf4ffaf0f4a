"""The candidate-harness stage's work (``flows/cycle.py``'s ``search``): the parent harness picked from the archive
(``rsi.run.archive``), the champion's adapter probed under it on the screen's tasks (``rsi.run.screen``), the
operators' candidates drawn from what failed (``rsi.proposers``), stored immutably, each paired with the champion's
adapter (migrated on the lineage's own verified answers re-rendered under it when it asks for a new format) and
screened; the best that beat the parent on the screen are judged by the full gate against the champion."""

from __future__ import annotations

import logging
from typing import Any

from rsi.errors import UserError
from rsi.migrate import changes_format
from rsi.proposers import propose
from rsi.run.archive import pick_parent
from rsi.run.results import Champion, Discovered, HarnessCandidate, Screened, Searched
from rsi.store.harnesses import store_proposal

log = logging.getLogger("rsi.cycle")


def search(run: Any, number: int, champ: Champion, found: Discovered) -> Searched:
    spec, gen = run.config.harness_search, run.ledger.generation(number)
    champion, searches = run.ledger.load_pair(champ.pair_id), run.ledger.stage_results("search")
    expanded = {s.parent_hash for _, s in searches if s.champion == champ.pair_id and s.adopted is None}
    parent = run.harnesses.of(pick_parent(searches, champion.harness_hash, expanded))
    pair = run.pair(champion.adapter_hash, parent)  # the champion's adapter under the parent harness
    # the levels the parent cannot pose: those the curriculum wanted, and those up to the lineage's target level (a
    # pair the harness fails everywhere never gets the curriculum that far); the screen covers what it can pose
    top = run.harnesses.max_level(parent)
    reached = [*found.accuracy, *found.frontier_levels, *found.unposable, min(top, run.config.target_level)]
    levels = list(range(1, max(reached) + 1))
    unposable = sorted({*found.unposable, *range(top + 1, run.config.target_level + 1)})
    evidence = run.screen.probe(parent, pair, champ.adapter_dir, [lv for lv in levels if lv not in unposable],
                                unposable)
    log.info("generation %d: search: the champion's probe failed %s", number, dict(evidence.causes()))
    stored = []
    for proposal in propose(parent, spec.proposers, spec.space, evidence):
        try:  # an edit can break what the harness's load checks (the expert's episode under it, say)
            with run.fence.write() as s:
                stored.append((proposal, store_proposal(s, proposal.document, proposal.sources,
                                                        run.settings.home)))
        except UserError as exc:
            log.info("generation %d: a %s candidate does not validate, dropped: %s", number, proposal.operator,
                     str(exc).splitlines()[0][:300])
    migration = run.data.migration_set(gen.id, spec.examples_per_level)
    adapter_hash = pair.adapter_hash
    parent_screen = run.screen.scores(parent, pair, champ.adapter_dir, levels)
    tried = []
    for proposal, harness in stored:
        log.info("generation %d: candidate harness %s (%s): %s", number, harness.id, proposal.operator,
                 proposal.why)
        # a new format needs the champion's adapter migrated to it; not an edit drawn from the pair's failures
        # (it writes what the pair already writes), nor in a lineage that trains no weights: the screen judges
        # those with the adapter as it is
        migrate = changes_format(run.harnesses.of(champ), harness) and not proposal.cause and \
            run.config.train.steps > 0
        if migrate and not migration.size:
            log.info("generation %d: %s skipped: no verified answers to migrate yet", number, harness.id)
            continue
        trained = run.training.fit(number, champ, migration, run.data.load(migration.digest, harness)[0],
                                   spec.migration, run.base.adapters / f"gen-{number:03d}-{harness.hash[:12]}",
                                   True, harness) if migrate else \
            run.training.keep(number, champ, harness, adapter_hash)
        screen = run.screen.scores(harness, run.pair(trained.adapter_hash, harness), trained.adapter_dir, levels)
        tried.append((proposal, harness, trained, screen))
    beat = sorted((t for t in tried if _mean(t[3]) - _mean(parent_screen) > spec.screen_margin),
                  key=lambda t: -_mean(t[3]))
    candidates: list[HarnessCandidate] = []
    for proposal, harness, trained, screen in beat[:spec.gates]:
        judged = run.judge.judge(number, champ, found, harness, trained.adapter_hash, trained.adapter_dir)
        log.info("generation %d: candidate harness %s %s (p=%.3g): %s", number, harness.id,
                 "beats the champion" if judged.decision.promote else "rejected", judged.decision.p_value,
                 {k: round(v, 3) for k, v in judged.candidate.items()})
        candidates.append(HarnessCandidate(harness_id=harness.id, harness_hash=harness.hash, why=proposal.why,
                                           trained=trained, judged=judged, operator=proposal.operator,
                                           cause=proposal.cause, screen=screen))
    gated = {c.harness_hash for c in candidates}
    screened = [Screened(harness_id=h.id, harness_hash=h.hash, why=p.why, operator=p.operator, cause=p.cause,
                         screen=screen) for p, h, _, screen in tried if h.hash not in gated]
    promoted = [i for i, c in enumerate(candidates) if c.judged.decision.promote and c.trained is not None]
    adopted = max(promoted, key=lambda i: sum(candidates[i].judged.candidate.values()), default=None)
    return Searched(parent_harness=parent.id, parent_hash=parent.hash, champion=champ.pair_id,
                    dataset=migration.digest,
                    size=migration.size, candidates=candidates, adopted=adopted,
                    evidence=dict(evidence.causes()), parent_screen=parent_screen, screened=screened)


def _mean(scores: dict[int, float]) -> float:
    return sum(scores.values()) / max(1, len(scores))
