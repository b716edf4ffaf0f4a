"""Which part of the gain did the loop make? One lineage config, arms that each turn one part of it off.

Every arm is the same cycle config as ``full`` (the family's profile) except the fields that name the arm, and
runs the same number of generations from the same base (``--base-seeds``: the profile's base recipe with that
seed) and lineage seed (``--lineage-seeds``). The JSON stores each arm's config diff against ``full``
(``tests/test_ablation.py`` checks it names only the arm's fields):

- ``base``: no training, no search: the untrained base under the profile's harness.
- ``base+harness``: no training; the best candidate harness of one proposal round of the profile's search
  space, picked by held-out accuracy of the base under it (no gate, no loop).
- ``weights``: the loop with its harness frozen (``harness_search.enabled`` false).
- ``harness``: the loop with ``train.steps`` 0: it only searches harnesses (every generation), paired with
  the untrained base.
- ``full``: the loop as configured.
- ``control``: the loop training on its own rollouts unverified (``labels = "unverified"``), gate as full.
- ``label_free``: no ground truth anywhere in the loop (``labels = "majority"``): training answers are the
  samples' majority, and the held-out scores that drive its curriculum and its gate are the pair's
  self-agreement.
- ``upper_bound``: the loop training on the true answers of its rollout tasks (``labels = "truth"``).

Each arm's final pair (its champion) is scored greedily on the TEST split, with ground truth, at every level up
to the curriculum's top (a level its harness cannot pose counts unsolved), ``eval_n`` tasks a level, the same
tasks for every arm of a (base, lineage) seed cell. Reported: per arm, per level and as the mean over levels,
the mean over cells with a 95 % t-interval over cells (base seeds x lineage seeds); process CPU-seconds of the
loop (user + system, all threads) and of the test scoring; for a plan harness, the share of its calls on the
test tasks whose problem lies in the train split; and per cell ``full`` minus the best single-component arm
(``weights``, ``harness``, ``base+harness``), with its t-interval over cells. A family whose profile has no
harness search (no proposer yet: sorting) runs no harness arms and no separate ``weights`` arm (it would be
``full`` itself); the JSON says so.

    .venv/bin/python bench/ablation.py --family addition [--base-seeds 0,1,2] [--lineage-seeds 0,1]
        [--generations 4] [--max-level 12] [--eval-n 128] [--out PATH] [--resume] [--jobs 2]

``--jobs N`` runs N cells at once, each in its own process with CPUs // N torch threads. A cell keeps about one
core busy whatever its threads (each arm's ``loop_cpu_s`` / ``loop_wall_s`` in the JSON), so on two cores two
cells at once take about the wall time of one. Threads change float summation order: a cell's numbers are those
of its thread count, which each cell records (``torch_threads``).
Each finished cell is written to ``<out>.partial.json``; ``--resume`` keeps the cells finished on the same
commit with the same arguments and runs the rest.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.cells import child_cell, report  # noqa: E402 (after the path it needs)
from bench.provenance import changed_since, run_config, write_result  # noqa: E402

# arm -> (its config's overrides of full's, how it runs: "lineage" = run_lineage, "pick" = best proposal)
ARMS: dict[str, tuple[dict[str, Any], str]] = {
    "base": ({"train": {"steps": 0}, "harness_search": {"enabled": False}}, "lineage"),
    "base+harness": ({"train": {"steps": 0}}, "pick"),
    "weights": ({"harness_search": {"enabled": False}}, "lineage"),
    "harness": ({"train": {"steps": 0}}, "lineage"),
    "full": ({}, "lineage"),
    "control": ({"labels": "unverified"}, "lineage"),
    "label_free": ({"labels": "majority"}, "lineage"),
    "upper_bound": ({"labels": "truth"}, "lineage"),
}
SINGLE_COMPONENT = ("weights", "harness", "base+harness")
HARNESS_ARMS = ("base+harness", "harness", "weights")  # not run where the profile has no harness search
# two-sided 95 % quantiles of Student's t, df = 1..30 (beyond: 1.96)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def arm_config(arm: str, profile: str, shared: dict[str, Any], base_seed: int, lineage_seed: int):
    """The arm's cycle config: the profile, the run's shared overrides, the cell's seeds, then the arm's own."""
    from rsi.run import deep_merge, load_config

    lineage = f"ablation-{arm.replace('+', '-')}-b{base_seed}-s{lineage_seed}"
    cell = {"seed": lineage_seed, "lineage": lineage, "base_recipe": {"seed": base_seed}}
    return load_config(profile, **deep_merge(deep_merge(shared, cell), ARMS[arm][0]))


def config_diff(full: dict[str, Any], other: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted field -> [full's value, the other's] wherever two config dumps differ (the lineage name aside:
    every arm is its own lineage)."""
    out: dict[str, Any] = {}
    for key in sorted(set(full) | set(other)):
        path, a, b = f"{prefix}{key}", full.get(key), other.get(key)
        if path == "lineage" or a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out |= config_diff(a, b, f"{path}.")
        else:
            out[path] = [a, b]
    return out


