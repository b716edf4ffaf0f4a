"""The RSI cycle as Prefect flows, stage by stage in the order it runs.

``rsi-cycle`` runs one generation: discover -> [search] -> execute -> audit -> select -> train -> evaluate/gate ->
register; in discover the generator draws the tasks, the pair proposes them (``rsi.run.proposals``), or served
turns are harvested (``rsi.mol.harvest``: execute then stores the champion's recorded replies); ``search``
(candidate harnesses) runs when the champion's harness holds progress back, and a candidate it adopts is the
successor.
``rsi-lineage`` runs generations until the target level is mastered, candidates plateau or the budget is spent. Each
stage's result is stored under (lineage, generation, stage, inputs hash), so a run restarted after a crash skips
what finished and ends with the lineage an uninterrupted run makes. Flows take JSON (``rsi-cycle`` a ``RunContext``
and a number) and build their ``Run`` from it; a stage takes the run and the typed results of earlier stages, so any
stage also runs in another process from the context (``flows/stage.py``). SQL lives in ``rsi.store``, MLflow calls
in ``rsi.lineage``, Prefect artifacts in ``flows/artifacts.py``, logs and retries in ``flows/runtime.py``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run as current_flow_run

from rsi.flows.artifacts import progress, publish, publish_proposals
from rsi.flows.runtime import SERVER_RETRIES, Events, flow_parameters, forwarding, secret_environment
from rsi.attribution import attribute, summary as attribution_summary
from rsi.config import get_settings
from rsi.curriculum import frontier, plan_levels
from rsi.pair import sampling_params
from rsi.pair.text import training_parts
from rsi.run import (
    Audited, Champion, CycleConfig, Discovered, Executed, GenerationSummary, Judged, Registered,
    Run, RunContext, Searched, Selected, Trained, holding_lease, latest_harness, load_config, open_run,
)
from rsi.run.data import corrupt
from rsi.run.judge import pass_rates, wants_search
from rsi.run.register import done_reason, mastered_up_to
from rsi.run.results import HarnessTried, counts, judged_summary
from rsi.run.search import search
from rsi.select import Candidate, select
from rsi.splits import stream_seed
from rsi.store.ledger import fault_point
from rsi.store.records import load_tasks, load_trajectories, put_tasks, put_trajectories
from rsi.store.records import put_verdicts, store_attribution

log = logging.getLogger("rsi.cycle")


# 1. discover: levels from the champion's held-out accuracy, tasks from the train stream or the pair's proposals
@task(name="discover", task_run_name="discover-gen-{number:03d}", cache_policy=NO_CACHE)
def discover(run: Run, number: int, champ: Champion) -> Discovered:
    gen, config, harness = run.ledger.generation(number), run.config, run.harnesses.of(champ)

    def body() -> Discovered:
        # held-out greedy accuracy of the champion, from level 1 up to where it stops being admissible
        top, ceiling = max(run.base.levels) + config.eval_headroom, run.harnesses.max_level(harness)
        scores = run.scores.of(champ, champ.adapter_dir, list(range(1, min(top, ceiling) + 1)), gen.id)
        while top < ceiling and scores[top].accuracy >= config.curriculum.admit:
            top += 1
            scores |= run.scores.of(champ, champ.adapter_dir, [top], gen.id)
        accuracy = {lvl: sc.accuracy for lvl, sc in scores.items()}
        plan = plan_levels(accuracy, run.harnesses.curriculum(harness))
        posable = {p.level for p in plan}
        unposable = {p.level: p.n_tasks for p in plan_levels(accuracy, config.curriculum)
                     if p.level not in posable and p.level > ceiling}
        mastered = frontier(accuracy, config.curriculum.mastery)
        traffic, proposed, tasks = None, None, []
        if config.proposer.source == "traffic":  # the tasks people posed, answered by the champion as they were served
            traffic, tasks = run.proposer.traffic(gen.id, champ, harness, ceiling, upto=inputs["served"])
        else:  # the generator's or the pair's
            proposed, tasks = run.proposer.frontier(gen.id, number, champ, plan, ceiling)
        replay_seed, replay_levels = stream_seed("replay", config.seed, number), range(1, mastered + 1 if plan else 1)
        tasks += [t for lvl in replay_levels if proposed is None and traffic is None  # a pair replays its selections
                  for t in run.family.tasks("train", replay_seed, lvl, config.replay_tasks_per_level)]
        with run.fence.write() as s:
            put_tasks(s, tasks)
        publish_proposals(config.lineage, number, proposed)
        return Discovered(accuracy=accuracy, frontier=mastered, plan=plan, task_ids=[t.id for t in tasks],
                          frontier_levels=[p.level for p in plan], replay_levels=list(replay_levels),
                          unposable=unposable, proposed=proposed, traffic=traffic)

    inputs = {"champion": champ.pair_id}
    if config.proposer.source == "traffic":  # the turns served by now: run again later, discover harvests anew
        inputs["served"] = run.proposer.served_upto()
    return run.ledger.run_stage(gen, "discover", inputs, body)


# 2. execute: k samples per task (the harness's decoding.samples) under the champion pair; all stored. Traffic's
# turns were answered when they were served: their trajectories, stored by discover, are the ones audited
@task(name="execute", task_run_name="execute-gen-{number:03d}", cache_policy=NO_CACHE)
def execute(run: Run, number: int, champ: Champion, found: Discovered) -> Executed:
    gen = run.ledger.generation(number)

    def body() -> Executed:
        if found.traffic is not None:
            return Executed(trajectories=len(found.traffic.turns), tasks=len(found.task_ids), seconds=0.0,
                            ids=[t.trajectory_id for t in found.traffic.turns])
        with run.store.session() as s:
            tasks = load_tasks(s, found.task_ids)
        harness = run.harnesses.of(champ)
        params = sampling_params(harness, seed=stream_seed("rollout", run.config.seed, number))
        start = time.perf_counter()
        trajectories, posed = run.runner.rollout(harness, tasks, champ.pair_id, params, adapter=champ.adapter_dir)
        if harness.document.plan is not None:  # the plan's calls are the trajectories; training data holds
            keep = {t.id for t in posed if t.split == "train"}  # train-split problems only, whatever they are part of
            posed, trajectories = [t for t in posed if t.id in keep], [t for t in trajectories if t.task_id in keep]
        with run.fence.write() as s:
            put_tasks(s, posed)
            put_trajectories(s, trajectories, generation_id=gen.id)
        return Executed(trajectories=len(trajectories), tasks=len(tasks), seconds=time.perf_counter() - start,
                        ids=[t.id for t in trajectories])

    return run.ledger.run_stage(gen, "execute", {"tasks": list(found.task_ids), "champion": champ.pair_id}, body)


# 3. audit: the external auditor judges every stored trajectory under the harness's contract
@task(name="audit", task_run_name="audit-gen-{number:03d}", cache_policy=NO_CACHE)
def audit(run: Run, number: int, champ: Champion, found: Discovered, executed: Executed) -> Audited:
    gen = run.ledger.generation(number)

    def body() -> Audited:
        with run.store.session() as s:
            trajectories, tasks = load_trajectories(s, executed.ids)
        verdicts = run.runner.audit(run.harnesses.of(champ), trajectories, tasks, run.ledger.load_pair(champ.pair_id))
        blame = attribute(trajectories, {v.trajectory_id: v for v in verdicts}, tasks, found.unposable)
        with run.fence.write() as s:
            put_verdicts(s, verdicts)
            store_attribution(s, gen.id, blame)
        failures = Counter(rule for v in verdicts for rule in v.failed_rules())
        return Audited(audited=len(verdicts), passed=sum(v.passed for v in verdicts), failed_by_rule=dict(failures),
                       pass_rates=pass_rates(trajectories, tasks, {v.trajectory_id: v.passed for v in verdicts}),
                       attribution=attribution_summary(blame))

    inputs = {"trajectories": list(executed.ids), "contract": champ.harness_hash}
    return run.ledger.run_stage(gen, "audit", inputs, body)


# 4. select: passed trajectories only, filtered, plus replay of earlier generations' selections
@task(name="select", task_run_name="select-gen-{number:03d}", cache_policy=NO_CACHE)
def select_stage(run: Run, number: int, champ: Champion, found: Discovered, executed: Executed,
                 audited: Audited) -> Selected:
    gen, config, harness = run.ledger.generation(number), run.config, run.harnesses.of(champ)

    def body() -> Selected:
        with run.store.session() as s:
            trajectories, tasks = load_trajectories(s, executed.ids)
        passed = run.data.kept(trajectories, config.labels, harness)
        candidates = [Candidate(trajectory_id=t.id, task_id=t.task_id, level=tasks[t.task_id].level,
                                prompt=prompt, completion=completion, turns=turns, passed=t.id in passed)
                      for t in trajectories for prompt, completion, turns in [training_parts(t.messages)]]
        replay = run.data.replay(number, harness, config.selection.replay_generations)
        spec = config.selection if found.traffic is None else \
            config.selection.model_copy(update={"band": (0.0, 1.0)})  # one reply per turn: no pass rate to band
        dataset = select(candidates, replay, spec, frontier_levels=set(found.frontier_levels),
                         seed=config.seed + number)
        dataset = run.proposer.with_learnable(found.proposed, dataset, trajectories, passed)  # it learns to propose
        corrupted = config.corrupt_training_data
        dataset = dataset.model_copy(update={"corrupted": corrupted})  # its own digest: never mistaken for clean
        key = dataset.digest  # hashes every example: once, not once per stored item inside the write lock
        run.data.put(key, gen.id, {**config.selection.model_dump(mode="json"), "corrupted": corrupted,
                                   "labels": config.labels, "sources": [e.source for e in dataset.examples]},
                     [e.trajectory_id for e in dataset.examples])
        return Selected(digest=key, size=len(dataset.examples), corrupted=corrupted,
                        frontier=len(dataset.pool("frontier")), replay=len(dataset.pool("replay")))

    inputs = {"audit": audited.model_dump(mode="json"), "trajectories": list(executed.ids)}
    return run.ledger.run_stage(gen, "select", inputs, body)


# 5. train: a LoRA adapter warm-started from the champion's, on the stored selection; metrics to MLflow
@task(name="train", task_run_name="train-gen-{number:03d}", cache_policy=NO_CACHE, **SERVER_RETRIES)
def train(run: Run, number: int, champ: Champion, selected: Selected) -> Trained:
    gen = run.ledger.generation(number)

    def body() -> Trained:
        dataset, corrupted = run.data.load(selected.digest, run.harnesses.of(champ))
        if corrupted:
            dataset = corrupt(dataset, seed=number)
        warm = champ.adapter_dir is not None and run.config.warm_start == "parent"
        return run.training.fit(number, champ, selected, dataset, run.config.train,
                                run.base.adapters / f"gen-{number:03d}-{selected.digest[:12]}", warm)

    inputs = {"dataset": selected.digest, "parent": champ.pair_id, "spec": run.config.train.model_dump(mode="json")}
    return run.ledger.run_stage(gen, "train", inputs, body)


# 6. evaluate / gate: candidate vs parent (and the lineage's best records) on the same held-out tasks
@task(name="evaluate", task_run_name="evaluate-gen-{number:03d}", cache_policy=NO_CACHE)
def evaluate_gate(run: Run, number: int, champ: Champion, found: Discovered, trained: Trained) -> Judged:
    gen, harness = run.ledger.generation(number), run.harnesses.of(champ)
    attempt = run.ledger.attempt(champ.pair_id, run.pair(trained.adapter_hash, harness).id, number)
    inputs = {"adapter": trained.adapter_hash, "parent": champ.pair_id, "attempt": attempt,
              "champions": run.champions()}
    return run.ledger.run_stage(gen, "evaluate", inputs, lambda: run.judge.judge(
        number, champ, found, harness, trained.adapter_hash, trained.adapter_dir))


# 4b. search: candidate harnesses, each paired with the champion's adapter (migrated) and judged
@task(name="search", task_run_name="search-gen-{number:03d}", cache_policy=NO_CACHE, **SERVER_RETRIES)
def search_harness(run: Run, number: int, champ: Champion, found: Discovered) -> Searched:
    """Candidate harnesses drawn from the champion's failures, screened, the best judged by the full gate
    (``rsi.run.search``); the one the gate promotes is adopted."""
    spec, gen = run.config.harness_search, run.ledger.generation(number)
    inputs = {"champion": champ.pair_id, "spec": spec.model_dump(mode="json"), "champions": run.champions()}
    return run.ledger.run_stage(gen, "search", inputs, lambda: search(run, number, champ, found))


# 7. register: a model version with the adapter and the HCP document; the generation's end commits with it
@task(name="register", task_run_name="register-gen-{number:03d}", cache_policy=NO_CACHE, **SERVER_RETRIES)
def register(run: Run, number: int, champ: Champion, selected: Selected, trained: Trained, judged: Judged,
             searched: Searched | None = None) -> Registered:
    """MLflow writes first, each idempotent (the version is found again by its pair id); then one state-DB
    transaction stores the result and finishes the generation; then the aliases follow the committed state.
    A crash anywhere before the commit redoes the same writes; after it, the aliases are repaired when the
    lineage runs again. After a harness search, the candidates not taken are registered too (rejected)."""
    gen, promote = run.ledger.generation(number), judged.decision.promote

    def body() -> Registered:
        others = {c.judged.candidate_pair_id: run.registrar.candidate(number, champ, searched.dataset, c.trained,
                                                                      c.judged, why=c.why, adopted=False,
                                                                      made_by=(c.operator, c.cause,
                                                                               searched.parent_harness))[0]
                  for c in (searched.candidates if searched else ())
                  if c.trained is not None and c.judged.candidate_pair_id != judged.candidate_pair_id}
        mine = next((c for c in searched.candidates if c.judged == judged), None) if searched else None
        version, model_uri = run.registrar.candidate(number, champ, selected.digest, trained, judged,
                                                     why=mine.why if mine else "",
                                                     made_by=(mine.operator, mine.cause, searched.parent_harness)
                                                     if mine else ("", "", ""))
        run.registrar.generation(number, judged, trained.mlflow_run_id)
        return Registered(version=version, promoted=promote, model_uri=model_uri, others=others)

    inputs = {"evaluate": judged.candidate_pair_id, "gate": judged.decision.model_dump(mode="json"),
              "search": searched.model_dump(mode="json") if searched else None}
    finish = run.ledger.finisher(gen, champ.pair_id, judged.candidate_pair_id, promote)
    result = run.ledger.run_stage(gen, "register", inputs, body, finish=finish)
    run.registrar.sync_aliases()
    return result


# The flows
def cycle_run_name() -> str:
    """``<lineage>-gen-<NNN>``: the generation's flow run, findable by name in the UI and the API."""
    params = current_flow_run.parameters
    context = RunContext.model_validate(params["context"])
    return f"{context.config.lineage}-gen-{int(params['number']):03d}"


