"""Wall time per stage of one generation, and the orchestration overhead of Prefect.

Runs generation 1 of the same lineage from the same cached base, each time in a fresh RSI_HOME: as the
``rsi-cycle`` Prefect flow, and calling the same stage functions directly, alternating the two arms
``--repeat`` times and keeping each stage's fastest time (so a burst of load elsewhere hits neither arm
alone). Prints a table and writes JSON.

    .venv/bin/python bench/cycle.py [--profile tiny|demo] [--repeat 2] [--out bench/results/cycle.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.provenance import run_config, write_result  # noqa: E402 (after the path it needs)


def arm(name: str, profile: str, base: Path, root: Path) -> dict:
    """One generation in a fresh RSI_HOME; returns per-stage seconds and the total."""
    home = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
    (home / "models").mkdir(parents=True)
    shutil.copytree(base, home / "models" / base.name)
    os.environ["RSI_HOME"] = str(home)
    from rsi.flows.cycle import generation, rsi_cycle
    from rsi.config import get_settings
    from rsi.run import Run, RunContext, load_config
    from rsi.store.leases import acquire_lease

    run = Run(RunContext.of(load_config(profile), get_settings()))
    run.fence.holder, run.fence.token = acquire_lease(run.store, run.config.lineage)
    run.base.backend  # load the model outside the timed region: both arms pay it once
    start = time.perf_counter()
    # the flow arm builds its own run from the context (as a deployment would), the direct one reuses this one
    summary = generation(run, 1, direct=True) if name == "direct" else rsi_cycle(run.context.leased(run.fence), 1)
    total = time.perf_counter() - start
    run.close()
    return {"stages": summary.seconds, "total": total, "gate": summary.gate}


def best(runs: list[dict]) -> dict:
    """Each stage's fastest time over the runs, and their sum as the total."""
    stages = {stage: min(r["stages"][stage] for r in runs) for stage in runs[0]["stages"]}
    return {"stages": stages, "total": sum(stages.values()), "gate": runs[0]["gate"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="tiny", help="cycle profile (tiny: seconds; demo: about a minute)")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each arm, alternating")
    parser.add_argument("--out", default=str(REPO / "bench/results/cycle.json"))
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="rsi-bench-cycle-"))
    os.environ["PREFECT_HOME"] = str(root / "prefect")
    from rsi.basemodel import BaseRecipe, ensure_base
    from rsi.config import Settings
    from rsi.run import load_config

    config = load_config(args.profile)
    base = ensure_base(Settings(home=REPO / ".rsi"), BaseRecipe(**config.base_recipe))
    runs: dict[str, list[dict]] = {"flow": [], "direct": []}
    flow_started = time.perf_counter()
    runs["flow"].append(arm("flow", args.profile, base, root))
    flow_wall = time.perf_counter() - flow_started  # includes starting Prefect's ephemeral API once
    runs["direct"].append(arm("direct", args.profile, base, root))
    for _ in range(args.repeat - 1):
        for name in ("flow", "direct"):
            runs[name].append(arm(name, args.profile, base, root))
    flow, direct = best(runs["flow"]), best(runs["direct"])

    print(f"{'stage':<10} {'flow s':>9} {'direct s':>9} {'ratio':>7}")
    for stage, seconds in direct["stages"].items():
        f = flow["stages"].get(stage, float("nan"))
        print(f"{stage:<10} {f:>9.2f} {seconds:>9.2f} {f / seconds if seconds else float('nan'):>7.2f}")
    ratio = flow["total"] / direct["total"]
    print(f"{'total':<10} {flow['total']:>9.2f} {direct['total']:>9.2f} {ratio:>7.2f}")
    print(f"orchestration overhead: flow / direct = {ratio:.3f} "
          f"(+{flow['total'] - direct['total']:.2f} s; Prefect API start-up outside the flow: "
          f"{flow_wall - runs['flow'][0]['total']:.1f} s)")
    result = {"profile": args.profile, "repeat": args.repeat, "flow": flow, "direct": direct, "runs": runs,
              "overhead_ratio": ratio,
              "flow_wall_with_startup": flow_wall, "cpus": os.cpu_count(), "python": platform.python_version()}
    write_result(args.out, result, run_config(args, cycle_config=config.model_dump(mode="json")))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
