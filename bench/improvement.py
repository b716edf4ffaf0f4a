"""Where does the gain come from? rsi's lineage beside three arms with the same rounds and training steps.

Per seed s (the lineage's ``seed=s``), from one shared base model (trained on levels 1-3 only):

- lineage: rsi's loop as it is (``run_lineage``), N generations: the model's own samples of its rollout tasks,
  kept only when the auditor passes them (the task's verifier among its rules), gated, replayed.
- control: one training round per lineage generation, the same steps, warm-started from the previous round,
  on ground-truth labels of the base's training levels (1-3), train split. Shows whether more level 1-3
  data alone generalizes to longer numbers (it does not, if control stays near the base beyond level 3).
- label_free: no verifier at all. Round r samples the same tasks the lineage's generation r discovered,
  k times (the harness's decoding.samples) at the harness temperature, from the arm's own current adapter.
  A sample counts when it parses under the harness's answer format with nothing after it (so it has exactly
  the format's length); per task, the answer most of those samples give is kept only if it is a strict
  plurality: more samples than any other answer (a tie drops the task; one valid sample alone is a
  plurality). Then the same selection (one example per task, frontier levels as the frontier pool, the arm's
  previous 3 rounds as replay) and training as the lineage, warm-started from its previous round, no gate.
  Self-training on majority votes with a length filter, as Lee et al. 2025 (arXiv 2502.01612).
  label_free vs lineage isolates what the verifier is worth.
- upper_bound: the same rounds, tasks, selection and steps, trained on the true completions (the true answer
  in the harness's format), warm-started chain, no gate. Bounds what these tasks and steps can give.
- base (reference): the base model itself.

Every arm's final model (the lineage's champion, the others' last round) is evaluated greedily on the TEST
split at every level the harness can pose, eval_n tasks per level, with Wilson 95 % intervals. Across
seeds: per level the mean and a 95 % t-interval for the mean over seeds (with one seed: that seed's Wilson
interval). The label_free rounds also report how many kept labels were right (checked after selection,
for the report only). Prints a level x arm table and writes JSON.

A tool family (``--family sorting``: its own profile, results in ``bench/results/improvement-sorting.json``): the
labels of control and upper_bound are the family's expert episodes (``TaskFamily.expert``) played under the
harness, trained with the loss on the assistant turns; label_free keeps the episodes the model ended with a final
reply in the harness's format (it claims the list sorted) without checking the final state, and reports how
many of those really solved their task.

    .venv/bin/python bench/improvement.py --seeds 3 [--generations 8] [--family addition] [--profile demo]
        [--out PATH] [--resume]

Each finished seed is written to ``<out>.partial.json``; ``--resume`` keeps those and runs the rest.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.provenance import run_config, write_result  # noqa: E402 (after the path it needs)

ARMS = ("base", "lineage", "control", "label_free", "upper_bound")
# two-sided 95 % quantiles of Student's t, df = 1..30 (beyond: 1.96)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def round_tasks(run, gen) -> tuple[list, set[int]]:
    """The rollout tasks the lineage's generation discovered (train split), and its frontier levels."""
    from sqlalchemy import select as sql_select

    from rsi.store.records import task_from_row
    from rsi.store.schema import TaskRow

    found = run.stage_result(gen, "discover")
    with run.store.session() as s:
        rows = {r.id: r for r in s.scalars(sql_select(TaskRow).where(TaskRow.id.in_(found.task_ids)))}
    return [task_from_row(rows[i]) for i in found.task_ids], set(found.frontier_levels)


def train_chain(run, rounds, out: Path, candidates_for) -> tuple[Path | None, list[dict]]:
    """One selection and training round per lineage generation, warm-started from the previous round, no
    gate. ``candidates_for(tasks, adapter, gen)`` gives the round's Candidates (``passed`` = keep) and stats."""
    from rsi.select import select
    from rsi.train import train_adapter

    config, adapter, datasets, log = run.config, None, [], []
    for gen in rounds:
        tasks, frontier_levels = round_tasks(run, gen)
        candidates, stats = candidates_for(tasks, adapter, gen)
        replay = [e for d in datasets[-config.selection.replay_generations:] for e in d.examples]
        dataset = select(candidates, replay, config.selection, frontier_levels=frontier_levels,
                         seed=config.seed + gen.number)
        datasets.append(dataset)
        stats |= {"round": gen.number, "frontier": len(dataset.pool("frontier")), "replay": len(dataset.pool("replay"))}
        log.append(stats)
        print(f"  round {gen.number}: {stats}")
        if not dataset.examples:
            continue  # nothing kept: the round trains nothing and the chain carries on from the last adapter
        train_adapter(run.base_dir, adapter, dataset, config.train, out / f"round-{gen.number}",
                      seed=config.seed * 1000 + gen.number)
        adapter = out / f"round-{gen.number}"
    return adapter, log


