"""The RSI cycle as Prefect flows, stage by stage in the order it runs.

``rsi-cycle`` runs one generation: discover -> [search] -> execute -> audit -> select -> train ->
evaluate/gate -> register. ``search`` (candidate harnesses, see ``search_harness``) runs when the champion's
harness holds progress back; a candidate it adopts is the generation's successor (a harness generation:
discover -> search -> register). ``rsi-lineage`` runs generations until the target level is mastered, the
candidates plateau,
or the generation budget is spent. Each stage's result is persisted in the state DB under (lineage,
generation, stage, inputs hash), so a run started again after a crash skips what already finished and
ends with the same lineage it would have produced uninterrupted.

What crosses a flow or task boundary is JSON: ``rsi-lineage`` takes family, lineage, harness, profile,
generations and overrides (so a deployment can schedule it), ``rsi-cycle`` a ``CycleConfig`` and a
generation number, and each stage task the config, the number and the typed results of earlier stages
(``rsi.cycle.Discovered`` ... ``Registered``). The store, backend and registry are built once in the
flow's process (``LineageRun``) and found there by ``current_run``. rsi's log lines (logger ``rsi``) go to
the Prefect run's logs.
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rsi.config import get_settings

get_settings().configure_prefect()  # a configured server or profile, else the ephemeral API in RSI_HOME
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry; it also locks SQLite
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")  # rsi logs outside a run: no warning
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# PEFT 0.21 calls an attribute transformers 5 renamed; harmless, and it would print once per adapter load.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

from prefect import flow, task  # noqa: E402
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_progress_artifact  # noqa: E402
from prefect.artifacts import create_table_artifact, update_progress_artifact  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402
from prefect.logging.handlers import APILogHandler  # noqa: E402
from prefect.runtime import flow_run as current_flow_run  # noqa: E402
from prefect.tasks import exponential_backoff  # noqa: E402
from sqlalchemy import select as sql_select  # noqa: E402

from rsi.attribution import attribute  # noqa: E402
from rsi.attribution import summary as attribution_summary  # noqa: E402
from rsi.attribution import table as attribution_table  # noqa: E402
from rsi.pair.text import training_parts  # noqa: E402
from rsi.curriculum import frontier, plan_levels  # noqa: E402
from rsi.cycle import (  # noqa: E402
    Audited, Champion, CycleConfig, Discovered, Executed, HarnessCandidate, HarnessSearchSpec, Judged, LineageRun,
    Registered, Searched, Selected, Trained, current_run, fault_point, holding_lease, latest_harness, load_config,
    open_run,
)
from rsi.decomposition import Decomposition, decompose_levels, over_no_training  # noqa: E402
from rsi.decomposition import metrics as gain_metrics  # noqa: E402
from rsi.decomposition import rows as gain_rows  # noqa: E402
from rsi.errors import RsiError  # noqa: E402
from rsi.evaluate import answer_of, evaluation_tasks, majority_answers  # noqa: E402
from rsi.pair import sampling_params  # noqa: E402
from rsi.gate import decide  # noqa: E402
from rsi.hashing import digest  # noqa: E402
from rsi.hcp import Harness  # noqa: E402
from rsi.migrate import changes_format, rerender, true_example  # noqa: E402
from rsi.models import Task, Trajectory  # noqa: E402
from rsi.hcp.plays import calls_with_gold, poses  # noqa: E402
from rsi.select import Candidate, Dataset, Example, select  # noqa: E402
from rsi.splits import stream_seed  # noqa: E402
from rsi.store.records import (  # noqa: E402
    load_attribution, put_tasks, put_trajectories, put_verdicts, store_attribution, task_from_row, trajectory_from_row,
)
from rsi.store.schema import DatasetItem, DatasetRow, Generation, TaskRow, TrajectoryRow, VerdictRow, utcnow  # noqa: E402
from rsi.train import train_adapter  # noqa: E402

STAGES = ("discover", "execute", "audit", "select", "train", "evaluate", "register")
Events = Callable[[str], None]
log = logging.getLogger("rsi.cycle")
_rsi_log = logging.getLogger("rsi")
_rsi_log.setLevel(logging.INFO)
if not any(isinstance(h, APILogHandler) for h in _rsi_log.handlers):
    _rsi_log.addHandler(APILogHandler())  # rsi's lines show in the flow and task runs' Logs tab


def _quiet(_: str) -> None:
    pass


def _retry_unless_rsi_error(task, task_run, state) -> bool:
    """Retry what may be transient (a server call that failed), never rsi's own verdicts (lease lost, bad input)."""
    try:
        state.result()
    except RsiError:
        return False
    except Exception:  # noqa: BLE001 - anything else may pass on a second try
        return True
    return False


SERVER_RETRIES = {"retries": 3, "retry_delay_seconds": exponential_backoff(backoff_factor=5),
                  "retry_condition_fn": _retry_unless_rsi_error}


# --------------------------------------------------------------------------------------------------------
# 1. discover: levels from the champion's held-out accuracy, tasks from this generation's train stream
# --------------------------------------------------------------------------------------------------------
@task(name="discover", task_run_name="discover-gen-{number:03d}", cache_policy=NO_CACHE)
def discover(config: CycleConfig, number: int, champ: Champion) -> Discovered:
    run = current_run(config)
    gen = run.generation_row(number)

    def body() -> Discovered:
        accuracy = champion_accuracy(run, champ, gen)
        plan = plan_levels(accuracy, run.curriculum(run.harness_of(champ)))
        posable = {p.level for p in plan}
        unposable = {p.level: p.n_tasks for p in plan_levels(accuracy, run.config.curriculum) if p.level not in posable
                     and p.level > run.max_level(run.harness_of(champ))}
        mastered = frontier(accuracy, run.config.curriculum.mastery)
        seed = stream_seed("rollout", run.config.seed, gen.number)
        tasks = [t for p in plan for t in run.family.tasks("train", seed, p.level, p.n_tasks)]
        replay_seed = stream_seed("replay", run.config.seed, gen.number)
        replay_levels = range(1, mastered + 1) if plan else range(0)
        tasks += [t for lvl in replay_levels
                  for t in run.family.tasks("train", replay_seed, lvl, run.config.replay_tasks_per_level)]
        with run.write() as s:
            put_tasks(s, tasks)
        return Discovered(accuracy=accuracy, frontier=mastered, plan=plan, task_ids=[t.id for t in tasks],
                          frontier_levels=[p.level for p in plan], replay_levels=list(replay_levels),
                          unposable=unposable)

    return run.run_stage(gen, "discover", {"champion": champ.pair_id}, body)


def champion_accuracy(run: LineageRun, champ: Champion, gen: Generation) -> dict[int, float]:
    """Held-out greedy accuracy of the champion, from level 1 up to where it stops being admissible."""
    top = max(run.base_levels) + run.config.eval_headroom
    ceiling = run.max_level(run.harness_of(champ))
    scores = run.scores(champ, champ.adapter_dir, list(range(1, min(top, ceiling) + 1)), gen.id)
    while top < ceiling and scores[top].accuracy >= run.config.curriculum.admit:
        top += 1
        scores |= run.scores(champ, champ.adapter_dir, [top], gen.id)
    return {lvl: sc.accuracy for lvl, sc in scores.items()}