def arms_for(full) -> dict[str, str]:
    """The arms this family runs, and for each arm it does not, why."""
    if full.harness_search.enabled:
        return {arm: "" for arm in ARMS}
    why = "the profile has no harness search (no proposer for this family yet)"
    return {arm: (why if arm in HARNESS_ARMS else "") for arm in ARMS} | {
        "weights": "identical to full: the profile's harness is frozen already"}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_arm(arm: str, config) -> tuple[dict[str, Any], Any]:
    """Run one arm's loop (or pick); returns its record and the open run holding its final pair."""
    from rsi.flows.cycle import run_lineage
    from rsi.config import get_settings
    from rsi.run import Run, RunContext
    from rsi.store.leases import acquire_lease

    started, wall = cpu_seconds(), time.perf_counter()
    summaries: list[dict] = []
    if ARMS[arm][1] == "lineage":
        summaries = run_lineage(config, config.generations, lambda m: print(f"  [{config.lineage}] {m}", flush=True))
    run = Run(RunContext.of(config, get_settings()))
    run.fence.holder, run.fence.token = acquire_lease(run.store, config.lineage)
    if ARMS[arm][1] == "pick":
        final = pick_harness(run)
    else:
        champ = run.champion(10**6)
        final = {"pair_id": champ.pair_id, "adapter_dir": champ.adapter_dir, "harness_id": champ.harness_id,
                 "version": champ.version}
    record = {"config_diff": None, "loop_cpu_s": round(cpu_seconds() - started, 1),
              "loop_wall_s": round(time.perf_counter() - wall, 1), "final": final,
              "generations": [s.model_dump(include={"generation", "gate", "stopped", "harness", "version"})
                              for s in summaries]}
    return record, run


def pick_harness(run) -> dict[str, Any]:
    """base+harness: every proposal of the profile's search space for the starting harness, paired with the
    base, scored on held-out up to the curriculum's top level; the best mean wins (no gate, no training)."""
    from rsi.proposers import propose
    from rsi.store.harnesses import store_proposal

    spec, levels = run.config.harness_search, list(range(1, run.config.curriculum.max_level + 1))
    proposals = propose(run.harnesses.start, spec.proposers, spec.space)
    with run.fence.write() as s:
        harnesses = [store_proposal(s, p.document, p.sources, run.settings.home) for p in proposals]
    tried = {}
    for harness in [run.harnesses.start, *harnesses]:
        pair = run.pair(None, harness)
        run.ledger.save_pair(pair, None, None)
        scores = run.scores.of(pair, None, levels)
        tried[harness.id] = (pair.id, sum(sc.accuracy for sc in scores.values()) / len(levels))
    best = max(tried, key=lambda h: tried[h][1])
    return {"pair_id": tried[best][0], "adapter_dir": None, "harness_id": best, "version": "base",
            "heldout_mean": {h: round(v[1], 4) for h, v in tried.items()}}


