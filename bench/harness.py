"""Does the harness stage pay? The demo lineage with the candidate-harness stage on, and with its harness frozen.

Both arms run the demo profile from the same cached base with the same seeds, each in its own process and
RSI_HOME, one generation at a time (``run_lineage(config, 1)`` continues the lineage). ``search`` is the
profile as it is (every 3 generations the cycle tries candidate harnesses: addition/v2 with the digit_chunks
plan); ``frozen`` sets ``harness_search.enabled = false``. The search arm runs until every level up to the
profile's target is mastered or ``--generations`` are done; the frozen arm then gets the same CPU budget (it
stops at the first generation boundary at or past the search arm's CPU-seconds, or at ``--generations``).

Per arm: levels mastered (held-out greedy >= the curriculum's mastery, every level up to it, as the lineage
decides), process CPU-seconds (user + system, all threads), CPU-seconds per level gained over the base's
mastered levels, and each generation's line. Prints a table and writes JSON.

    .venv/bin/python bench/harness.py [--generations 12] [--out bench/results/harness.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.provenance import run_config, write_result  # noqa: E402 (after the path it needs)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def arm(name: str, home: Path, generations: int, budget: float | None) -> dict:
    """In this process: the demo lineage, one generation at a time, under ``home``."""
    os.environ["RSI_HOME"] = str(home)
    from flows.cycle import mastered_up_to, rejections_in_a_row, run_lineage
    from rsi.config import get_settings
    from rsi.cycle import LineageRun, load_config

    overrides = {"harness_search": {"enabled": False}} if name == "frozen" else {}
    config = load_config("demo", **overrides)
    lines: list[dict] = []
    run = LineageRun(config, get_settings())
    run.base_dir  # noqa: B018 - the base comes from the cache: not part of either arm's budget
    base_mastered = mastered_up_to(run)
    run.close()
    start = cpu_seconds()
    for _ in range(generations):
        summaries = run_lineage(config, 1)
        used = cpu_seconds() - start
        run = LineageRun(config, get_settings())
        promoted = any(g.status == "promoted" for g in run.finished_generations())
        mastered, plateau = mastered_up_to(run), rejections_in_a_row(run) >= config.plateau
        harness = run.champion_before(10**6).harness_id if promoted else run.harness.id
        run.close()
        summary = summaries[-1] if summaries else {}
        lines.append({"generation": summary.get("generation"), "gate": summary.get("gate"),
                      "stopped": summary.get("stopped"), "harness": harness, "mastered": mastered,
                      "cpu_s": round(used, 1)})
        print(f"[{name}] {lines[-1]}", file=sys.stderr, flush=True)
        if not summaries or summary.get("stopped") or plateau or mastered >= config.target_level:
            break
        if budget is not None and used >= budget:
            break
    mastered = lines[-1]["mastered"] if lines else base_mastered
    used = lines[-1]["cpu_s"] if lines else 0.0
    gained = mastered - base_mastered
    return {"arm": name, "generations": len([ln for ln in lines if ln["generation"]]), "base_mastered": base_mastered,
            "mastered": mastered, "cpu_s": used, "cpu_s_per_level": round(used / gained, 1) if gained > 0 else None,
            "final_harness": lines[-1]["harness"] if lines else None, "lines": lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generations", type=int, default=12, help="at most this many generations per arm")
    parser.add_argument("--out", default=str(REPO / "bench/results/harness.json"))
    parser.add_argument("--arm", choices=["search", "frozen"], help=argparse.SUPPRESS)  # the child's side
    parser.add_argument("--home", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(arm(args.arm, Path(args.home), args.generations, args.budget)))
        return

    from rsi.basemodel import BaseRecipe, base_dir_for, ensure_base
    from rsi.config import get_settings
    from rsi.cycle import load_config

    settings = get_settings()
    recipe = BaseRecipe(**load_config("demo").base_recipe)
    base = ensure_base(settings, recipe)  # built once in the usual RSI_HOME, then copied into each arm's
    root = Path(tempfile.mkdtemp(prefix="rsi-bench-harness-"))
    results = {}
    budget = None
    for name in ("search", "frozen"):
        home = root / name
        (home / "models").mkdir(parents=True)
        shutil.copytree(base, home / "models" / base_dir_for(settings, recipe).name)
        cmd = [sys.executable, __file__, "--arm", name, "--home", str(home), "--generations", str(args.generations)]
        if budget is not None:
            cmd += ["--budget", str(budget)]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        budget = results["search"]["cpu_s"]
    shutil.rmtree(root, ignore_errors=True)

    s, f = results["search"], results["frozen"]
    print(f"{'arm':8} {'generations':>11} {'mastered':>8} {'CPU-s':>8} {'CPU-s/level':>11}  final harness")
    for r in (s, f):
        print(f"{r['arm']:8} {r['generations']:>11} {r['mastered']:>8} {r['cpu_s']:>8.0f} "
              f"{r['cpu_s_per_level'] if r['cpu_s_per_level'] is not None else '-':>11}  {r['final_harness']}")
    ratio = (s["cpu_s_per_level"] / f["cpu_s_per_level"]) if s["cpu_s_per_level"] and f["cpu_s_per_level"] else None
    verdict = {"more_levels": s["mastered"] > f["mastered"], "cpu_per_level_ratio": round(ratio, 3) if ratio else None}
    print(f"search masters {s['mastered'] - f['mastered']:+d} levels on the same CPU budget; CPU-s per level "
          f"search/frozen = {verdict['cpu_per_level_ratio']}")
    out = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, "arms": results,
           "verdict": verdict, "command": "python bench/harness.py " + " ".join(sys.argv[1:])}
    write_result(args.out, out, run_config(args))


if __name__ == "__main__":
    main()
