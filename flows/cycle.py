"""The RSI cycle as Prefect flows, stage by stage in the order it runs.

``rsi-cycle`` runs one generation: discover -> execute -> audit -> select -> train -> evaluate/gate ->
register. ``rsi-lineage`` runs generations until the target level is mastered, the candidates plateau,
or the generation budget is spent. Each stage's result is persisted in the state DB under (lineage,
generation, stage, inputs hash), so a run started again after a crash skips what already finished and
ends with the same lineage it would have produced uninterrupted.
"""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rsi.config import get_settings

get_settings().configure_prefect()  # a configured server or profile, else the ephemeral API in RSI_HOME
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry; it also locks SQLite
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# PEFT 0.21 calls an attribute transformers 5 renamed; harmless, and it would print once per adapter load.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

from prefect import flow, task  # noqa: E402
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact  # noqa: E402
from prefect.artifacts import update_progress_artifact  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402
from sqlalchemy import select as sql_select  # noqa: E402

from rsi.audit import audit, prompt_text  # noqa: E402
from rsi.curriculum import frontier, plan_levels  # noqa: E402
from rsi.cycle import Champion, CycleConfig, LineageRun, fault_point, keep_alive  # noqa: E402
from rsi.execute import rollout, sampling_params  # noqa: E402
from rsi.gate import decide  # noqa: E402
from rsi.hashing import digest  # noqa: E402
from rsi.models import Task, Trajectory  # noqa: E402
from rsi.select import Candidate, Dataset, Example, select  # noqa: E402
from rsi.splits import stream_seed  # noqa: E402
from rsi.store.records import put_tasks, put_trajectories, put_verdicts, task_from_row, trajectory_from_row  # noqa: E402
from rsi.store.schema import DatasetItem, DatasetRow, Generation, TaskRow, TrajectoryRow, VerdictRow, utcnow  # noqa: E402
from rsi.train import train_adapter  # noqa: E402

STAGES = ("discover", "execute", "audit", "select", "train", "evaluate", "register")
Events = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


# --------------------------------------------------------------------------------------------------------
# 1. discover: levels from the champion's held-out accuracy, tasks from this generation's train stream
# --------------------------------------------------------------------------------------------------------
@task(name="discover", cache_policy=NO_CACHE)
def discover(run: LineageRun, gen: Generation, champ: Champion, events: Events) -> dict[str, Any]:
    def body() -> dict[str, Any]:
        accuracy = champion_accuracy(run, champ, gen)
        plan = plan_levels(accuracy, run.curriculum)
        mastered = frontier(accuracy, run.config.curriculum.mastery)
        seed = stream_seed("rollout", run.config.seed, gen.number)
        tasks = [t for p in plan for t in run.family.tasks("train", seed, p.level, p.n_tasks)]
        replay_seed = stream_seed("replay", run.config.seed, gen.number)
        replay_levels = range(1, mastered + 1) if plan else range(0)
        tasks += [t for lvl in replay_levels
                  for t in run.family.tasks("train", replay_seed, lvl, run.config.replay_tasks_per_level)]
        with run.write() as s:
            put_tasks(s, tasks)
        return {"accuracy": {str(k): v for k, v in accuracy.items()}, "frontier": mastered,
                "plan": [p.model_dump() for p in plan], "task_ids": [t.id for t in tasks],
                "frontier_levels": [p.level for p in plan], "replay_levels": list(replay_levels)}

    return run.run_stage(gen, "discover", {"champion": champ.pair_id}, body, events)


def champion_accuracy(run: LineageRun, champ: Champion, gen: Generation) -> dict[int, float]:
    """Held-out greedy accuracy of the champion, from level 1 up to where it stops being admissible."""
    top = max(run.recipe.train_levels) + run.config.eval_headroom
    ceiling = run.max_level
    scores = run.scores(champ.pair_id, champ.adapter_dir, list(range(1, min(top, ceiling) + 1)), gen.id)
    while top < ceiling and scores[top].accuracy >= run.config.curriculum.admit:
        top += 1
        scores |= run.scores(champ.pair_id, champ.adapter_dir, [top], gen.id)
    return {lvl: sc.accuracy for lvl, sc in scores.items()}