@flow(name="rsi-cycle", flow_run_name=cycle_run_name, log_prints=False)
def rsi_cycle(context: RunContext, number: int) -> GenerationSummary:
    """One generation, stage by stage, in a run built from ``context``; returns its summary (also published as
    Prefect artifacts)."""
    with open_run(context) as run:
        summary = generation(run, number, on_stage=progress(f"{context.config.lineage} generation {number}", 7))
        if summary.gate is not None:
            publish(summary, run.config.lineage, run.ledger, run.registry)
    return summary


def generation(run: Run, number: int, *, direct: bool = False,
               on_stage: Callable[[int, str], Any] = lambda i, name: None) -> GenerationSummary:
    """The stages of one generation in order. ``direct`` calls the stage functions without Prefect
    (``bench/cycle.py`` measures the orchestration overhead that way)."""
    def call(stage, *args):
        log.info("generation %d: %s ...", number, stage.name)
        started = time.perf_counter()
        result = stage.fn(run, number, *args) if direct else stage(run, number, *args)
        seconds[stage.name] = time.perf_counter() - started
        said = f": {counts(result)}" if counts(result) else ""
        log.info("generation %d: %s done in %.1f s%s", number, stage.name, seconds[stage.name], said)
        on_stage(len(seconds), stage.name)
        return result

    config, seconds = run.config, {}
    run.fence.check()
    fault_point(number, "start")
    run.ledger.generation(number)
    champ = run.champion(number)
    log.info("generation %d: champion %s (%s)", number, champ.version, champ.pair_id)
    found = call(discover, champ)
    stalled, trains = run.ledger.rejections_in_a_row() > 0, config.train.steps > 0
    # a lineage that trains no weights improves its harness alone: it searches
    last = next((g for g in reversed(run.ledger.finished()) if g.number < number), None)
    audited = run.ledger.result(last, "audit") if last else None  # none after a harness generation
    failed = audited.attribution if audited else None
    search = wants_search(spec := config.harness_search, found, number, stalled, failed) or \
        (spec.enabled and not trains)
    searched = call(search_harness, champ, found) if search else None
    if searched is not None and (searched.adopted is not None or not found.plan or not trains):
        return harness_generation(run, number, champ, found, searched, call).model_copy(update={"seconds": seconds})
    stop = partial(GenerationSummary, generation=number, seconds=seconds)
    if not found.plan:
        return stop(stopped="curriculum exhausted")
    if not trains:
        return stop(stopped="train.steps is 0 and harness search is off: nothing to change")
    if found.proposed is not None and not found.proposed.task_ids:
        return stop(stopped=f"nothing to train on: no proposal passed the rules ({found.proposed.rejected_by_rule})")
    if found.traffic is not None and not found.traffic.turns:
        served = ", ".join(found.traffic.specialists) or "none: `rsi specialists add` one"
        return stop(stopped=f"nothing to train on: no served turn to harvest (this lineage's specialists: {served}; "
                    f"turns not harvested: {found.traffic.skipped})")
    executed = call(execute, champ, found)
    audited = call(audit, champ, found, executed)
    selected = call(select_stage, champ, found, executed, audited)
    if selected.size == 0:
        return stop(stopped=(
            f"nothing to train on: none of the {audited.audited} trajectories at levels "
            f"{', '.join(str(p.level) for p in found.plan)} passed the audit (failed rules: {audited.failed_by_rule}); "
            "the champion solves none of the tasks the curriculum chose: a base that never learned this family or "
            "harness? (`rsi lineage show` and the audit's rules say more)"))
    trained = call(train, champ, selected)
    judged = call(evaluate_gate, champ, found, trained)
    registered = call(register, champ, selected, trained, judged, searched)
    targets = [str(lvl) for lvl in found.frontier_levels]
    summary = judged_summary(number, judged, registered, trained, run.judge.gains(number, judged), searched).model_copy(
        update={"seconds": seconds, "targets": targets, "tasks": executed.tasks, "trajectories": executed.trajectories,
                "passed": audited.passed, "selected": selected.size,
                "pass_at": {lvl: audited.pass_rates.get(int(lvl)) for lvl in targets}})
    log.info("generation %d: %s (p=%.3g); accuracy %s", number, summary.gate, summary.p_value, summary.candidate)
    return summary