# --------------------------------------------------------------------------------------------------------
# 2. execute: k samples per task (the harness's decoding.samples) under the champion pair; all stored
# --------------------------------------------------------------------------------------------------------
@task(name="execute", task_run_name="execute-gen-{number:03d}", cache_policy=NO_CACHE)
def execute(config: CycleConfig, number: int, champ: Champion, found: Discovered) -> Executed:
    run = current_run(config)
    gen = run.generation_row(number)

    def body() -> Executed:
        with run.store.session() as s:
            rows = {r.id: r for r in s.scalars(sql_select(TaskRow).where(TaskRow.id.in_(found.task_ids)))}
        tasks = [task_from_row(rows[i]) for i in found.task_ids]
        harness = run.harness_of(champ)
        params = sampling_params(harness, seed=stream_seed("rollout", run.config.seed, gen.number))
        start = time.perf_counter()
        trajectories, posed = run.runner.rollout(harness, tasks, champ.pair_id, params, adapter=champ.adapter_dir)
        if harness.document.plan is not None:  # the plan's calls are the trajectories; training data holds
            keep = {t.id for t in posed if t.split == "train"}  # train-split problems only, whatever they are part of
            posed, trajectories = [t for t in posed if t.id in keep], [t for t in trajectories if t.task_id in keep]
        with run.write() as s:
            put_tasks(s, posed)
            put_trajectories(s, trajectories, generation_id=gen.id)
        return Executed(trajectories=len(trajectories), tasks=len(tasks), seconds=time.perf_counter() - start,
                        ids=[t.id for t in trajectories])

    return run.run_stage(gen, "execute", {"tasks": list(found.task_ids), "champion": champ.pair_id}, body)


# --------------------------------------------------------------------------------------------------------
# 3. audit: the external auditor judges every stored trajectory under the harness's contract
# --------------------------------------------------------------------------------------------------------
@task(name="audit", task_run_name="audit-gen-{number:03d}", cache_policy=NO_CACHE)
def audit_stage(config: CycleConfig, number: int, champ: Champion, found: Discovered, executed: Executed) -> Audited:
    run = current_run(config)
    gen = run.generation_row(number)

    def body() -> Audited:
        trajectories, tasks = load_trajectories(run, executed.ids)
        pair = run.load_pair(champ.pair_id)
        verdicts = run.runner.audit(run.harness_of(champ), trajectories, tasks, pair)
        blame = attribute(trajectories, {v.trajectory_id: v for v in verdicts}, tasks, found.unposable)
        with run.write() as s:
            put_verdicts(s, verdicts)
            store_attribution(s, gen.id, blame)
        failures = Counter(rule for v in verdicts for rule in v.failed_rules())
        return Audited(audited=len(verdicts), passed=sum(v.passed for v in verdicts), failed_by_rule=dict(failures),
                       pass_rates=pass_rates(trajectories, tasks, {v.trajectory_id: v.passed for v in verdicts}),
                       attribution=attribution_summary(blame))

    return run.run_stage(gen, "audit", {"trajectories": list(executed.ids), "contract": champ.harness_hash}, body)


def load_trajectories(run: LineageRun, ids) -> tuple[list[Trajectory], dict[str, Task]]:
    """Stored trajectories in the order of ``ids``, and their tasks by id."""
    with run.store.session() as s:
        rows = list(s.scalars(sql_select(TrajectoryRow).where(TrajectoryRow.id.in_(ids))))
        task_ids = {r.task_id for r in rows}
        tasks = {r.id: task_from_row(r) for r in s.scalars(sql_select(TaskRow).where(TaskRow.id.in_(task_ids)))}
    order = {tid: i for i, tid in enumerate(ids)}
    return sorted((trajectory_from_row(r) for r in rows), key=lambda t: order[t.id]), tasks


def pass_rates(trajectories, tasks, passed: dict[str, bool]) -> dict[int, dict[str, float]]:
    """Per level: pass@1 (mean over samples) and pass@k (share of tasks with at least one pass)."""
    by_task: dict[str, list[bool]] = defaultdict(list)
    for t in trajectories:
        by_task[t.task_id].append(passed[t.id])
    by_level: dict[int, list[list[bool]]] = defaultdict(list)
    for task_id, outcomes in by_task.items():
        by_level[tasks[task_id].level].append(outcomes)
    return {lvl: {"pass@1": sum(map(sum, rows)) / sum(map(len, rows)),
                       "pass@k": sum(any(r) for r in rows) / len(rows), "tasks": len(rows)}
            for lvl, rows in sorted(by_level.items())}


# --------------------------------------------------------------------------------------------------------
# 4. select: passed trajectories only, filtered, plus replay of earlier generations' selections
# --------------------------------------------------------------------------------------------------------
@task(name="select", task_run_name="select-gen-{number:03d}", cache_policy=NO_CACHE)
def select_stage(config: CycleConfig, number: int, champ: Champion, found: Discovered, executed: Executed,
                 audited: Audited) -> Selected:
    run = current_run(config)
    gen = run.generation_row(number)

    def body() -> Selected:
        trajectories, tasks = load_trajectories(run, executed.ids)
        passed = kept(run, champ, trajectories)
        candidates = [Candidate(trajectory_id=t.id, task_id=t.task_id, level=tasks[t.task_id].level,
                                prompt=prompt, completion=completion, turns=turns, passed=t.id in passed)
                      for t in trajectories for prompt, completion, turns in [training_parts(t.messages)]]
        dataset = select(candidates, replay_examples(run, gen, run.harness_of(champ)), run.config.selection,
                         frontier_levels=set(found.frontier_levels), seed=run.config.seed + gen.number)
        corrupted = run.config.corrupt_training_data
        dataset = dataset.model_copy(update={"corrupted": corrupted})  # its own digest: never mistaken for clean
        key = dataset.digest  # hashes every example: once, not once per stored item inside the write lock
        with run.write() as s:
            if s.get(DatasetRow, key) is None:
                s.add(DatasetRow(digest=key, lineage=run.config.lineage, generation_id=gen.id,
                                 size=len(dataset.examples),
                                 filters={**run.config.selection.model_dump(mode="json"), "corrupted": corrupted,
                                          "labels": run.config.labels,
                                          "sources": [e.source for e in dataset.examples]}))
                s.flush()
                s.add_all(DatasetItem(dataset_digest=key, position=i, trajectory_id=e.trajectory_id)
                          for i, e in enumerate(dataset.examples))
        return Selected(digest=key, size=len(dataset.examples), corrupted=corrupted,
                        frontier=len(dataset.pool("frontier")), replay=len(dataset.pool("replay")))

    inputs = {"audit": audited.model_dump(mode="json"), "trajectories": list(executed.ids)}
    return run.run_stage(gen, "select", inputs, body)