# --------------------------------------------------------------------------------------------------------
# 2. execute: k samples per task (the harness's decoding.samples) under the champion pair; all stored
# --------------------------------------------------------------------------------------------------------
@task(name="execute", cache_policy=NO_CACHE)
def execute(run: LineageRun, gen: Generation, champ: Champion, found: dict[str, Any], events: Events) -> dict[str, Any]:
    def body() -> dict[str, Any]:
        with run.store.session() as s:
            rows = {r.id: r for r in s.scalars(sql_select(TaskRow).where(TaskRow.id.in_(found["task_ids"])))}
        tasks = [task_from_row(rows[i]) for i in found["task_ids"]]
        params = sampling_params(run.harness, seed=stream_seed("rollout", run.config.seed, gen.number))
        start = time.perf_counter()
        trajectories = rollout(tasks, run.harness, run.backend, champ.pair_id, params, adapter=champ.adapter_dir)
        with run.write() as s:
            put_trajectories(s, trajectories, generation_id=gen.id)
        return {"trajectories": len(trajectories), "tasks": len(tasks), "seconds": time.perf_counter() - start,
                "ids": [t.id for t in trajectories]}

    return run.run_stage(gen, "execute", {"tasks": found["task_ids"], "champion": champ.pair_id}, body, events)


# --------------------------------------------------------------------------------------------------------
# 3. audit: the external auditor judges every stored trajectory under the harness's contract
# --------------------------------------------------------------------------------------------------------
@task(name="audit", cache_policy=NO_CACHE)
def audit_stage(run: LineageRun, gen: Generation, champ: Champion, executed: dict[str, Any], events: Events) -> dict[str, Any]:
    def body() -> dict[str, Any]:
        trajectories, tasks = load_trajectories(run, executed["ids"])
        pair = run.load_pair(champ.pair_id)
        verdicts = [audit(t, tasks[t.task_id], run.harness, run.family, pair) for t in trajectories]
        with run.write() as s:
            put_verdicts(s, verdicts)
        failures = Counter(rule for v in verdicts for rule in v.failed_rules())
        return {"audited": len(verdicts), "passed": sum(v.passed for v in verdicts), "failed_by_rule": dict(failures),
                "pass_rates": pass_rates(trajectories, tasks, {v.trajectory_id: v.passed for v in verdicts})}

    return run.run_stage(gen, "audit", {"trajectories": executed["ids"], "contract": run.harness.hash}, body, events)


def load_trajectories(run: LineageRun, ids: list[str]) -> tuple[list[Trajectory], dict[str, Task]]:
    """Stored trajectories in the order of ``ids``, and their tasks by id."""
    with run.store.session() as s:
        rows = list(s.scalars(sql_select(TrajectoryRow).where(TrajectoryRow.id.in_(ids))))
        task_ids = {r.task_id for r in rows}
        tasks = {r.id: task_from_row(r) for r in s.scalars(sql_select(TaskRow).where(TaskRow.id.in_(task_ids)))}
    order = {tid: i for i, tid in enumerate(ids)}
    return sorted((trajectory_from_row(r) for r in rows), key=lambda t: order[t.id]), tasks


def pass_rates(trajectories, tasks, passed: dict[str, bool]) -> dict[str, dict[str, float]]:
    """Per level: pass@1 (mean over samples) and pass@k (share of tasks with at least one pass)."""
    by_task: dict[str, list[bool]] = defaultdict(list)
    for t in trajectories:
        by_task[t.task_id].append(passed[t.id])
    by_level: dict[int, list[list[bool]]] = defaultdict(list)
    for task_id, outcomes in by_task.items():
        by_level[tasks[task_id].level].append(outcomes)
    return {str(lvl): {"pass@1": sum(map(sum, rows)) / sum(map(len, rows)),
                       "pass@k": sum(any(r) for r in rows) / len(rows), "tasks": len(rows)}
            for lvl, rows in sorted(by_level.items())}


