"""Does the pair propose tasks it learns from as well as the human-written generator does, at equal CPU?

Three arms of the ``programs`` lineage, each config the profile's except ``proposer.source`` (the JSON stores
each arm's diff against ``self``; ``tests/test_selfplay.py`` checks it names only proposer fields):

- ``self``: the champion proposes the training tasks (in discover: ``rsi.run.proposals``) and learns, as solver
  and as proposer, from the proposals it solved sometimes but not always (``selection.band``);
- ``generator``: the family's generator draws them at the curriculum's levels (the same band filters them);
- ``frozen``: the untrained base proposes them and never learns to propose (the same filter, no proposer that
  improves).

Behaviour differs beyond the proposer in one way the configs do not show: a proposing pair replays only its own
earlier selections, where the generator's arm also runs fresh generator tasks at mastered levels (the profile's
``replay_tasks_per_level``).

Each (arm, lineage seed) runs in a process of its own, from one base (the profile's recipe, built once and
shared: intervals are over lineage seeds only), generation after generation while its CPU-seconds (user +
system of the whole process tree, Prefect's temporary server included) are below ``--budget-cpu-s`` and the
lineage would go on as ``rsi run`` does (it stops at a plateau of rejections or the target mastered); the
champion reported at the budget is the last one whose generation ended within it. After every generation
the champion is scored greedily on one fixed test suite (test split, the same tasks for every arm and seed:
``--eval-n`` a level, levels 1..``--max-level``, drawn with seed 0), outside the budget. Reported per arm: test
accuracy per generation and at the budget (mean over levels, t-interval over seeds), the mean level (operations
of the canonical program) of the tasks each generation executed at the curriculum's levels (accepted proposals,
or the generator's), and the proposals each contract or stage rule rejected; and self minus each other arm at the
budget, paired by seed.

    .venv/bin/python bench/selfplay.py [--seeds 0,1,2] [--budget-cpu-s 1500] [--eval-n 64] [--max-level 12]
        [--jobs 2] [--out PATH] [--resume]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.ablation import config_diff, t_interval  # noqa: E402 (after the path it needs)
from bench.cells import child_cell, report  # noqa: E402
from bench.provenance import changed_since, run_config, write_result  # noqa: E402

ARMS = ("self", "generator", "frozen")
PROFILE = "programs"


def arm_config(arm: str, seed: int):
    from rsi.run import load_config

    return load_config(PROFILE, lineage=f"selfplay-{arm}-s{seed}", seed=seed, proposer={"source": arm})


def tree_cpu_s() -> float:
    """CPU-seconds (user + system) of this process and every process under it, live (Prefect's temporary server,
    say) or waited for."""
    import psutil

    me, kids = psutil.Process(), resource.getrusage(resource.RUSAGE_CHILDREN)
    live = 0.0
    for child in me.children(recursive=True):
        try:
            times = child.cpu_times()
            live += times.user + times.system
        except psutil.Error:  # gone since listed: its time is in RUSAGE_CHILDREN once waited for
            continue
    own = me.cpu_times()
    return own.user + own.system + kids.ru_utime + kids.ru_stime + live


def scored(config, number: int, levels: list[int], n: int) -> dict[str, Any]:
    """After generation ``number`` (0: the base): its champion's greedy accuracy per level on the fixed test suite
    (test split, seed 0 for every arm and lineage seed), and what the generation executed."""
    from rsi.config import get_settings
    from rsi.evaluate import evaluate
    from rsi.pair import Responder
    from rsi.run import RunContext, holding_lease, open_run
    from rsi.run.register import done_reason, mastered_up_to

    with open_run(RunContext.of(config, get_settings())) as run, holding_lease(run.fence):
        champ = run.champion(number + 1)
        pair = Responder(run.harnesses.of(champ), run.base.backend, champ.pair_id, champ.adapter_dir, run.family)
        test = {str(sc.level): sc.accuracy for sc in evaluate(pair, levels, n, lineage_seed=0, split="test")}
        # where `rsi run` would stop after this generation (the lineage's own rule: target mastered, or a plateau)
        done = done_reason(config, mastered_up_to(run.ledger, run.scores, run.base.levels, config.curriculum),
                           run.ledger.rejections_in_a_row()) if number else None
        return {"test": test, "executed": executed(run, number) if number else {}, "done": done}


def executed(run, number: int) -> dict[str, Any]:
    """What generation ``number`` executed at the curriculum's levels: the mean level of those tasks (accepted
    proposals, or the generator's; replay of mastered levels aside), and a proposing arm's verdicts."""
    from rsi.store.records import load_tasks

    found = run.ledger.result(run.ledger.generation(number), "discover")
    proposed = found.proposed if found else None
    with run.store.session() as s:
        levels = [t.level for t in load_tasks(s, list(found.task_ids))
                  if proposed or t.level in found.frontier_levels] if found and found.task_ids else []
    out: dict[str, Any] = {"tasks": len(levels), "mean_level": sum(levels) / len(levels) if levels else None}
    if proposed:
        out |= {"proposals": len(proposed.proposals), "accepted": len(proposed.task_ids),
                "rejected_by_rule": proposed.rejected_by_rule}
    return out


def run_cell(arm: str, seed: int, budget: float, levels: list[int], n: int) -> dict[str, Any]:
    """In this process (its own RSI_HOME): generations of the arm's lineage while its loop CPU-seconds (the
    process tree's, scoring excluded) are below the budget and the lineage would go on (`rsi run`'s stop rules:
    the target mastered, a plateau of rejections); the champion scored after each."""
    from rsi.flows.cycle import run_lineage

    config = arm_config(arm, seed)
    started = tree_cpu_s()
    generations = [{"generation": 0, "loop_cpu_s": 0.0, **scored(config, 0, levels, n)}]
    scoring, loop, stopped = tree_cpu_s() - started, 0.0, None
    while loop < budget and stopped is None:
        (summary,) = run_lineage(config, 1)
        loop = tree_cpu_s() - scoring
        started = tree_cpu_s()
        record = {"generation": summary.generation, "gate": summary.gate, "stopped": summary.stopped,
                  "loop_cpu_s": round(loop, 1), **scored(config, summary.generation, levels, n)}
        scoring += tree_cpu_s() - started
        stopped = summary.stopped or record["done"]  # one generation a call: the lineage's own stop rule, here
        generations.append(record)
        print(f"[{arm} s{seed}] generation {summary.generation}: {summary.gate or stopped}, loop {loop:.0f} CPU-s, "
              f"test mean {sum(record['test'].values()) / len(levels):.3f}", flush=True)
    return {"arm": arm, "seed": seed, "budget_cpu_s": budget, "generations": generations,
            "scoring_cpu_s": round(scoring, 1),
            "config_diff": config_diff(arm_config("self", seed).model_dump(mode="json"),
                                       config.model_dump(mode="json"))}


def at_budget(cell: dict[str, Any]) -> float:
    """The test mean over levels of the last champion whose generation ended within the budget (else the base):
    a generation that ran past it does not count."""
    last = [g for g in cell["generations"] if g["loop_cpu_s"] <= cell["budget_cpu_s"]][-1]
    return sum(last["test"].values()) / len(last["test"])


def summarize(cells: list[dict[str, Any]]) -> dict[str, Any]:
    arms = [a for a in ARMS if any(c["arm"] == a for c in cells)]
    of = {a: sorted((c for c in cells if c["arm"] == a), key=lambda c: c["seed"]) for a in arms}
    final = {a: t_interval([at_budget(c) for c in of[a]]) for a in arms}
    base = t_interval([sum(c["generations"][0]["test"].values()) / len(c["generations"][0]["test"]) for c in cells])
    growth = {a: t_interval([_growth(c) for c in of[a] if _growth(c) is not None] or [0.0]) for a in arms}
    rejected: dict[str, dict[str, int]] = {}
    for c in cells:
        for g in c["generations"]:
            for rule, count in g.get("executed", {}).get("rejected_by_rule", {}).items():
                rejected.setdefault(c["arm"], {}).setdefault(rule, 0)
                rejected[c["arm"]][rule] += count
    by_seed = {a: {c["seed"]: c for c in of[a]} for a in arms}
    differences = {f"self - {other}": t_interval([at_budget(c) - at_budget(by_seed[other][seed])
                                                  for seed, c in by_seed["self"].items() if seed in by_seed[other]])
                   for other in arms if other != "self" and "self" in of}
    differences["self - base"] = t_interval([at_budget(c) - sum(c["generations"][0]["test"].values()) /
                                             len(c["generations"][0]["test"]) for c in of.get("self", [])] or [0.0])
    return {"arms": arms, "at_budget": final, "base": base, "executed_level_growth": growth,
            "rejected_by_rule": rejected, "differences": differences}


def _growth(cell: dict[str, Any]) -> float | None:
    """Mean executed level of the last generation minus the first's."""
    levels = [g["executed"]["mean_level"] for g in cell["generations"][1:] if g["executed"]["mean_level"] is not None]
    return levels[-1] - levels[0] if len(levels) > 1 else None