def kept(run: LineageRun, champ: Champion, trajectories: Sequence[Trajectory]) -> set[str]:
    """The trajectories a selection may keep, by the lineage's ``labels``: those the auditor passed under the
    champion's contract; ABLATIONS: every one (unverified), the first of each task (truth: its example is
    the true answer, written when the dataset is loaded), or those giving the answer more than half of
    their task's samples give (majority: no verifier)."""
    labels = run.config.labels
    if labels == "unverified":
        return {t.id for t in trajectories}
    if labels == "truth":
        return {next(t.id for t in trajectories if t.task_id == task_id) for task_id in {t.task_id for t in trajectories}}
    if labels == "majority":
        harness = run.harness_of(champ)
        answers = {t.id: answer_of(harness, t.completion) for t in trajectories}
        majority = majority_answers([(t.task_id, answers[t.id]) for t in trajectories if answers[t.id] is not None],
                                    harness.document.decoding.samples)
        return {t.id for t in trajectories if t.task_id in majority and answers[t.id] == majority[t.task_id]}
    with run.store.session() as s:
        return set(s.scalars(sql_select(VerdictRow.trajectory_id).where(
            VerdictRow.trajectory_id.in_([t.id for t in trajectories]), VerdictRow.passed,
            VerdictRow.harness_hash == champ.harness_hash)))


def load_dataset(run: LineageRun, dataset_digest: str, harness: Harness | None = None) -> tuple[Dataset, bool]:
    """A stored selection as training examples, read from the stored trajectories (prompt and completion
    exactly as sampled; written again under ``harness`` where they were sampled under another one, see
    ``rsi.migrate``), and whether the test switch marked it corrupted."""
    with run.store.session() as s:
        row = s.get(DatasetRow, dataset_digest)
        items = list(s.scalars(sql_select(DatasetItem).where(DatasetItem.dataset_digest == dataset_digest)
                               .order_by(DatasetItem.position)))
        sources, corrupted = row.filters["sources"], bool(row.filters.get("corrupted"))
        truth = row.filters.get("labels") == "truth"
    trajectories, tasks = load_trajectories(run, [i.trajectory_id for i in items])
    examples = []
    for t, source in zip(trajectories, sources, strict=True):
        sampled_under = run.harness_of(t.harness_id)
        examples.append(true_example(t, tasks[t.task_id], harness or sampled_under, run.family, source) if truth
                        else rerender(t, tasks[t.task_id], sampled_under, harness or sampled_under, source))
    examples = tuple(examples)
    return Dataset(examples=examples, corrupted=corrupted), corrupted


def replay_examples(run: LineageRun, gen: Generation, harness: Harness) -> list[Example]:
    """Selected examples of the last few earlier generations (verified samples, never labels), under the
    champion's ``harness`` (re-rendered where an earlier generation sampled them under another)."""
    earlier = [g for g in run.finished_generations() if g.number < gen.number][-run.config.selection.replay_generations:]
    examples: list[Example] = []
    for g in earlier:
        result = run.stage_result(g, "select")
        if result and not result.corrupted:  # the test switch's shuffled answers must never be replayed
            examples += load_dataset(run, result.digest, harness)[0].examples
    return examples


def corrupt(dataset: Dataset, seed: int) -> Dataset:
    """TEST SWITCH: shuffle the answers among the examples, so the data no longer matches its prompts."""
    rng = random.Random(seed)
    answers = [(e.completion, e.turns) for e in dataset.examples]
    rng.shuffle(answers)
    return dataset.model_copy(update={"examples": tuple(e.model_copy(update={"completion": a, "turns": turns})
                                                        for e, (a, turns) in zip(dataset.examples, answers))})


# --------------------------------------------------------------------------------------------------------
# 5. train: a LoRA adapter warm-started from the champion's, on the stored selection; metrics to MLflow
# --------------------------------------------------------------------------------------------------------
@task(name="train", task_run_name="train-gen-{number:03d}", cache_policy=NO_CACHE, **SERVER_RETRIES)
def train(config: CycleConfig, number: int, champ: Champion, selected: Selected) -> Trained:
    run = current_run(config)
    gen = run.generation_row(number)

    def body() -> Trained:
        dataset, corrupted = load_dataset(run, selected.digest, run.harness_of(champ))
        if corrupted:
            dataset = corrupt(dataset, seed=gen.number)
        warm = champ.adapter_dir is not None and run.config.warm_start == "parent"
        parent = Path(champ.adapter_dir) if warm else None
        out_dir = run.adapters_dir() / f"gen-{gen.number:03d}-{selected.digest[:12]}"
        losses: list[tuple[int, float, float]] = []

        def on_step(step: int, loss: float, lr: float) -> None:
            run.check_lease()  # a lost lease stops training at once, not after it
            losses.append((step, loss, lr))

        start = time.perf_counter()
        result = train_adapter(run.base_dir, parent, dataset, run.config.train, out_dir,
                               seed=run.config.seed * 1000 + gen.number, on_step=on_step)
        seconds = time.perf_counter() - start
        run_id = log_training(run, gen, champ, selected, dataset, losses, seconds)
        return Trained(**result.model_dump(), seconds=seconds, mlflow_run_id=run_id,
                       examples_digest=examples_digest(dataset), warm_start=str(parent) if parent else None)

    inputs = {"dataset": selected.digest, "parent": champ.pair_id, "spec": run.config.train.model_dump(mode="json")}
    return run.run_stage(gen, "train", inputs, body)


def examples_digest(dataset: Dataset) -> str:
    """Digest of exactly the (prompt, completion) texts the trainer consumed, in order."""
    return digest([[e.prompt, e.completion] for e in dataset.examples])


def log_training(run, gen, champ, selected, dataset, losses, seconds, harness: Harness | None = None) -> str:
    """The generation's MLflow run, one per (lineage, generation, dataset digest[, candidate harness]): found
    again when a crashed run trains again (a complete one is reused as is; one cut short is deleted and logged
    afresh)."""
    import mlflow
    import pandas as pd
    from mlflow.entities import Metric

    tags = {"lineage": run.config.lineage, "generation": str(gen.number), "dataset_digest": selected.digest}
    if harness is not None:  # a harness search trains one migration per candidate on the same set
        tags |= {"candidate_harness": harness.id, "harness_hash": harness.hash}
    found = run.registry.find_run(tags)
    if found is not None and "train_seconds" in found.data.metrics:
        return found.info.run_id
    if found is not None:
        run.registry.client.delete_run(found.info.run_id)
    frame = pd.DataFrame([{"trajectory_id": e.trajectory_id, "level": e.level, "source": e.source,
                           "prompt": e.prompt, "completion": e.completion} for e in dataset.examples])
    name = f"gen-{gen.number:03d}" + (f"-{harness.document.version}" if harness is not None else "")
    with run.registry.start_run(name, tags) as mlrun:
        if dataset.examples:  # none: a candidate harness paired with the champion's adapter as it is
            with warnings.catch_warnings():  # MLflow's hint about integer columns: ours never miss values
                warnings.simplefilter("ignore", UserWarning)
                data = mlflow.data.from_pandas(frame, name=f"{run.config.lineage}-gen{gen.number}-selected",
                                               digest=selected.digest[:36])
                mlflow.log_input(data, context="training")
        mlflow.log_params({f"train.{k}": v for k, v in run.config.train.model_dump().items()}
                          | {"parent_pair_id": champ.pair_id, "dataset_digest": selected.digest,
                             "dataset_size": selected.size})
        now = int(time.time() * 1000)
        metrics = [Metric("train_loss", loss, now, step) for step, loss, _ in losses]
        metrics += [Metric("learning_rate", lr, now, step) for step, _, lr in losses]
        for i in range(0, len(metrics), 900):
            run.registry.client.log_batch(mlrun.info.run_id, metrics=metrics[i:i + 900])
        mlflow.log_metric("train_seconds", seconds)  # last: its presence marks the run complete
        return mlrun.info.run_id