# --------------------------------------------------------------------------------------------------------
# 4. select: passed trajectories only, filtered, plus replay of earlier generations' selections
# --------------------------------------------------------------------------------------------------------
@task(name="select", cache_policy=NO_CACHE)
def select_stage(run: LineageRun, gen: Generation, found: dict[str, Any], executed: dict[str, Any],
                 audited: dict[str, Any], events: Events) -> dict[str, Any]:
    def body() -> dict[str, Any]:
        trajectories, tasks = load_trajectories(run, executed["ids"])
        with run.store.session() as s:
            passed = set(s.scalars(sql_select(VerdictRow.trajectory_id).where(
                VerdictRow.trajectory_id.in_(executed["ids"]), VerdictRow.passed,
                VerdictRow.harness_hash == run.harness.hash)))
        candidates = [Candidate(trajectory_id=t.id, task_id=t.task_id, level=tasks[t.task_id].level,
                                prompt=prompt_text(t), completion=t.completion, passed=t.id in passed)
                      for t in trajectories]
        dataset = select(candidates, replay_examples(run, gen), run.config.selection,
                         frontier_levels=set(found["frontier_levels"]), seed=run.config.seed + gen.number)
        corrupted = run.config.corrupt_training_data
        dataset = dataset.model_copy(update={"corrupted": corrupted})  # its own digest: never mistaken for clean
        with run.write() as s:
            if s.get(DatasetRow, dataset.digest) is None:
                s.add(DatasetRow(digest=dataset.digest, lineage=run.config.lineage, generation_id=gen.id,
                                 size=len(dataset.examples),
                                 filters={**run.config.selection.model_dump(mode="json"), "corrupted": corrupted,
                                          "sources": [e.source for e in dataset.examples]}))
                s.flush()
                s.add_all(DatasetItem(dataset_digest=dataset.digest, position=i, trajectory_id=e.trajectory_id)
                          for i, e in enumerate(dataset.examples))
        return {"digest": dataset.digest, "size": len(dataset.examples), "corrupted": corrupted,
                "frontier": len(dataset.pool("frontier")), "replay": len(dataset.pool("replay"))}

    return run.run_stage(gen, "select", {"audit": audited, "trajectories": executed["ids"]}, body, events)


def load_dataset(run: LineageRun, dataset_digest: str) -> tuple[Dataset, bool]:
    """A stored selection as training examples, read from the stored trajectories (prompt and completion
    exactly as sampled), and whether the test switch marked it corrupted."""
    with run.store.session() as s:
        row = s.get(DatasetRow, dataset_digest)
        items = list(s.scalars(sql_select(DatasetItem).where(DatasetItem.dataset_digest == dataset_digest)
                               .order_by(DatasetItem.position)))
        sources, corrupted = row.filters["sources"], bool(row.filters.get("corrupted"))
    trajectories, tasks = load_trajectories(run, [i.trajectory_id for i in items])
    examples = tuple(Example(trajectory_id=t.id, level=tasks[t.task_id].level, prompt=prompt_text(t),
                             completion=t.completion, source=source)
                     for t, source in zip(trajectories, sources, strict=True))
    return Dataset(examples=examples, corrupted=corrupted), corrupted


def replay_examples(run: LineageRun, gen: Generation) -> list[Example]:
    """Selected examples of the last few earlier generations (verified samples, never labels)."""
    earlier = [g for g in run.finished_generations() if g.number < gen.number][-run.config.selection.replay_generations:]
    examples: list[Example] = []
    for g in earlier:
        result = run.stage_result(g.id, "select") or {}
        if result and not result.get("corrupted"):  # the test switch's shuffled answers must never be replayed
            examples += load_dataset(run, result["digest"])[0].examples
    return examples


def corrupt(dataset: Dataset, seed: int) -> Dataset:
    """TEST SWITCH: shuffle the answers among the examples, so the data no longer matches its prompts."""
    rng = random.Random(seed)
    answers = [e.completion for e in dataset.examples]
    rng.shuffle(answers)
    return dataset.model_copy(update={"examples": tuple(e.model_copy(update={"completion": a})
                                                        for e, a in zip(dataset.examples, answers))})


