"""Research: of the samples ``programs/v2`` passes, how many are the program's run, and how many a wrong run that
ends on the right output by chance? (``programs/v3`` passes only the first kind.)

A built base under ``programs/v2`` (its recipe's harness), ``--samples`` samples a task at temperature 1.0 (the
harness's decoding), ``--n`` train-split tasks a level (the tasks a lineage's generation samples and selects
from); each sample audited under v2 and under v3 (the same prompt and reply; v3 verifies the run state by state).
Prints per level: samples v2 passes, samples v3 passes, and tasks in the learnability band (1 to 6 passes of 8)
under each; writes JSON with ``--out``.

    .venv/bin/python bench/wip/programs_passes.py --base DIR [--levels 1,2,3] [--n 256] [--samples 8] [--out F]

``DIR``: a base built with ``base_recipe.harness=programs/v2`` (``rsi base build --profile programs --set
base_recipe.harness=programs/v2 --set base_recipe.max_position_embeddings=1024`` writes one under
``$RSI_HOME/models``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from bench.provenance import run_config, write_result  # noqa: E402 (after the path it needs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--levels", default="1,2,3")
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not (args.base / "config.json").exists():
        raise SystemExit(f"--base {args.base}: no built base there (config.json missing); build one, see --help")
    from rsi.audit import audit
    from rsi.backends.base import SamplingParams
    from rsi.backends.hf import HFBackend
    from rsi.hcp import load_harness
    from rsi.pair import Responder
    from rsi.tasks import get_family

    family = get_family("programs")
    v2, v3 = load_harness("programs/v2"), load_harness("programs/v3")
    backend = HFBackend(args.base)
    params = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=v2.document.decoding.max_new_tokens,
                            seed=args.seed)
    rows = []
    try:
        for level in (int(x) for x in args.levels.split(",")):
            tasks = family.tasks("train", args.seed, level, args.n)
            by_id = {t.id: t for t in tasks}
            passes = {t.id: [0, 0] for t in tasks}
            for traj in Responder(v2, backend, "probe", family=family).episodes(tasks, params):
                task = by_id[traj.task_id]
                passes[traj.task_id][0] += audit(traj, task, v2, family).passed
                passes[traj.task_id][1] += audit(traj, task, v3, family, recorded=v2).passed
            band = [sum(0 < p[k] <= 6 * args.samples // 8 for p in passes.values()) for k in (0, 1)]
            rows.append({"level": level, "tasks": len(tasks), "samples": len(tasks) * args.samples,
                         "v2_passed": sum(p[0] for p in passes.values()),
                         "v3_passed": sum(p[1] for p in passes.values()),
                         "v2_band_tasks": band[0], "v3_band_tasks": band[1]})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        backend.close()
    if args.out:
        write_result(args.out, {"base": str(args.base), "levels": rows}, run_config(args))


if __name__ == "__main__":
    main()