# --------------------------------------------------------------------------------------------------------
# 6. evaluate / gate: candidate vs parent (and the lineage's best records) on the same held-out tasks
# --------------------------------------------------------------------------------------------------------
@task(name="evaluate", task_run_name="evaluate-gen-{number:03d}", cache_policy=NO_CACHE)
def evaluate_gate(config: CycleConfig, number: int, champ: Champion, found: Discovered, trained: Trained) -> Judged:
    run = current_run(config)
    gen = run.generation_row(number)

    def body() -> Judged:
        return judge(run, gen, champ, found, harness, trained.adapter_hash, trained.adapter_dir)

    harness = run.harness_of(champ)
    attempt = run.attempt(champ.pair_id, run.pair(trained.adapter_hash, harness).id, gen.number)
    inputs = {"adapter": trained.adapter_hash, "parent": champ.pair_id, "attempt": attempt,
              "champions": run.champion_pairs()}
    return run.run_stage(gen, "evaluate", inputs, body)


def judge(run: LineageRun, gen: Generation, champ: Champion, found: Discovered, harness: Harness,
          adapter_hash: str | None, adapter_dir: str | None) -> Judged:
    """The candidate pair (adapter, harness) against the champion on the same held-out tasks, level by level,
    by the gate's paired rules, at the candidate's number among those gated against this champion
    (``LineageRun.attempt``). Every level either harness can pose is compared, and a level one harness cannot
    pose counts as unsolved for its pair; the targets are the levels the curriculum aimed at, or, for a
    candidate harness, the levels only it can pose."""
    candidate = run.pair(adapter_hash, harness)
    run.save_pair(candidate, adapter_dir, champ.pair_id)
    attempt = run.attempt(champ.pair_id, candidate.id, gen.number)
    reached = [*found.accuracy, *found.frontier_levels, *found.unposable]
    posed = max(run.max_level(harness), run.max_level(run.harness_of(champ)))
    levels = list(range(1, min(max(reached), posed) + 1))
    parent_scores = run.scores(champ, champ.adapter_dir, levels, gen.id)
    cand_scores = run.scores(candidate, adapter_dir, levels, gen.id)
    best = run.best_scores(levels)
    mastered = {lvl for lvl, sc in best.items() if sc.accuracy >= run.config.curriculum.mastery}
    unlocked = {lvl for lvl in levels if lvl > run.max_level(run.harness_of(champ))}
    decision = decide(parent_scores, cand_scores, targets=unlocked or set(found.frontier_levels), best=best,
                      mastered=mastered, spec=run.config.gate, attempt=attempt)
    return Judged(candidate_pair_id=candidate.id, levels=levels, decision=decision,
                  candidate={k: v.accuracy for k, v in cand_scores.items()},
                  parent={k: v.accuracy for k, v in parent_scores.items()})


# --------------------------------------------------------------------------------------------------------
# 4b. search: candidate harnesses, each paired with the champion's adapter (migrated) and judged
# --------------------------------------------------------------------------------------------------------
def wants_search(spec: HarnessSearchSpec, found: Discovered, number: int, stalled: bool) -> bool:
    """Search when the harness holds progress back: it cannot pose a level the curriculum wants (attributed
    ``not_posable``), and that is the target level itself or the last candidate was rejected (``stalled``:
    the levels it can pose stopped improving). Also every ``spec.every`` generations."""
    held_back = bool(found.unposable) and (not found.plan or stalled)
    return spec.enabled and (held_back or (spec.every > 0 and number % spec.every == 0))


@task(name="search", task_run_name="search-gen-{number:03d}", cache_policy=NO_CACHE, **SERVER_RETRIES)
def search_harness(config: CycleConfig, number: int, champ: Champion, found: Discovered) -> Searched:
    """Proposers' candidates, stored immutably; each paired with the champion's adapter, migrated on the
    lineage's own verified answers re-rendered under it when its format differs, and judged against the
    champion. The candidate the gate promotes (the best, if several) is adopted."""
    from rsi.proposers import propose
    from rsi.store.harnesses import store_proposal

    run = current_run(config)
    gen = run.generation_row(number)
    spec = run.config.harness_search

    def body() -> Searched:
        parent = run.harness_of(champ)
        proposals = propose(parent, spec.proposers, spec.space)
        with run.write() as s:
            harnesses = [store_proposal(s, p.document, p.sources, run.settings.home) for p in proposals]
        migration = store_migration_set(run, gen)
        adapter_hash = run.load_pair(champ.pair_id).adapter_hash
        candidates: list[HarnessCandidate] = []
        for proposal, harness in zip(proposals, harnesses, strict=True):
            log.info("generation %d: candidate harness %s: %s", gen.number, harness.id, proposal.why)
            migrate = changes_format(parent, harness)
            if migrate and not migration.size:
                log.info("generation %d: %s skipped: no verified answers to migrate yet", gen.number, harness.id)
                continue
            if migrate and not run.config.train.steps:
                log.info("generation %d: %s skipped: its format needs a migrated adapter and this lineage trains "
                         "no weights (train.steps 0)", gen.number, harness.id)
                continue
            trained = migrate_to(run, gen, champ, harness, migration) if migrate else \
                keep_adapter(run, gen, champ, harness, adapter_hash)
            judged = judge(run, gen, champ, found, harness, trained.adapter_hash, trained.adapter_dir)
            log.info("generation %d: candidate harness %s %s (p=%.3g): %s", gen.number, harness.id,
                     "beats the champion" if judged.decision.promote else "rejected", judged.decision.p_value,
                     {k: round(v, 3) for k, v in judged.candidate.items()})
            candidates.append(HarnessCandidate(harness_id=harness.id, harness_hash=harness.hash, why=proposal.why,
                                               trained=trained, judged=judged))
        promoted = [i for i, c in enumerate(candidates) if c.judged.decision.promote and c.trained is not None]
        adopted = max(promoted, key=lambda i: sum(candidates[i].judged.candidate.values()), default=None)
        return Searched(parent_harness=parent.id, dataset=migration.digest, size=migration.size,
                        candidates=candidates, adopted=adopted)

    inputs = {"champion": champ.pair_id, "spec": spec.model_dump(mode="json"), "champions": run.champion_pairs()}
    return run.run_stage(gen, "search", inputs, body)