# --------------------------------------------------------------------------------------------------------
# 5. train: a LoRA adapter warm-started from the champion's, on the stored selection; metrics to MLflow
# --------------------------------------------------------------------------------------------------------
@task(name="train", cache_policy=NO_CACHE)
def train(run: LineageRun, gen: Generation, champ: Champion, selected: dict[str, Any], events: Events) -> dict[str, Any]:
    def body() -> dict[str, Any]:
        dataset, corrupted = load_dataset(run, selected["digest"])
        if corrupted:
            dataset = corrupt(dataset, seed=gen.number)
        warm = champ.adapter_dir is not None and run.config.warm_start == "parent"
        parent = Path(champ.adapter_dir) if warm else None
        out_dir = run.adapters_dir() / f"gen-{gen.number:03d}-{selected['digest'][:12]}"
        losses: list[tuple[int, float, float]] = []

        def on_step(step: int, loss: float, lr: float) -> None:
            run.check_lease()  # a lost lease stops training at once, not after it
            losses.append((step, loss, lr))

        start = time.perf_counter()
        result = train_adapter(run.base_dir, parent, dataset, run.config.train, out_dir,
                               seed=run.config.seed * 1000 + gen.number, on_step=on_step)
        seconds = time.perf_counter() - start
        run_id = log_training(run, gen, champ, selected, dataset, losses, seconds)
        return {**result.model_dump(), "seconds": seconds, "mlflow_run_id": run_id,
                "examples_digest": examples_digest(dataset), "warm_start": str(parent) if parent else None}

    inputs = {"dataset": selected["digest"], "parent": champ.pair_id, "spec": run.config.train.model_dump(mode="json")}
    return run.run_stage(gen, "train", inputs, body, events)


def examples_digest(dataset: Dataset) -> str:
    """Digest of exactly the (prompt, completion) texts the trainer consumed, in order."""
    return digest([[e.prompt, e.completion] for e in dataset.examples])


def log_training(run, gen, champ, selected, dataset, losses, seconds) -> str:
    """The generation's MLflow run, one per (lineage, generation, dataset digest): found again when a crashed
    run trains again (a complete one is reused as is; one cut short is deleted and logged afresh)."""
    import mlflow
    import pandas as pd
    from mlflow.entities import Metric

    tags = {"lineage": run.config.lineage, "generation": str(gen.number), "dataset_digest": selected["digest"]}
    found = run.registry.find_run(tags)
    if found is not None and "train_seconds" in found.data.metrics:
        return found.info.run_id
    if found is not None:
        run.registry.client.delete_run(found.info.run_id)
    frame = pd.DataFrame([{"trajectory_id": e.trajectory_id, "level": e.level, "source": e.source,
                           "prompt": e.prompt, "completion": e.completion} for e in dataset.examples])
    with run.registry.start_run(f"gen-{gen.number:03d}", tags) as mlrun:
        with warnings.catch_warnings():  # MLflow's hint about integer columns: ours never miss values
            warnings.simplefilter("ignore", UserWarning)
            data = mlflow.data.from_pandas(frame, name=f"{run.config.lineage}-gen{gen.number}-selected",
                                           digest=selected["digest"][:36])
            mlflow.log_input(data, context="training")
        mlflow.log_params({f"train.{k}": v for k, v in run.config.train.model_dump().items()}
                          | {"parent_pair_id": champ.pair_id, "dataset_digest": selected["digest"],
                             "dataset_size": selected["size"]})
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
@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_gate(run: LineageRun, gen: Generation, champ: Champion, found: dict[str, Any],
                  trained: dict[str, Any], events: Events) -> dict[str, Any]:
    def body() -> dict[str, Any]:
        candidate = run.pair(trained["adapter_hash"])
        run.save_pair(candidate, trained["adapter_dir"], champ.pair_id)
        reached = [int(k) for k in found["accuracy"]] + found["frontier_levels"]
        levels = list(range(1, min(max(reached) + 1, run.max_level) + 1))
        parent_scores = run.scores(champ.pair_id, champ.adapter_dir, levels, gen.id)
        cand_scores = run.scores(candidate.id, trained["adapter_dir"], levels, gen.id)
        best = run.best_scores(levels)
        mastered = {lvl for lvl, sc in best.items() if sc.accuracy >= run.config.curriculum.mastery}
        decision = decide(parent_scores, cand_scores, targets=set(found["frontier_levels"]), best=best,
                          mastered=mastered, spec=run.config.gate, attempt=attempt)
        return {"candidate_pair_id": candidate.id, "levels": levels, "decision": decision.model_dump(mode="json"),
                "candidate": {str(k): v.accuracy for k, v in cand_scores.items()},
                "parent": {str(k): v.accuracy for k, v in parent_scores.items()}}

    attempt = run.attempt(champ.pair_id, gen.number)
    inputs = {"adapter": trained["adapter_hash"], "parent": champ.pair_id, "attempt": attempt,
              "champions": run.champion_pairs()}
    return run.run_stage(gen, "evaluate", inputs, body, events)