def lineage_arm(config, generations: int) -> None:
    """rsi's loop as it is; it takes the lineage's lease itself and leaves its generations in the state DB."""
    from flows.cycle import run_lineage

    run_lineage(config, generations, lambda m: print(f"  [seed {config.seed}] {m}"))


def labelled(run, task) -> tuple[str, str, tuple]:
    """The true (prompt, completion, turns) of a task under the lineage's harness: the answer in its format, or
    for a tool family the family's expert episode."""
    from rsi.episodes import demonstration, training_parts
    from rsi.parsers import digits_lsb

    if run.harness.document.tools:
        return training_parts(demonstration(run.harness, run.family, task).messages)
    width = run.harness.document.answer.params["width"]
    return run.harness.prompt(task.payload), digits_lsb(task.answer, width), ()


def control_arm(run, rounds, out: Path) -> tuple[Path | None, list[dict]]:
    """Fresh ground-truth examples of the base's levels (train split) each round; all in the replay pool."""
    from rsi.select import Dataset, Example
    from rsi.splits import stream_seed
    from rsi.train import train_adapter

    adapter, log = None, []
    for gen in rounds:
        seed = stream_seed("base", run.config.seed, gen.number)
        tasks = [t for lvl in run.base_levels for t in run.family.tasks("train", seed, lvl, 1024)]
        examples = tuple(Example(trajectory_id=f"label-{t.id}", level=t.level, prompt=prompt, completion=completion,
                                 turns=turns, source="replay")
                         for t in tasks for prompt, completion, turns in [labelled(run, t)])
        train_adapter(run.base_dir, adapter, Dataset(examples=examples), run.config.train, out / f"round-{gen.number}",
                      seed=run.config.seed * 1000 + gen.number)
        adapter = out / f"round-{gen.number}"
        log.append({"round": gen.number, "examples": len(examples)})
    return adapter, log


def label_free_arm(run, rounds, out: Path) -> tuple[Path | None, list[dict]]:
    from rsi.execute import rollout, sampling_params
    from rsi.parsers import get_parser
    from rsi.select import Candidate
    from rsi.splits import stream_seed
    from rsi.train import adapter_hash

    answer = run.harness.document.answer
    parse = get_parser(answer.parser)

    def claimed_episodes(samples, by_task):
        """Tool episodes without a verifier: kept when the model ended them with a final reply in the harness's
        format (it claims the task done); the final state is not checked (except, after selection, for the
        report: how many kept episodes really solved their task)."""
        from rsi.audit import audit
        from rsi.episodes import training_parts

        ended = {s.id for s in samples if s.messages[-1].role == "assistant" and not s.messages[-1].tool_calls
                 and (p := parse(s.completion, **answer.params)).ok and not p.extra}
        candidates = [Candidate(trajectory_id=s.id, task_id=s.task_id, level=by_task[s.task_id].level,
                                prompt=prompt, completion=completion, turns=turns, passed=s.id in ended)
                      for s in samples for prompt, completion, turns in [training_parts(s.messages)]]
        right = sum(audit(s, by_task[s.task_id], run.harness, run.family).passed for s in samples if s.id in ended)
        return candidates, {"tasks": len(by_task), "claimed": len(ended), "claims_right": right}

    def candidates_for(tasks, adapter, gen):
        pair_id = run.pair(adapter_hash(adapter) if adapter else None).id
        params = sampling_params(run.harness, seed=stream_seed("rollout", run.config.seed, gen.number))
        samples = rollout(tasks, run.harness, run.backend, pair_id, params, adapter=str(adapter) if adapter else None)
        by_task = {t.id: t for t in tasks}
        if run.harness.document.tools:
            return claimed_episodes(samples, by_task)
        values = {s.id: p.value for s in samples if (p := parse(s.completion, **answer.params)).ok and not p.extra}
        votes: dict[str, Counter] = {}
        for s in samples:
            if s.id in values:
                votes.setdefault(s.task_id, Counter())[values[s.id]] += 1
        majority = {}
        for task_id, count in votes.items():
            top = count.most_common(2)
            if len(top) == 1 or top[0][1] > top[1][1]:  # strict plurality; a tie drops the task
                majority[task_id] = top[0][0]
        candidates = [Candidate(trajectory_id=s.id, task_id=s.task_id, level=by_task[s.task_id].level,
                                prompt=run.harness.prompt(by_task[s.task_id].payload), completion=s.completion,
                                passed=s.task_id in majority and values.get(s.id) == majority[s.task_id])
                      for s in samples]
        right = sum(run.family.verify(by_task[t], v) for t, v in majority.items())  # report only
        return candidates, {"tasks": len(tasks), "labelled": len(majority), "labels_right": right}

    return train_chain(run, rounds, out, candidates_for)