def store_migration_set(run: LineageRun, gen: Generation) -> Selected:
    """The lineage's verified answers (passed under the harness they were produced under), one per task, at
    most ``examples_per_level`` per level: what migration re-renders. Stored like a selection."""
    per_level = run.config.harness_search.examples_per_level
    with run.store.session() as s:
        gen_ids = list(s.scalars(sql_select(Generation.id).where(Generation.lineage == run.config.lineage)))
        rows = s.execute(sql_select(TrajectoryRow.id, TrajectoryRow.task_id, TrajectoryRow.harness_id, TaskRow.level,
                                    VerdictRow.harness_hash)
                         .join(VerdictRow, VerdictRow.trajectory_id == TrajectoryRow.id)
                         .join(TaskRow, TaskRow.id == TrajectoryRow.task_id)
                         .where(TrajectoryRow.generation_id.in_(gen_ids), VerdictRow.passed)
                         .order_by(TaskRow.level, TrajectoryRow.task_id, TrajectoryRow.id)).all()
    chosen, tasks_seen, per = [], set(), Counter()
    for traj_id, task_id, harness_id, level, verdict_hash in rows:
        if verdict_hash != run.harness_of(harness_id).hash or task_id in tasks_seen or per[level] >= per_level:
            continue  # verified under its own contract only; one answer per task
        tasks_seen.add(task_id)
        per[level] += 1
        chosen.append(traj_id)
    dataset_digest = digest({"migration": chosen})
    with run.write() as s:
        if s.get(DatasetRow, dataset_digest) is None:
            s.add(DatasetRow(digest=dataset_digest, lineage=run.config.lineage, generation_id=gen.id, size=len(chosen),
                             filters={"migration": True, "per_level": per_level, "corrupted": False,
                                      "sources": ["frontier"] * len(chosen)}))
            s.flush()
            s.add_all(DatasetItem(dataset_digest=dataset_digest, position=i, trajectory_id=t)
                      for i, t in enumerate(chosen))
    return Selected(digest=dataset_digest, size=len(chosen), corrupted=False, frontier=len(chosen), replay=0)


def keep_adapter(run: LineageRun, gen: Generation, champ: Champion, harness: Harness,
                 adapter_hash: str | None) -> Trained:
    """A candidate whose replies look as under the champion's harness (a plan, a decoding knob): the champion's
    adapter as it is, with an MLflow run of its own that the candidate pair is registered from."""
    unchanged = Dataset(examples=())
    nothing = Selected(digest=digest({"unchanged_adapter": adapter_hash}), size=0, corrupted=False, frontier=0,
                       replay=0)
    run_id = log_training(run, gen, champ, nothing, unchanged, [], 0.0, harness=harness)
    return Trained(adapter_dir=champ.adapter_dir, adapter_hash=adapter_hash, steps=0, first_loss=0.0,
                   final_loss=0.0, examples=0, seconds=0.0, mlflow_run_id=run_id,
                   examples_digest=examples_digest(unchanged), warm_start=champ.adapter_dir)


def migrate_to(run: LineageRun, gen: Generation, champ: Champion, harness: Harness, migration: Selected) -> Trained:
    """The champion's adapter trained on the migration set written under ``harness`` (``rsi.migrate``)."""
    dataset, _ = load_dataset(run, migration.digest, harness)
    out_dir = run.adapters_dir() / f"gen-{gen.number:03d}-{harness.hash[:12]}"
    losses: list[tuple[int, float, float]] = []

    def on_step(step: int, loss: float, lr: float) -> None:
        run.check_lease()
        losses.append((step, loss, lr))

    parent = Path(champ.adapter_dir) if champ.adapter_dir else None
    start = time.perf_counter()
    result = train_adapter(run.base_dir, parent, dataset, run.config.harness_search.migration, out_dir,
                           seed=run.config.seed * 1000 + gen.number, on_step=on_step)
    seconds = time.perf_counter() - start
    run_id = log_training(run, gen, champ, migration, dataset, losses, seconds, harness=harness)
    return Trained(**result.model_dump(), seconds=seconds, mlflow_run_id=run_id,
                   examples_digest=examples_digest(dataset), warm_start=str(parent) if parent else None)


# --------------------------------------------------------------------------------------------------------
# 7. register: a model version with the adapter and the HCP document; the generation's end commits with it
# --------------------------------------------------------------------------------------------------------
@task(name="register", task_run_name="register-gen-{number:03d}", cache_policy=NO_CACHE, **SERVER_RETRIES)
def register(config: CycleConfig, number: int, champ: Champion, selected: Selected, trained: Trained,
             judged: Judged, searched: Searched | None = None) -> Registered:
    """MLflow writes first, each idempotent (the version is found again by its pair id); then one state-DB
    transaction stores the result and finishes the generation; then the aliases follow the committed state.
    A crash anywhere before the commit redoes the same writes; after it, ``sync_aliases`` repairs the aliases.
    After a harness search, the candidates not taken are registered too (rejected, with their evidence)."""
    run = current_run(config)
    gen = run.generation_row(number)
    promote = judged.decision.promote

    def body() -> Registered:
        others = {}
        for c in (searched.candidates if searched else ()):
            if c.trained is not None and c.judged.candidate_pair_id != judged.candidate_pair_id:
                others[c.judged.candidate_pair_id] = register_pair(run, gen, champ, searched.dataset, c.trained,
                                                                   c.judged, why=c.why, adopted=False)[0]
        version, model_uri = register_pair(run, gen, champ, selected.digest, trained, judged,
                                           why=next((c.why for c in searched.candidates if c.judged == judged), "")
                                           if searched else "")
        decision = judged.decision
        run.registry.log_generation(gen.number, {f"acc_level_{level}": acc for level, acc in judged.candidate.items()}
                                    | {"gate_p_value": decision.p_value, "gate_wins": decision.wins,
                                       "gate_losses": decision.losses, "promoted": float(promote)})
        gate = "promoted" if promote else "rejected"
        log_improvement_plot(run, trained.mlflow_run_id, extra=(gen.number, gate, judged))
        return Registered(version=version, promoted=promote, model_uri=model_uri, others=others)

    def finish(s, result: Registered) -> None:
        row = s.get(Generation, gen.id)
        row.parent_pair_id, row.candidate_pair_id = champ.pair_id, judged.candidate_pair_id
        row.status, row.finished_at = ("promoted" if promote else "rejected"), utcnow()

    inputs = {"evaluate": judged.candidate_pair_id, "gate": judged.decision.model_dump(mode="json"),
              "search": searched.model_dump(mode="json") if searched else None}
    result = run.run_stage(gen, "register", inputs, body, finish=finish)
    sync_aliases(run)
    return result


def decompose(run: LineageRun, gen: Generation, champ: Champion, trained: Trained, judged: Judged) -> Decomposition:
    """The candidate's gain over the champion split into its weights', its harness's and their interaction, with
    the base under the candidate's harness as the no-training reference (``rsi.decomposition``): the five pairs
    on the held-out tasks the gate judged and on the test split's, each level. Stored as a ``decompose`` result,
    so asking again costs nothing; scores are cached per pair, so a pair scored before is not scored again."""
    candidate, parent = run.load_pair(judged.candidate_pair_id), run.load_pair(champ.pair_id)
    harness, parent_harness = run.harness_of(candidate), run.harness_of(champ)
    arms = {"parent": (parent, champ.adapter_dir), "candidate": (candidate, trained.adapter_dir),
            "adapter_only": (run.pair(candidate.adapter_hash, parent_harness), trained.adapter_dir),
            "harness_only": (run.pair(parent.adapter_hash, harness), champ.adapter_dir),
            "base": (run.pair(None, harness), None)}

    def body() -> Decomposition:
        for pair, adapter_dir in arms.values():
            run.save_pair(pair, adapter_dir, None)  # a no-op for the parent and the candidate
        splits = {}
        for split in ("heldout", "test"):
            scored = {name: run.scores(pair, adapter_dir, list(judged.levels), gen.id, split)
                      for name, (pair, adapter_dir) in arms.items()}
            clean = clean_tasks(run, harness, judged.levels) if split == "test" and harness.document.plan else None
            splits[split] = decompose_levels(scored["parent"], scored["adapter_only"], scored["harness_only"],
                                             scored["candidate"], scored["base"], clean)
        return Decomposition(parent_pair_id=champ.pair_id, candidate_pair_id=candidate.id,
                             parent_harness=parent_harness.id, harness=harness.id, splits=splits)

    return run.run_stage(gen, "decompose", {"parent": champ.pair_id, "candidate": candidate.id}, body)