# --------------------------------------------------------------------------------------------------------
# 7. register: a model version with the adapter and the HCP document; the generation's end commits with it
# --------------------------------------------------------------------------------------------------------
@task(name="register", cache_policy=NO_CACHE)
def register(run: LineageRun, gen: Generation, champ: Champion, selected: dict[str, Any], trained: dict[str, Any],
             judged: dict[str, Any], events: Events) -> dict[str, Any]:
    """MLflow writes first, each idempotent (the version is found again by its pair id); then one state-DB
    transaction stores the result and finishes the generation; then the aliases follow the committed state.
    A crash anywhere before the commit redoes the same writes; after it, ``sync_aliases`` repairs the aliases."""
    promote = judged["decision"]["promote"]

    def body() -> dict[str, Any]:
        run_id = trained["mlflow_run_id"]
        client = run.registry.client
        client.log_artifacts(run_id, trained["adapter_dir"], "candidate/adapter")
        client.log_artifacts(run_id, str(run.harness.path.parent), "candidate/harness")
        for level, acc in judged["candidate"].items():
            client.log_metric(run_id, f"acc_level_{level}", acc)
        tags = {"generation": gen.number, "parent_version": champ.version, "pair_id": judged["candidate_pair_id"],
                "harness_id": run.harness.id, "harness_hash": run.harness.hash,
                "contract_version": run.harness.contract_version, "base_model_hash": run.base_hash,
                "dataset_digest": selected["digest"], "gate": "promoted" if promote else "rejected",
                "adapter_hash": trained["adapter_hash"]}
        tags |= {f"acc_level_{level}": f"{acc:.4f}" for level, acc in judged["candidate"].items()}
        version = run.registry.create_version(run_id, "candidate", tags)
        log_improvement_plot(run, run_id, extra=(gen.number, "promoted" if promote else "rejected", judged))
        return {"version": version, "promoted": promote}

    def finish(s, result: dict[str, Any]) -> None:
        row = s.get(Generation, gen.id)
        row.parent_pair_id, row.candidate_pair_id = champ.pair_id, judged["candidate_pair_id"]
        row.status, row.finished_at = ("promoted" if promote else "rejected"), utcnow()

    result = run.run_stage(gen, "register", {"evaluate": judged["candidate_pair_id"], "gate": judged["decision"]},
                           body, events, finish=finish)
    sync_aliases(run)
    return result


def sync_aliases(run: LineageRun) -> None:
    """Point ``challenger`` at the latest finished generation's version and ``champion`` at the latest promoted
    one, as the state DB records them (idempotent; run after every register and when a lineage run starts)."""
    latest = champion = None
    for g in run.finished_generations():
        version = run.stage_result(g.id, "register")["version"]
        latest = version
        champion = version if g.status == "promoted" else champion
    run.registry.set_aliases(challenger=latest, champion=champion)