def upper_bound_arm(run, rounds, out: Path) -> tuple[Path | None, list[dict]]:
    from rsi.select import Candidate

    def candidates_for(tasks, adapter, gen):
        candidates = [Candidate(trajectory_id=f"label-{t.id}", task_id=t.id, level=t.level, prompt=prompt,
                                completion=completion, turns=turns, passed=True)
                      for t in tasks for prompt, completion, turns in [labelled(run, t)]]
        return candidates, {"tasks": len(tasks)}

    return train_chain(run, rounds, out, candidates_for)


def test_scores(run, adapter: str | None, levels: list[int]) -> dict[int, dict[str, float]]:
    """Greedy test-split scores of the base plus ``adapter`` (registered as a pair of this lineage)."""
    from rsi.train import adapter_hash

    pair = run.pair(adapter_hash(Path(adapter)) if adapter else None)
    run.save_pair(pair, adapter, None)
    scores = run.scores(pair, adapter, levels, split="test")
    return {lvl: {"accuracy": sc.accuracy, "ci_low": sc.ci_low, "ci_high": sc.ci_high, "n": sc.n}
            for lvl, sc in scores.items()}


def run_seed(profile: str, seed: int, generations: int, root: Path) -> dict[str, Any]:
    from rsi.config import get_settings
    from rsi.cycle import LineageRun, load_config

    config = load_config(profile, seed=seed, lineage=f"improvement-s{seed}")
    seconds, rounds_log = {}, {}
    started = time.perf_counter()
    lineage_arm(config, generations)
    seconds["lineage"] = time.perf_counter() - started  # includes its held-out evaluations for the gate
    run = LineageRun(config, get_settings())
    run.acquire()
    try:
        rounds = [g for g in run.finished_generations() if run.stage_result(g, "train")]
        rounds_log["lineage"] = [{"round": g.number, "status": g.status,
                                  **run.stage_result(g, "select").model_dump(mode="json")}
                                 for g in rounds]
        finals = {"base": None, "lineage": run.champion_before(10**6).adapter_dir}
        arms = {"control": control_arm, "label_free": label_free_arm, "upper_bound": upper_bound_arm}
        for name, arm in arms.items():
            print(f"[seed {seed}] {name}: {len(rounds)} rounds x {config.train.steps} steps")
            started = time.perf_counter()
            adapter, rounds_log[name] = arm(run, rounds, root / name / f"seed-{seed}")
            seconds[name] = time.perf_counter() - started
            finals[name] = str(adapter) if adapter else None
        levels = list(range(1, run.max_level(run.harness) + 1))  # every level the harness can pose
        scores, eval_seconds = {}, {}
        for name in ARMS:
            started = time.perf_counter()
            scores[name] = test_scores(run, finals[name], levels)
            eval_seconds[name] = time.perf_counter() - started
    finally:
        run.release()
        run.close()
    return {"seed": seed, "rounds": len(rounds), "scores": scores, "train_seconds": seconds,
            "eval_seconds": eval_seconds, "round_log": rounds_log}