def clean_tasks(run: LineageRun, harness: Harness, levels: Sequence[int]) -> dict[int, list[bool]]:
    """Per level, per test task in evaluation order: whether none of the calls the harness's plan makes for it
    lies in the train split (a task the harness cannot pose makes no call)."""
    tasks, _ = evaluation_tasks(harness, run.family, levels, run.config.eval_n, lineage_seed=run.config.seed, k=1,
                                split="test")
    out: dict[int, list[bool]] = defaultdict(list)
    for task in tasks:
        calls = calls_with_gold(harness, run.family, task)[0] if poses(harness, run.family, task) else []
        out[task.level].append(all(call.split != "train" for call in calls))
    return dict(out)


def log_decomposition(run: LineageRun, run_id: str, decomposition: Decomposition) -> None:
    """Its metrics on the version's run, a table per split (browsable in the MLflow UI) and the whole of it."""
    from mlflow.entities import Metric

    client, now = run.registry.client, int(time.time() * 1000)
    metrics = [Metric(name, value, now, 0) for name, value in gain_metrics(decomposition).items()]
    for at in range(0, len(metrics), 1000):  # one write per batch, not one per metric (MLflow takes <= 1000)
        client.log_batch(run_id, metrics=metrics[at:at + 1000])
    for split in decomposition.splits:
        table = gain_rows(decomposition, split)
        client.log_table(run_id, {key: [row.get(key) for row in table] for key in table[0]} if table else {},
                         f"decomposition-{split}.json")
    client.log_dict(run_id, decomposition.model_dump(mode="json"), "decomposition.json")


def register_pair(run: LineageRun, gen: Generation, champ: Champion, dataset_digest: str, trained: Trained,
                  judged: Judged, why: str = "", adopted: bool = True) -> tuple[str, str]:
    """One candidate pair as an MLflow model version (adapter + harness, base referenced) with the lineage's
    tags and its evidence; returns (version, model URI). ``why``: a candidate harness's reason to exist;
    ``adopted`` False: a searched candidate not taken (rejected, or passed the gate while another won)."""
    from rsi.mlmodel import log_base, log_candidate

    run_id, client = trained.mlflow_run_id, run.registry.client
    harness = run.harness_of(run.load_pair(judged.candidate_pair_id))  # a successor may carry another one
    if trained.adapter_dir is not None:  # None: the candidate pairs the base itself with its harness
        client.log_artifacts(run_id, trained.adapter_dir, "candidate/adapter")  # browsable beside the model
    client.log_artifacts(run_id, str(harness.folder), "candidate/harness")
    for level, acc in judged.candidate.items():
        client.log_metric(run_id, f"acc_level_{level}", acc)
    base_uri = log_base(run.registry, run.base_dir, run.base_hash)  # once per base, then referenced
    model_uri = log_candidate(run.registry, run_id, base_uri, trained.adapter_dir, harness.folder,
                              pair_id=judged.candidate_pair_id, base_hash=run.base_hash)
    promote = judged.decision.promote and adopted
    tags = {"generation": gen.number, "parent_version": champ.version, "pair_id": judged.candidate_pair_id,
            "harness_id": harness.id, "harness_hash": harness.hash, "parent_harness_hash": champ.harness_hash,
            "contract_version": harness.contract_version, "base_model_hash": run.base_hash,
            "dataset_digest": dataset_digest, "gate": "promoted" if promote else "rejected",
            "adapter_hash": trained.adapter_hash, "gate_p_value": f"{judged.decision.p_value:.4g}",
            "gate_reasons": "; ".join(judged.decision.reasons)[:4000]}
    if why:
        tags["harness_candidate"] = why
    if judged.decision.promote and not adopted:
        tags["gate_note"] = "passed the gate; another candidate of the search scored higher and was adopted"
    tags |= {f"acc_level_{level}": f"{acc:.4f}" for level, acc in judged.candidate.items()}
    decomposition = decompose(run, gen, champ, trained, judged)
    log_decomposition(run, run_id, decomposition)
    if (over := over_no_training(decomposition)) is not None:
        tags["test_over_no_training"] = f"{over:+.4f}"
    return run.registry.create_version(run_id, model_uri, tags), model_uri


def sync_aliases(run: LineageRun) -> None:
    """Point ``challenger`` at the latest finished generation's version and ``champion`` at the latest promoted
    one, as the state DB records them (idempotent; run after every register and when a lineage run starts)."""
    latest = champion = None
    for g in run.finished_generations():
        version = run.stage_result(g, "register").version
        latest = version
        champion = version if g.status == "promoted" else champion
    run.registry.set_aliases(challenger=latest, champion=champion)


def lineage_rows(run: LineageRun) -> list[dict[str, Any]]:
    """One row per finished generation: gate decision and candidate accuracy per level."""
    rows = []
    for g in run.finished_generations():
        judged, registered = run.stage_result(g, "evaluate"), run.stage_result(g, "register")
        rows.append({"generation": g.number, "gate": g.status, "version": registered.version,
                     "accuracy": dict(judged.candidate), "parent": dict(judged.parent)})
    return rows


def log_improvement_plot(run: LineageRun, run_id: str, extra: tuple[int, str, dict[str, Any]]) -> None:
    """The lineage's accuracy per level per generation, this (not yet committed) generation included."""
    from rsi.lineage import plot_improvement

    number, gate, judged = extra
    rows = [r for r in lineage_rows(run) if r["generation"] != number]
    rows.append({"generation": number, "gate": gate, "accuracy": dict(judged.candidate)})
    with tempfile.TemporaryDirectory() as tmp:
        path = plot_improvement(rows, Path(tmp) / "improvement.png")
        run.registry.client.log_artifact(run_id, str(path))


# --------------------------------------------------------------------------------------------------------
# The flows
# --------------------------------------------------------------------------------------------------------
def cycle_run_name() -> str:
    """``<lineage>-gen-<NNN>``: the generation's flow run, findable by name in the UI and the API."""
    params = current_flow_run.parameters
    config = CycleConfig.model_validate(params["config"])
    return f"{config.lineage}-gen-{int(params['number']):03d}"


@flow(name="rsi-cycle", flow_run_name=cycle_run_name, log_prints=False)
def rsi_cycle(config: CycleConfig, number: int) -> dict[str, Any]:
    """One generation, stage by stage; returns its summary (also published as Prefect artifacts)."""
    progress = create_progress_artifact(0.0, description=f"{config.lineage} generation {number}")
    summary = generation(config, number, on_stage=lambda i, _: update_progress_artifact(progress, 100.0 * i / 7))
    if "gate" in summary:
        publish(current_run(config), summary)
    return summary