def lineage_rows(run: LineageRun) -> list[dict[str, Any]]:
    """One row per finished generation: gate decision and candidate accuracy per level."""
    rows = []
    for g in run.finished_generations():
        judged = run.stage_result(g.id, "evaluate")
        reg = run.stage_result(g.id, "register")
        rows.append({"generation": g.number, "gate": g.status, "version": reg["version"],
                     "accuracy": {int(k): v for k, v in judged["candidate"].items()},
                     "parent": {int(k): v for k, v in judged["parent"].items()}})
    return rows


def log_improvement_plot(run: LineageRun, run_id: str, extra: tuple[int, str, dict[str, Any]]) -> None:
    """The lineage's accuracy per level per generation, this (not yet committed) generation included."""
    from rsi.lineage import plot_improvement

    number, gate, judged = extra
    rows = [r for r in lineage_rows(run) if r["generation"] != number]
    rows.append({"generation": number, "gate": gate, "accuracy": {int(k): v for k, v in judged["candidate"].items()}})
    with tempfile.TemporaryDirectory() as tmp:
        path = plot_improvement(rows, Path(tmp) / "improvement.png")
        run.registry.client.log_artifact(run_id, str(path))


# --------------------------------------------------------------------------------------------------------
# The flows
# --------------------------------------------------------------------------------------------------------
@flow(name="rsi-cycle", log_prints=False, validate_parameters=False)
def rsi_cycle(run: LineageRun, number: int, events: Events | None = None) -> dict[str, Any]:
    """One generation, stage by stage; returns its summary (also published as Prefect artifacts)."""
    events = events or _quiet
    progress = create_progress_artifact(0.0, description=f"{run.config.lineage} generation {number}")
    summary = generation(run, number, events, on_stage=lambda i, _: update_progress_artifact(progress, 100.0 * i / 7))
    if "gate" in summary:
        publish(run, summary)
    return summary


def generation(run: LineageRun, number: int, events: Events = _quiet, *, direct: bool = False,
               on_stage: Callable[[int, str], Any] = lambda i, name: None) -> dict[str, Any]:
    """The stages of one generation in order. ``direct`` calls the stage functions without Prefect
    (``bench/cycle.py`` measures the orchestration overhead that way)."""
    def call(stage, *args):
        events(f"generation {number}: {stage.name} ...")
        started = time.perf_counter()
        result = stage.fn(*args) if direct else stage(*args)
        seconds[stage.name] = time.perf_counter() - started
        on_stage(len(seconds), stage.name)
        return result

    seconds: dict[str, float] = {}
    run.check_lease()
    fault_point(number, "start")
    gen = run.generation_row(number)
    champ = run.champion_before(number)
    events(f"generation {number}: champion {champ.version} ({champ.pair_id})")
    found = call(discover, run, gen, champ, events)
    if not found["plan"]:
        return {"generation": number, "stopped": "curriculum exhausted", "seconds": seconds}
    executed = call(execute, run, gen, champ, found, events)
    audited = call(audit_stage, run, gen, champ, executed, events)
    selected = call(select_stage, run, gen, found, executed, audited, events)
    trained = call(train, run, gen, champ, selected, events)
    judged = call(evaluate_gate, run, gen, champ, found, trained, events)
    registered = call(register, run, gen, champ, selected, trained, judged, events)
    out = {"discover": found, "execute": executed, "audit": audited, "select": selected, "train": trained,
           "evaluate": judged, "register": registered}
    summary = summarize(run, number, out) | {"seconds": seconds}
    events(f"generation {number}: {summary['gate']} (p={summary['p_value']:.3g}); accuracy {summary['candidate']}")
    return summary