def fmt(iv: dict[str, Any]) -> str:
    return f"{iv['mean']:.3f}" if iv["low"] is None else f"{iv['mean']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}]"


def print_table(summary: dict[str, Any], cells: list[dict[str, Any]]) -> None:
    print(f"\nfixed test suite, mean over levels at the CPU budget [95 % t-interval over lineage seeds]; base "
          f"{fmt(summary['base'])}")
    print(f"{'arm':>10} {'at budget':>26} {'executed level growth':>26}  rejected by rule")
    for a in summary["arms"]:
        print(f"{a:>10} {fmt(summary['at_budget'][a]):>26} {fmt(summary['executed_level_growth'][a]):>26}  "
              f"{summary['rejected_by_rule'].get(a, {})}")
    for name, iv in summary["differences"].items():
        print(f"{name:>20}: {fmt(iv)}")
    print("\nper generation: arm seed generation loop-CPU-s test-mean executed-mean-level")
    for c in cells:
        for g in c["generations"]:
            level = g.get("executed", {}).get("mean_level")
            print(f"  {c['arm']:>9} {c['seed']} {g['generation']:>3} {g['loop_cpu_s']:>8.0f} "
                  f"{sum(g['test'].values()) / len(g['test']):.3f} {'' if level is None else f'{level:.2f}'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2", help="lineage seeds, comma-separated")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--budget-cpu-s", type=float, default=1500.0, help="each (arm, seed)'s loop CPU-seconds")
    parser.add_argument("--eval-n", type=int, default=64, help="test tasks per level of the fixed suite")
    parser.add_argument("--max-level", type=int, default=12, help="the suite's top level")
    parser.add_argument("--jobs", type=int, default=1, help="cells at once, each with CPUs // jobs torch threads")
    parser.add_argument("--out", default=str(REPO / "bench/results/selfplay.json"))
    parser.add_argument("--resume", action="store_true", help="keep the cells finished on this commit")
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # the child's side: "arm,seed"
    args = parser.parse_args()
    levels = list(range(1, args.max_level + 1))
    if args.cell:
        arm, seed = args.cell.split(",")
        report(run_cell(arm, int(seed), args.budget_cpu_s, levels, args.eval_n))
        return
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        raise SystemExit(f"--seeds takes comma-separated integers (got {args.seeds!r})") from None
    arms = [a for a in args.arms.split(",") if a]
    if not set(arms) <= set(ARMS) or "self" not in arms:
        raise SystemExit(f"--arms: a subset of {', '.join(ARMS)} that includes self (got {args.arms!r})")
    out, config = Path(args.out), run_config(args)
    partial = out.with_suffix(".partial.json")
    cells: list[dict[str, Any]] = []
    if args.resume and partial.exists():
        done = json.loads(partial.read_text())
        changed = changed_since(done["provenance"]["commit"] or "", "bench/selfplay.py", serving=False)
        if changed or changed is None or done["budget_cpu_s"] != args.budget_cpu_s:
            raise SystemExit(f"{partial}: measured code changed since ({changed}) or another budget: delete it")
        cells = [c for c in done["cells"] if c["arm"] in arms and c["seed"] in seeds]
    from rsi.basemodel import BaseRecipe, ensure_base
    from rsi.config import Settings

    started = tree_cpu_s()
    base = ensure_base(Settings(home=REPO / ".rsi"), BaseRecipe(**arm_config("self", 0).base_recipe))
    base_cpu_s = round(tree_cpu_s() - started, 1)  # 0 where the base was cached already
    root = Path(tempfile.mkdtemp(prefix="rsi-bench-selfplay-"))
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    pending = [(a, s) for s in seeds for a in arms if not any((c["arm"], c["seed"]) == (a, s) for c in cells)]

    def run_child(arm: str, seed: int) -> dict[str, Any]:
        cmd = [sys.executable, __file__, "--cell", f"{arm},{seed}", "--budget-cpu-s", str(args.budget_cpu_s),
               "--eval-n", str(args.eval_n), "--max-level", str(args.max_level)]
        return child_cell(cmd, base, root / f"{arm}-s{seed}", root / "prefect", threads, f"cell {arm} seed {seed}",
                          partial)

    try:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for done_cell in as_completed([pool.submit(run_child, a, s) for a, s in pending]):
                cells.append(done_cell.result())
                cells.sort(key=lambda c: (ARMS.index(c["arm"]), c["seed"]))
                write_result(partial, {"budget_cpu_s": args.budget_cpu_s, "cells": cells}, config)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = summarize(cells)
    print_table(summary, cells)
    write_result(out, {"command": "python bench/selfplay.py " + " ".join(sys.argv[1:]), "profile": PROFILE,
                       "arms": arms, "seeds": seeds, "budget_cpu_s": args.budget_cpu_s, "levels": levels,
                       "eval_n": args.eval_n, "base_cpu_s": base_cpu_s, "torch_threads_per_cell": threads,
                       "interval": "95 % t-interval over lineage seeds (one base)", "cells": cells,
                       "summary": summary}, config)
    partial.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