def generation(config: CycleConfig, number: int, *, direct: bool = False,
               on_stage: Callable[[int, str], Any] = lambda i, name: None) -> dict[str, Any]:
    """The stages of one generation in order, in the process that opened the lineage run. ``direct`` calls
    the stage functions without Prefect (``bench/cycle.py`` measures the orchestration overhead that way)."""
    def call(stage, *args):
        log.info("generation %d: %s ...", number, stage.name)
        started = time.perf_counter()
        result = stage.fn(config, number, *args) if direct else stage(config, number, *args)
        seconds[stage.name] = time.perf_counter() - started
        on_stage(len(seconds), stage.name)
        return result

    run = current_run(config)
    seconds: dict[str, float] = {}
    run.check_lease()
    fault_point(number, "start")
    run.generation_row(number)
    champ = run.champion_before(number)
    log.info("generation %d: champion %s (%s)", number, champ.version, champ.pair_id)
    found = call(discover, champ)
    stalled = rejections_in_a_row(run) > 0
    trains = config.train.steps > 0  # a lineage that trains no weights improves its harness alone: it searches
    search = wants_search(config.harness_search, found, number, stalled) or (not trains and config.harness_search.enabled)
    searched = call(search_harness, champ, found) if search else None
    if searched is not None and (searched.adopted is not None or not found.plan or not trains):
        return harness_generation(run, number, champ, found, searched, call) | {"seconds": seconds}
    if not found.plan:
        return {"generation": number, "stopped": "curriculum exhausted", "seconds": seconds}
    if not trains:
        return {"generation": number, "stopped": "train.steps is 0 and harness search is off: nothing to change",
                "seconds": seconds}
    executed = call(execute, champ, found)
    audited = call(audit_stage, champ, found, executed)
    selected = call(select_stage, champ, found, executed, audited)
    if selected.size == 0:
        return {"generation": number, "seconds": seconds, "stopped": (
            f"nothing to train on: none of the {audited.audited} trajectories at levels "
            f"{', '.join(str(p.level) for p in found.plan)} passed the audit (failed rules: {audited.failed_by_rule}); "
            "the champion solves none of the tasks the curriculum chose: a base that never learned this family or "
            "harness? (`rsi lineage show` and the audit's rules say more)")}
    trained = call(train, champ, selected)
    judged = call(evaluate_gate, champ, found, trained)
    registered = call(register, champ, selected, trained, judged, searched)
    summary = summarize(number, found, executed, audited, selected, trained, judged, registered) | {
        "seconds": seconds, "gains": gains(run, number, judged)}
    if searched is not None:
        summary["harness_candidates"] = tried_harnesses(searched)
    log.info("generation %d: %s (p=%.3g); accuracy %s", number, summary["gate"], summary["p_value"],
             summary["candidate"])
    return summary


def harness_generation(run: LineageRun, number: int, champ: Champion, found: Discovered, searched: Searched,
                       call: Callable[..., Any]) -> dict[str, Any]:
    """A generation whose candidate is a harness search's: the adopted pair (migrated adapter + new harness),
    or, when none beat the champion, the best rejected one, so the lineage records what was tried."""
    gen = run.generation_row(number)
    tried = [c for c in searched.candidates if c.trained is not None]
    if not tried:
        return {"generation": number, "stopped": "curriculum exhausted and no candidate harness to try"}
    chosen = searched.candidates[searched.adopted] if searched.adopted is not None else \
        max(tried, key=lambda c: sum(c.judged.candidate.values()))
    inputs = {"search": chosen.judged.candidate_pair_id}
    trained = run.run_stage(gen, "train", inputs, lambda: chosen.trained)
    judged = run.run_stage(gen, "evaluate", inputs, lambda: chosen.judged)
    migration = Selected(digest=searched.dataset, size=searched.size, corrupted=False, frontier=searched.size, replay=0)
    registered = call(register, champ, migration, trained, judged, searched)
    outcome = "adopted" if judged.decision.promote else "no candidate beat the champion"
    log.info("generation %d: harness search: %s %s", number, outcome, chosen.harness_id)
    summary = {"generation": number, "gate": "promoted" if judged.decision.promote else "rejected",
               "p_value": judged.decision.p_value, "reasons": list(judged.decision.reasons),
               "version": registered.version, "targets": [str(lvl) for lvl in sorted(found.unposable)],
               "tasks": 0, "trajectories": 0, "passed": 0, "selected": searched.size, "pass_at": {},
               "candidate": {str(k): round(v, 3) for k, v in judged.candidate.items()},
               "parent": {str(k): round(v, 3) for k, v in judged.parent.items()},
               "train_seconds": trained.seconds, "harness": chosen.harness_id,
               "harness_candidates": tried_harnesses(searched), "gains": gains(run, number, judged)}
    if not judged.decision.promote and not found.plan:
        summary["stopped"] = "the harness cannot pose the next level and no candidate harness beat the champion"
    return summary


def gains(run: LineageRun, number: int, judged: Judged) -> dict[str, Any]:
    """The registered candidate's gain decomposition (stored when it was registered), rows per split."""
    decomposition = next(d for d in run.stage_results(run.generation_row(number), "decompose")
                         if d.candidate_pair_id == judged.candidate_pair_id)
    return {split: gain_rows(decomposition, split) for split in decomposition.splits}


def tried_harnesses(searched: Searched) -> list[dict[str, Any]]:
    return [{"harness": c.harness_id, "gate": "promoted" if c.judged.decision.promote else "rejected",
             "p_value": c.judged.decision.p_value} for c in searched.candidates]


def summarize(number: int, found: Discovered, executed: Executed, audited: Audited, selected: Selected,
              trained: Trained, judged: Judged, registered: Registered) -> dict[str, Any]:
    targets = [str(lvl) for lvl in found.frontier_levels]
    return {
        "generation": number, "gate": "promoted" if judged.decision.promote else "rejected",
        "p_value": judged.decision.p_value, "reasons": list(judged.decision.reasons),
        "version": registered.version, "targets": targets,
        "tasks": executed.tasks, "trajectories": executed.trajectories,
        "passed": audited.passed, "selected": selected.size,
        "pass_at": {lvl: audited.pass_rates.get(int(lvl)) for lvl in targets},
        "candidate": {str(k): round(v, 3) for k, v in judged.candidate.items()},
        "parent": {str(k): round(v, 3) for k, v in judged.parent.items()},
        "train_seconds": trained.seconds,
    }