def summarize(run: LineageRun, number: int, out: dict[str, dict[str, Any]]) -> dict[str, Any]:
    judged, audited = out["evaluate"], out["audit"]
    targets = [str(lvl) for lvl in out["discover"]["frontier_levels"]]
    return {
        "generation": number, "gate": "promoted" if judged["decision"]["promote"] else "rejected",
        "p_value": judged["decision"]["p_value"], "reasons": judged["decision"]["reasons"],
        "version": out["register"]["version"], "targets": targets,
        "tasks": out["execute"]["tasks"], "trajectories": out["execute"]["trajectories"],
        "passed": audited["passed"], "selected": out["select"]["size"],
        "pass_at": {lvl: audited["pass_rates"].get(lvl) for lvl in targets},
        "candidate": {k: round(v, 3) for k, v in judged["candidate"].items()},
        "parent": {k: round(v, 3) for k, v in judged["parent"].items()},
        "train_seconds": out["train"]["seconds"],
    }


def publish(run: LineageRun, summary: dict[str, Any]) -> None:
    """Prefect artifacts: the generation's table and a markdown summary."""
    key = f"{run.config.lineage}-gen-{summary['generation']}".replace("_", "-").replace(".", "-").lower()
    table = [{"level": int(lvl), "parent": summary["parent"][lvl], "candidate": summary["candidate"][lvl]}
             for lvl in summary["candidate"]]
    table.append({"level": "gate", "parent": summary["gate"], "candidate": f"p={summary['p_value']:.3g}"})
    table.append({"level": "counts", "parent": f"tasks {summary['tasks']}, trajectories {summary['trajectories']}",
                  "candidate": f"passed {summary['passed']}, selected {summary['selected']}"})
    create_table_artifact(table, key=key, description=f"generation {summary['generation']}: accuracy per level")
    pass_at = ", ".join(f"level {lvl}: pass@1 {v['pass@1']:.2f} pass@k {v['pass@k']:.2f}"
                        for lvl, v in summary["pass_at"].items() if v)
    create_markdown_artifact(
        f"## {run.config.lineage} generation {summary['generation']}: **{summary['gate']}**\n\n"
        f"- targets: levels {', '.join(summary['targets'])} ({pass_at})\n"
        f"- tasks {summary['tasks']}, trajectories {summary['trajectories']}, passed audit {summary['passed']}, "
        f"selected {summary['selected']}\n- gate: {'; '.join(summary['reasons'])}\n"
        f"- MLflow version {summary['version']}\n", key=f"{key}-summary")


@flow(name="rsi-lineage", log_prints=False, validate_parameters=False)
def rsi_lineage(run: LineageRun, generations: int | None = None, events: Events | None = None) -> list[dict[str, Any]]:
    """Generations until the target level is mastered, a plateau of rejections, or the budget is spent."""
    events = events or _quiet
    config = run.config
    summaries: list[dict[str, Any]] = []
    done = run.finished_generations()
    start = (done[-1].number + 1) if done else 1
    for number in range(start, start + (generations or config.generations)):
        summary = rsi_cycle(run, number, events)
        summaries.append(summary)
        if summary.get("stopped"):
            events(f"stopping: {summary['stopped']}")
            break
        rejected_in_row = rejections_in_a_row(run)
        if mastered_up_to(run) >= config.target_level:
            events(f"stopping: every level up to {config.target_level} mastered")
            break
        if rejected_in_row >= config.plateau:
            events(f"stopping: {rejected_in_row} candidates rejected in a row (plateau)")
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
    rows = [r for r in lineage_rows(run) if r["gate"] == "promoted"]
    if not rows:
        return max(run.recipe.train_levels)
    return frontier(rows[-1]["accuracy"], run.config.curriculum.mastery)


def run_lineage(config: CycleConfig, generations: int | None = None, events: Events = _quiet) -> list[dict[str, Any]]:
    """Take the lineage's lease (a second run exits with a clear message), keep it alive, run the lineage flow."""
    run = LineageRun(config, get_settings())
    run.acquire()
    stop = threading.Event()
    beat = threading.Thread(target=keep_alive, args=(run, stop), daemon=True)
    beat.start()
    try:
        sync_aliases(run)  # a crash between a generation's commit and its alias move is repaired here
        return rsi_lineage(run, generations, events)
    finally:
        stop.set()
        run.release()
        run.close()
