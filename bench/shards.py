"""Shard speedup: one generation's execute + audit + evaluation, runner local vs ray at 1..N shards.

The workload is generation 1 of a fresh lineage (tiny or demo profile, from the cached base): the rollouts of
its discovered tasks under the base, the audit of every trajectory, and one held-out evaluation of the base on
the levels the gate compares. The state DB is not written; each runner's outputs are checked equal to the
local runner's (trajectory ids and texts, verdicts, scores). Ray is started once, outside the timed region
(its start-up is reported), and every worker loads the model in an untimed warm-up pass; the arms then
alternate ``--repeat`` times and each stage keeps its fastest time. Prints a markdown table, writes JSON.

    .venv/bin/python bench/shards.py [--profile tiny|demo] [--max-shards N] [--repeat 2] [--out bench/results/shards.json]
"""

from __future__ import annotations

import argparse
import logging
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
STAGES = ("execute", "audit", "evaluate")


def workload(run):
    """Generation 1's tasks (discovered as the cycle does), rollout params, and the gate's levels."""
    from rsi.flows.cycle import discover
    from rsi.pair import sampling_params
    from rsi.splits import stream_seed
    from rsi.store.records import load_tasks

    champ = run.champion(1)
    found = discover.fn(run, 1, champ)
    with run.store.session() as s:
        tasks = load_tasks(s, found.task_ids)
    harness = run.harnesses.start
    params = sampling_params(harness, seed=stream_seed("rollout", run.config.seed, 1))
    reached = [*found.accuracy, *found.frontier_levels]
    levels = list(range(1, min(max(reached) + 1, run.harnesses.max_level(harness)) + 1))
    return champ, tasks, params, levels


def one_pass(runner, run, champ, tasks, params, levels) -> tuple[dict[str, float], dict]:
    """Seconds per stage and the outputs (to compare runners)."""
    seconds, started = {}, time.perf_counter()
    trajectories, _ = runner.rollout(run.harnesses.start, tasks, champ.pair_id, params)
    seconds["execute"] = time.perf_counter() - started
    started = time.perf_counter()
    verdicts = runner.audit(run.harnesses.start, trajectories, {t.id: t for t in tasks},
                            run.ledger.load_pair(champ.pair_id))
    seconds["audit"] = time.perf_counter() - started
    started = time.perf_counter()
    scores = runner.evaluate(run.harnesses.start, champ.pair_id, levels, run.config.eval_n, lineage_seed=run.config.seed,
                             adapter=None, split="heldout")
    seconds["evaluate"] = time.perf_counter() - started
    outputs = {"trajectories": [(t.id, t.completion) for t in trajectories],
               "verdicts": [v.model_dump(mode="json") for v in verdicts],
               "scores": [s.model_dump(mode="json") for s in scores]}
    return seconds, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="tiny", help="cycle profile (tiny: seconds; demo: minutes)")
    parser.add_argument("--max-shards", type=int, default=os.cpu_count(), help="ray arms: 1..N shards")
    parser.add_argument("--repeat", type=int, default=2, help="passes of each arm, alternating")
    parser.add_argument("--out", default=str(REPO / "bench/results/shards.json"))
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="rsi-bench-shards-"))
    os.environ["PREFECT_HOME"] = str(root / "prefect")
    import ray

    from bench.train import open_run
    from rsi.run import holding_lease
    from rsi.runners import LocalRunner, RayRunner

    run = open_run(args.profile, root)
    config = run.config
    with holding_lease(run.fence):  # taken, renewed while the passes run, released
        champ, tasks, params, levels = workload(run)

        started = time.perf_counter()
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
        ray_start = time.perf_counter() - started
        arms = {"local": LocalRunner(run)} | {f"ray-{n}": RayRunner(run, n) for n in range(1, args.max_shards + 1)}
        started = time.perf_counter()
        one_pass(arms[f"ray-{args.max_shards}"], run, champ, tasks, params, levels)  # every worker loads the model
        warm_up = time.perf_counter() - started
        one_pass(arms["local"], run, champ, tasks, params, levels)

        best: dict[str, dict[str, float]] = {}
        reference, identical = None, {}
        for _ in range(args.repeat):
            for name, runner in arms.items():
                seconds, outputs = one_pass(runner, run, champ, tasks, params, levels)
                best[name] = {s: min(seconds[s], best.get(name, {}).get(s, float("inf"))) for s in STAGES}
                reference = reference or outputs
                identical[name] = identical.get(name, True) and outputs == reference
        ray.shutdown()
    run.close()

    local_total = sum(best["local"].values())
    rows = []
    print(f"| arm | {' | '.join(f'{s} s' for s in STAGES)} | total s | ray / local | outputs = local |")
    print(f"|---|{'---|' * len(STAGES)}---|---|---|")
    for name, seconds in best.items():
        total = sum(seconds.values())
        rows.append({"arm": name, **seconds, "total": total, "ratio": total / local_total,
                     "identical": identical[name]})
        print(f"| {name} | {' | '.join(f'{seconds[s]:.2f}' for s in STAGES)} | {total:.2f} | "
              f"{total / local_total:.2f} | {'yes' if identical[name] else 'NO'} |")
    print(f"workload: {len(tasks)} tasks x {params.n} samples, evaluation {len(levels)} levels x {config.eval_n}; "
          f"Ray start {ray_start:.1f} s, worker warm-up {warm_up:.1f} s (not in the table)")
    result = {"profile": args.profile, "repeat": args.repeat, "rows": rows, "ray_start_s": ray_start,
              "warm_up_s": warm_up, "tasks": len(tasks), "samples": params.n, "eval_levels": levels,
              "eval_n": config.eval_n, "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
              "ray": ray.__version__, "python": platform.python_version()}
    write_result(args.out, result, run_config(args, cycle_config=config.model_dump(mode="json")))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