def publish(run: LineageRun, summary: dict[str, Any]) -> None:
    """Prefect artifacts: the generation's table, a markdown summary and a link to its MLflow version."""
    key = f"{run.config.lineage}-gen-{summary['generation']}".replace("_", "-").replace(".", "-").lower()
    table = [{"level": int(lvl), "parent": summary["parent"][lvl], "candidate": summary["candidate"][lvl]}
             for lvl in summary["candidate"]]
    table.append({"level": "gate", "parent": summary["gate"], "candidate": f"p={summary['p_value']:.3g}"})
    table.append({"level": "counts", "parent": f"tasks {summary['tasks']}, trajectories {summary['trajectories']}",
                  "candidate": f"passed {summary['passed']}, selected {summary['selected']}"})
    create_table_artifact(table, key=key, description=f"generation {summary['generation']}: accuracy per level")
    if summary.get("gains", {}).get("test"):
        create_table_artifact(summary["gains"]["test"], key=f"{key}-gains", description=(
            f"generation {summary['generation']}: the candidate's gain over its parent on the test split, split into "
            "weights (new adapter, old harness), harness (old adapter, new harness) and their interaction, beside "
            "the base under the candidate's harness (no training anywhere); 95 % intervals"))
    with run.store.session() as s:
        blame = load_attribution(s, run.generation_row(summary["generation"]).id)
    if blame:
        create_table_artifact(attribution_table(blame), key=f"{key}-attribution",
                              description=f"generation {summary['generation']}: failed and unposed tasks by cause "
                                          "and owner (model, harness, task)")
    pass_at = ", ".join(f"level {lvl}: pass@1 {v['pass@1']:.2f} pass@k {v['pass@k']:.2f}"
                        for lvl, v in summary["pass_at"].items() if v)
    create_markdown_artifact(
        f"## {run.config.lineage} generation {summary['generation']}: **{summary['gate']}**\n\n"
        f"- targets: levels {', '.join(summary['targets'])} ({pass_at})\n"
        f"- tasks {summary['tasks']}, trajectories {summary['trajectories']}, passed audit {summary['passed']}, "
        f"selected {summary['selected']}\n- gate: {'; '.join(summary['reasons'])}\n"
        f"- MLflow version {summary['version']}\n", key=f"{key}-summary")
    episode = example_episode(run, run.generation_row(summary["generation"]).id)
    if episode:
        create_markdown_artifact(episode, key=f"{key}-episode",
                                 description=f"generation {summary['generation']}: one passed episode, turn by turn")
    create_link_artifact(version_url(run, summary["version"]), key=f"{key}-version",
                         link_text=f"{run.registry.name} version {summary['version']} ({summary['gate']})",
                         description="the candidate's model version in the MLflow registry")


def example_episode(run: LineageRun, generation_id: int) -> str:
    """Markdown of the generation's longest passed trajectory (most completion tokens): its messages in order,
    each tool call with its result and the state hash after it ('' when nothing passed)."""
    with run.store.session() as s:
        row = s.scalars(sql_select(TrajectoryRow).join(VerdictRow, VerdictRow.trajectory_id == TrajectoryRow.id)
                        .where(TrajectoryRow.generation_id == generation_id, VerdictRow.passed)
                        .order_by(TrajectoryRow.completion_tokens.desc(), TrajectoryRow.id).limit(1)).first()
        if row is None:
            return ""
        trajectory = trajectory_from_row(row)
    records = {r.call_id: r for r in trajectory.tool_log}
    cell = lambda text: "`" + text.replace("|", "\\|").replace("`", "'").replace("\n", " ") + "`"  # noqa: E731
    lines = [f"### {trajectory.id} (task {trajectory.task_id}, sample {trajectory.sample_index})", "",
             "| # | role | content | tool call | state after |", "|---|---|---|---|---|"]
    for i, m in enumerate(trajectory.messages):
        call = "; ".join(f"{c.name}({c.arguments})" for c in m.tool_calls)
        state = records[m.tool_call_id].state_after if m.tool_call_id in records else ""
        lines.append(f"| {i} | {m.role} | {cell(m.content)} | {call} | {state} |")
    return "\n".join(lines) + "\n"


def version_url(run: LineageRun, version: str) -> str:
    """The version's page in the MLflow UI when tracking is a server, else its ``models:/`` URI."""
    uri, name = run.registry.uri, run.registry.name
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/#/models/{name}/versions/{version}"
    return f"models:/{name}/{version}"


def lineage_run_name() -> str:
    params = current_flow_run.parameters
    return f"{params.get('lineage') or params.get('family')}-lineage"


@flow(name="rsi-lineage", flow_run_name=lineage_run_name, log_prints=False)
def rsi_lineage(family: str = "addition", lineage: str | None = None, harness: str | None = None,
                profile: str | None = "demo", generations: int | None = None,
                overrides: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Generations of one lineage until its target level is mastered, a plateau of rejections, or the budget
    is spent. Parameters are JSON (a deployment schedules it): ``overrides`` are CycleConfig fields over the
    profile's. Takes the lineage's lease (a second run fails naming the holder) and keeps it alive."""
    fields = {"family": family, "lineage": lineage or family, "harness": harness or latest_harness(family)}
    config = load_config(profile, **{**(overrides or {}), **fields})
    with open_run(config, get_settings()) as run, holding_lease(run):
        sync_aliases(run)  # a crash between a generation's commit and its alias move is repaired here
        return generations_until_done(run, generations)


def generations_until_done(run: LineageRun, generations: int | None) -> list[dict[str, Any]]:
    config = run.config
    summaries: list[dict[str, Any]] = []
    done = run.finished_generations()
    start = (done[-1].number + 1) if done else 1
    for number in range(start, start + (generations or config.generations)):
        summary = rsi_cycle(config, number)
        summaries.append(summary)
        if summary.get("stopped"):
            log.info("stopping: %s", summary["stopped"])
            break
        rejected_in_row = rejections_in_a_row(run)
        if mastered_up_to(run) >= config.target_level:
            log.info("stopping: every level up to %d mastered", config.target_level)
            break
        if rejected_in_row >= config.plateau:
            log.info("stopping: %d candidates rejected in a row (plateau)", rejected_in_row)
            break
    return summaries


def rejections_in_a_row(run: LineageRun) -> int:
    """The plateau counter, from the stored generations (so it survives restarts)."""
    count = 0
    for g in reversed(run.finished_generations()):
        if g.status == "promoted":
            break
        count += 1
    return count


def mastered_up_to(run: LineageRun) -> int:
    """Every level up to this one is mastered by the champion: its held-out scores as stored, whether its gate
    or a later discovery measured them (a harness that poses longer tasks is measured there)."""
    promoted = [g for g in run.finished_generations() if g.status == "promoted"]
    if not promoted:
        return max(run.base_levels)
    pair_id = promoted[-1].candidate_pair_id
    levels = list(range(1, run.config.curriculum.max_level + 1))
    stored = run.stored_scores([pair_id], levels, "heldout").get(pair_id, {})
    return frontier({lvl: sc.accuracy for lvl, sc in stored.items()}, run.config.curriculum.mastery)


def flow_parameters(config: CycleConfig) -> dict[str, Any]:
    """``rsi-lineage``'s parameters for a config: the named fields, and the rest as overrides of no profile
    (the whole config, so the flow rebuilds exactly this one)."""
    rest = config.model_dump(mode="json", exclude={"family", "lineage", "harness"})
    return {"family": config.family, "lineage": config.lineage, "harness": config.harness, "profile": None,
            "overrides": rest}


class _Events(logging.Handler):
    """rsi's log lines, handed to a callback (the CLI's live display, a test's list)."""

    def __init__(self, events: Events):
        super().__init__(logging.INFO)
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        self.events(record.getMessage())


@contextmanager
def forwarding(events: Events) -> Iterator[None]:
    """rsi's log lines go to ``events`` (and to the Prefect run), not also to Prefect's console format."""
    handler, propagate = _Events(events), _rsi_log.propagate
    _rsi_log.addHandler(handler)
    _rsi_log.propagate = False
    try:
        yield
    finally:
        _rsi_log.removeHandler(handler)
        _rsi_log.propagate = propagate


def run_lineage(config: CycleConfig, generations: int | None = None, events: Events = _quiet) -> list[dict[str, Any]]:
    """Run the lineage flow in this process. The run is opened and its lease taken before Prefect starts, so
    a bad harness or a lineage held by another run fails at once with a clear message (exit 2)."""
    with open_run(config, get_settings()) as run, holding_lease(run), forwarding(events):
        return rsi_lineage(**flow_parameters(config), generations=generations)