def harness_generation(run: Run, number: int, champ: Champion, found: Discovered, searched: Searched,
                       call: Callable[..., Any]) -> GenerationSummary:
    """A generation whose candidate is a harness search's: the adopted pair (migrated adapter + new harness),
    or, when none beat the champion, the best rejected one, so the lineage records what was tried."""
    gen = run.ledger.generation(number)
    tried = [c for c in searched.candidates if c.trained is not None]
    if not tried:
        return GenerationSummary(generation=number, stopped="no candidate harness to try: the probe found nothing an "
                                 "operator answers, none beat the champion on the screen, or the curriculum is "
                                 "exhausted", harness_candidates=[HarnessTried(harness=c.harness_id, gate="screened out")
                                                                  for c in searched.screened])
    chosen = searched.candidates[searched.adopted] if searched.adopted is not None else \
        max(tried, key=lambda c: sum(c.judged.candidate.values()))
    inputs = {"search": chosen.judged.candidate_pair_id}
    trained = run.ledger.run_stage(gen, "train", inputs, lambda: chosen.trained)
    judged = run.ledger.run_stage(gen, "evaluate", inputs, lambda: chosen.judged)
    migration = Selected(digest=searched.dataset, size=searched.size, corrupted=False, frontier=searched.size, replay=0)
    registered = call(register, champ, migration, trained, judged, searched)
    log.info("generation %d: harness search: %s %s", number,
             "adopted" if judged.decision.promote else "no candidate beat the champion", chosen.harness_id)
    stopped = "the harness cannot pose the next level and no candidate harness beat the champion" \
        if not judged.decision.promote and not found.plan else None
    return judged_summary(number, judged, registered, trained, run.judge.gains(number, judged), searched).model_copy(
        update={"targets": [str(lvl) for lvl in sorted(found.unposable)], "selected": searched.size,
                "harness": chosen.harness_id, "stopped": stopped})