def test_scores(run, final: dict[str, Any], levels: list[int], n: int) -> dict[str, Any]:
    """The final pair's greedy test accuracy per level (ground truth), and for a plan harness the share of its
    calls on these tasks whose problem lies in the train split."""
    from rsi.evaluate import evaluate, evaluation_tasks
    from rsi.hcp.plays import calls_with_gold, poses
    from rsi.pair import Responder

    harness = run.harnesses.of(final["harness_id"])
    pair = Responder(harness, run.base.backend, final["pair_id"], final["adapter_dir"], run.family)
    scores = evaluate(pair, levels, n, lineage_seed=run.config.seed, split="test")
    out: dict[str, Any] = {"levels": {sc.level: {"accuracy": sc.accuracy, "ci_low": sc.ci_low, "ci_high": sc.ci_high,
                                                 "n": sc.n} for sc in scores}}
    if harness.document.plan is not None:
        tasks, _ = evaluation_tasks(harness, run.family, levels, n, lineage_seed=run.config.seed, k=1, split="test")
        calls = [c for t in tasks if poses(harness, run.family, t) for c in calls_with_gold(harness, run.family, t)[0]]
        out["plan_calls"] = len(calls)
        out["plan_calls_in_train_split"] = round(sum(c.split == "train" for c in calls) / len(calls), 4) if calls else None
    return out


def run_cell(profile: str, shared: dict[str, Any], base_seed: int, lineage_seed: int) -> dict[str, Any]:
    """In this process (its own RSI_HOME): every arm of one (base seed, lineage seed) cell."""
    full = arm_config("full", profile, shared, base_seed, lineage_seed)
    levels = list(range(1, full.curriculum.max_level + 1))
    dump = full.model_dump(mode="json")
    import torch

    from rsi.store.leases import release_lease

    cell: dict[str, Any] = {"base_seed": base_seed, "lineage_seed": lineage_seed, "arms": {}, "skipped": {},
                            "torch_threads": torch.get_num_threads()}
    for arm, skipped in arms_for(full).items():
        if skipped:
            cell["skipped"][arm] = skipped
            continue
        config = arm_config(arm, profile, shared, base_seed, lineage_seed)
        print(f"[b{base_seed} s{lineage_seed}] {arm}: {config_diff(dump, config.model_dump(mode='json'))}", flush=True)
        record, run = run_arm(arm, config)
        try:
            started = cpu_seconds()
            record |= {"config_diff": config_diff(dump, config.model_dump(mode="json")),
                       "test": test_scores(run, record["final"], levels, full.eval_n)}
            record["test_cpu_s"] = round(cpu_seconds() - started, 1)
        finally:
            release_lease(run.store, run.config.lineage, run.fence.holder, run.fence.token)
            run.close()
        cell["arms"][arm] = record
        mean = sum(v["accuracy"] for v in record["test"]["levels"].values()) / len(levels)
        print(f"[b{base_seed} s{lineage_seed}] {arm}: test mean {mean:.3f}, loop {record['loop_cpu_s']} CPU-s",
              flush=True)
    return cell