def across_seeds(per_seed: list[dict], arm: str, level: int) -> dict[str, Any]:
    """Mean accuracy over seeds and a 95 % t-interval for it (one seed: its Wilson interval)."""
    rows = [s["scores"][arm][level] for s in per_seed]
    accs = [r["accuracy"] for r in rows]
    mean = sum(accs) / len(accs)
    if len(accs) == 1:
        return {"mean": mean, "low": rows[0]["ci_low"], "high": rows[0]["ci_high"], "interval": "wilson95, one seed"}
    sd = math.sqrt(sum((a - mean) ** 2 for a in accs) / (len(accs) - 1))
    half = (T975[len(accs) - 2] if len(accs) <= 31 else 1.96) * sd / math.sqrt(len(accs))
    return {"mean": mean, "low": max(0.0, mean - half), "high": min(1.0, mean + half), "interval": "t95 over seeds"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--family", default="addition", help="the task family (addition, or a tool family)")
    parser.add_argument("--profile", default=None, help="default: the family's own profile, else demo")
    parser.add_argument("--out", default=str(REPO / "bench/results/improvement.json"))
    parser.add_argument("--resume", action="store_true",
                        help="keep the seeds already finished in --out's partial file (same profile and generations)")
    args = parser.parse_args()
    from rsi.cycle import profile_for

    args.profile = profile_for(args.profile, args.family)
    if args.out == str(REPO / "bench/results/improvement.json") and args.family != "addition":
        args.out = str(REPO / f"bench/results/improvement-{args.family}.json")
    partial = Path(args.out).with_suffix(".partial.json")

    root = Path(tempfile.mkdtemp(prefix="rsi-bench-improvement-"))
    os.environ["RSI_HOME"] = str(root / "home")  # one state DB; each seed is its own lineage in it
    os.environ["PREFECT_HOME"] = str(root / "prefect")
    from rsi.basemodel import BaseRecipe, ensure_base
    from rsi.config import Settings
    from rsi.cycle import load_config

    config = load_config(args.profile)
    base = ensure_base(Settings(home=REPO / ".rsi"), BaseRecipe(**config.base_recipe))  # built once, shared
    shutil.copytree(base, root / "home" / "models" / base.name)

    per_seed = []
    if args.resume and partial.exists():
        done = json.loads(partial.read_text())
        if (done["profile"], done["generations"]) == (args.profile, args.generations):
            per_seed = [s for s in done["per_seed"] if s["seed"] < args.seeds]
            for s in per_seed:  # JSON keys are strings; the tables index levels by int
                s["scores"] = {arm: {int(k): v for k, v in levels.items()} for arm, levels in s["scores"].items()}
            print(f"resuming: seeds {[s['seed'] for s in per_seed]} already finished in {partial}")
    for s in range(len(per_seed), args.seeds):
        per_seed.append(run_seed(args.profile, s, args.generations, root))
        write_result(partial, {"profile": args.profile, "generations": args.generations, "per_seed": per_seed},
                     run_config(args))
    levels = sorted(per_seed[0]["scores"]["base"])
    summary = {arm: {lvl: across_seeds(per_seed, arm, lvl) for lvl in levels} for arm in ARMS}

    rounds = [s["rounds"] for s in per_seed]
    print(f"\nrounds per seed {rounds} x {config.train.steps} steps, every trained arm; greedy accuracy on the test "
          f"split, n={config.eval_n} per level; mean over {args.seeds} seed(s) "
          f"[{summary['base'][levels[0]]['interval']}]")
    print(f"{'level':>5} " + " ".join(f"{arm:>21}" for arm in ARMS))
    for lvl in levels:
        cells = (summary[arm][lvl] for arm in ARMS)
        print(f"{lvl:>5} " + " ".join(f"{c['mean']:>7.3f} [{c['low']:.3f},{c['high']:.3f}]" for c in cells))
    seconds = {arm: sum(s["train_seconds"].get(arm, 0.0) + s["eval_seconds"][arm] for s in per_seed) for arm in ARMS}
    print("wall seconds (train + test eval, all seeds): " + ", ".join(f"{a} {v:.0f}" for a, v in seconds.items()))

    result = {"command": [sys.executable, *sys.argv], "profile": args.profile, "generations": args.generations,
              "arms": list(ARMS), "seeds": list(range(args.seeds)), "rounds": rounds,
              "steps_per_round": config.train.steps, "eval_n": config.eval_n, "split": "test",
              "per_seed": per_seed, "mean": summary, "wall_seconds": seconds, "cpus": os.cpu_count()}
    write_result(args.out, result, run_config(args, cycle_config=config.model_dump(mode="json")))
    partial.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