def lineage_run_name() -> str:
    params = current_flow_run.parameters
    return f"{params.get('lineage') or params.get('family')}-lineage"


@flow(name="rsi-lineage", flow_run_name=lineage_run_name, log_prints=False)
def rsi_lineage(family: str = "addition", lineage: str | None = None, harness: str | None = None,
                profile: str | None = "demo", generations: int | None = None,
                overrides: dict[str, Any] | None = None,
                lease: tuple[str, int] | None = None) -> list[GenerationSummary]:
    """Generations of one lineage until its target level is mastered, a plateau of rejections, or the budget
    is spent. Parameters are JSON (a deployment schedules it): ``overrides`` are CycleConfig fields over the
    profile's. Takes the lineage's lease (a second run fails naming the holder) and keeps it alive, unless
    ``lease`` (holder, token) says the caller holds it for this run."""
    secret_environment()  # a scheduled run's credentials (`rsi deploy` keeps them out of the job variables)
    fields = {"family": family, "lineage": lineage or family, "harness": harness or latest_harness(family)}
    config = load_config(profile, **{**(overrides or {}), **fields})
    holder, token = lease or (None, None)
    with open_run(RunContext.of(config, get_settings()).model_copy(update={"holder": holder, "token": token})) as run, \
            holding_lease(run.fence):
        run.registrar.sync_aliases()  # a crash between a generation's commit and its alias move is repaired here
        summaries: list[GenerationSummary] = []
        done = run.ledger.finished()
        start = (done[-1].number + 1) if done else 1
        for number in range(start, start + (generations or config.generations)):
            summaries.append(summary := rsi_cycle(run.context.leased(run.fence), number))
            run.fence.check()  # the heartbeat gave up or the lease was taken over: stop here
            mastered = mastered_up_to(run.ledger, run.scores, run.base.levels, config.curriculum)
            why = summary.stopped or done_reason(config, mastered, run.ledger.rejections_in_a_row())
            if why:
                log.info("stopping: %s", why)
                break
        return summaries


def run_lineage(config: CycleConfig, generations: int | None = None,
                events: Events = lambda _: None) -> list[GenerationSummary]:
    """Run the lineage flow in this process. The run is opened and its lease taken before Prefect starts, so
    a bad harness or a lineage held by another run fails at once with a clear message (exit 2)."""
    with open_run(RunContext.of(config, get_settings())) as run, holding_lease(run.fence), forwarding(events):
        return rsi_lineage(**flow_parameters(config), generations=generations,
                           lease=(run.fence.holder, run.fence.token))