def t_interval(values: list[float]) -> dict[str, Any]:
    """Mean and a 95 % t-interval for the mean (one value: no interval)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return {"mean": mean, "low": None, "high": None, "cells": len(values)}
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    half = (T975[len(values) - 2] if len(values) <= 31 else 1.96) * sd / math.sqrt(len(values))
    return {"mean": mean, "low": mean - half, "high": mean + half, "cells": len(values)}


def cell_mean(cell: dict[str, Any], arm: str) -> float:
    levels = cell["arms"][arm]["test"]["levels"]
    return sum(v["accuracy"] for v in levels.values()) / len(levels)


def summarize(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Across cells: per arm and level, per arm over levels, CPU-seconds, and the claimed differences."""
    arms = [a for a in ARMS if all(a in c["arms"] for c in cells)]
    levels = sorted(int(k) for k in cells[0]["arms"]["full"]["test"]["levels"])
    per_level = {a: {lvl: t_interval([c["arms"][a]["test"]["levels"][str(lvl)]["accuracy"] for c in cells])
                     for lvl in levels} for a in arms}
    mean = {a: t_interval([cell_mean(c, a) for c in cells]) for a in arms}
    cpu = {a: {"loop_cpu_s": sum(c["arms"][a]["loop_cpu_s"] for c in cells) / len(cells),
               "test_cpu_s": sum(c["arms"][a]["test_cpu_s"] for c in cells) / len(cells)} for a in arms}
    singles = [a for a in SINGLE_COMPONENT if a in arms]
    best_single = max(singles, key=lambda a: mean[a]["mean"]) if singles else "base"
    differences = {f"full - {other}": t_interval([cell_mean(c, "full") - cell_mean(c, other) for c in cells])
                   for other in dict.fromkeys([best_single, "base", "control", "label_free", "weights", "harness"])
                   if other in arms}
    differences["upper_bound - full"] = t_interval([cell_mean(c, "upper_bound") - cell_mean(c, "full") for c in cells])
    return {"arms": arms, "levels": levels, "per_level": per_level, "mean_over_levels": mean, "cpu_s_per_cell": cpu,
            "best_single_component": best_single, "differences": differences}


def fmt(iv: dict[str, Any]) -> str:
    if iv["low"] is None:
        return f"{iv['mean']:+.3f}" if iv["mean"] < 0 else f"{iv['mean']:.3f}"
    return f"{iv['mean']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}]"


def print_table(summary: dict[str, Any]) -> None:
    arms = summary["arms"]
    print(f"\ntest split, mean over cells [95 % t-interval over cells]; {len(summary['levels'])} levels")
    print(f"{'level':>5} " + " ".join(f"{a:>14}" for a in arms))
    for lvl in summary["levels"]:
        print(f"{lvl:>5} " + " ".join(f"{summary['per_level'][a][lvl]['mean']:>14.3f}" for a in arms))
    print(f"\n{'arm':>13} {'mean over levels':>26} {'loop CPU-s':>11} {'test CPU-s':>11}")
    for a in arms:
        cpu = summary["cpu_s_per_cell"][a]
        print(f"{a:>13} {fmt(summary['mean_over_levels'][a]):>26} {cpu['loop_cpu_s']:>11.0f} {cpu['test_cpu_s']:>11.0f}")
    print()
    for name, iv in summary["differences"].items():
        print(f"{name:>28}: {iv['mean']:+.3f}" + (f" [{iv['low']:+.3f}, {iv['high']:+.3f}]" if iv["low"] is not None
                                                  else " (one cell: no interval)"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="addition")
    parser.add_argument("--profile", default=None, help="default: the family's own profile, else demo")
    parser.add_argument("--base-seeds", default="0,1,2", help="base recipe seeds, comma-separated")
    parser.add_argument("--lineage-seeds", default="0,1", help="lineage seeds, comma-separated")
    parser.add_argument("--generations", type=int, default=4, help="generations of every loop arm")
    parser.add_argument("--max-level", type=int, default=None, help="the curriculum's top level (every arm)")
    parser.add_argument("--eval-n", type=int, default=None, help="held-out and test tasks per level (every arm)")
    parser.add_argument("--out", default=None, help="default: bench/results/ablation-<family>.json")
    parser.add_argument("--resume", action="store_true", help="keep the cells finished on this commit")
    parser.add_argument("--jobs", type=int, default=1, help="cells run at once, each in its own process with "
                        "torch threads = CPUs // jobs (default 1)")
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # the child's side: "base_seed,lineage_seed,home"
    args = parser.parse_args()
    from rsi.run import profile_for
    from rsi.errors import UserError

    args.profile = profile_for(args.profile, args.family)
    shared: dict[str, Any] = {"generations": args.generations}
    if args.max_level:
        shared |= {"curriculum": {"max_level": args.max_level}, "target_level": args.max_level}
    if args.eval_n:
        shared["eval_n"] = args.eval_n
    if args.cell:
        base_seed, lineage_seed = (int(x) for x in args.cell.split(","))
        report(run_cell(args.profile, shared, base_seed, lineage_seed))
        return
    try:
        base_seeds = [int(x) for x in args.base_seeds.split(",")]
        lineage_seeds = [int(x) for x in args.lineage_seeds.split(",")]
    except ValueError:
        raise SystemExit(f"--base-seeds / --lineage-seeds take comma-separated integers (got {args.base_seeds!r}, "
                         f"{args.lineage_seeds!r})") from None
    out = Path(args.out or REPO / f"bench/results/ablation-{args.family}.json")
    partial = out.with_suffix(".partial.json")
    config = run_config(args, shared=shared)
    cells: list[dict] = []
    if args.resume and partial.exists():
        done = json.loads(partial.read_text())
        changed = changed_since(done["provenance"]["commit"] or "", "bench/ablation.py", serving=False)
        if changed or changed is None or done["shared_overrides"] != shared or done["family"] != args.family:
            raise SystemExit(f"{partial} holds cells of commit {done['provenance']['commit']} with overrides "
                             f"{done['shared_overrides']}; the measured code changed since ({changed}) or this run's "
                             f"overrides differ ({shared}): delete it or run without --resume")
        cells = [c for c in done["cells"] if c["base_seed"] in base_seeds and c["lineage_seed"] in lineage_seeds]
        print(f"resuming: cells {[(c['base_seed'], c['lineage_seed']) for c in cells]} already finished")

    root = Path(tempfile.mkdtemp(prefix="rsi-bench-ablation-"))
    from rsi.basemodel import BaseRecipe, ensure_base
    from rsi.config import Settings

    pending = [(b, s) for b in base_seeds for s in lineage_seeds
               if not any((c["base_seed"], c["lineage_seed"]) == (b, s) for c in cells)]
    threads = max(1, (os.cpu_count() or 1) // args.jobs)  # each child's torch threads: the cores shared out

    def run_child(b: int, s: int) -> dict[str, Any]:
        """One cell in a child process of its own (its own RSI_HOME); its log lines are printed as they come."""
        base = ensure_base(Settings(home=REPO / ".rsi"), BaseRecipe(**arm_config("full", args.profile, shared, b,
                                                                                 s).base_recipe))
        cmd = [sys.executable, __file__, "--family", args.family, "--profile", args.profile, "--generations",
               str(args.generations), "--cell", f"{b},{s}"]
        cmd += ["--max-level", str(args.max_level)] if args.max_level else []
        cmd += ["--eval-n", str(args.eval_n)] if args.eval_n else []
        return child_cell(cmd, base, root / f"b{b}-s{s}", root / "prefect", threads,
                          f"cell base seed {b}, lineage seed {s}", partial)

    try:
        for b in sorted({b for b, _ in pending}):  # build each base once, before cells share it
            ensure_base(Settings(home=REPO / ".rsi"), BaseRecipe(**arm_config("full", args.profile, shared, b,
                                                                              0).base_recipe))
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for done_cell in as_completed([pool.submit(run_child, b, s) for b, s in pending]):
                cells.append(done_cell.result())
                cells.sort(key=lambda c: (c["base_seed"], c["lineage_seed"]))
                write_result(partial, {"family": args.family, "shared_overrides": shared, "cells": cells}, config)
    except UserError as exc:
        raise SystemExit(f"ablation: {exc}") from None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = summarize(cells)
    print_table(summary)
    result = {"command": "python bench/ablation.py " + " ".join(sys.argv[1:]), "family": args.family,
              "profile": args.profile, "shared_overrides": shared, "base_seeds": base_seeds,
              "lineage_seeds": lineage_seeds, "interval": "95 % t-interval over cells (base seeds x lineage seeds)"
              if len(base_seeds) > 1 else "95 % t-interval over lineage seeds only (one base seed)",
              "arms_config": {a: ARMS[a][0] for a in ARMS}, "cells": cells, "summary": summary}
    write_result(out, result, config)
    partial.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
