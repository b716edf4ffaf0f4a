"""What does the programs base learn from runs written out, and from runs written at more lengths?

The ``programs`` lineage can learn a level only where its champion is right sometimes (``selection.band``): a
base that is right on levels 1-2 and on nothing above gives the loop nothing to learn from. This script builds the
programs base three ways, each from the profile's recipe with one thing changed, and scores each on the test split,
greedy, ``--n`` tasks a level, levels 1..``--max-level`` (the selfplay bench's suite):

- ``v1``: the profile's base (harness ``programs/v1``: the output at once);
- ``v2``: harness ``programs/v2`` (the run worked out state by state, ``programs.worked``), context 1,024;
- ``v2-rewrites``: as ``v2``, each demonstration rewritten longer by ``BaseRecipe.rewrites`` no-op pairs
  (``programs.pad``: k drawn from 0..rewrites; the same programs, levels and answers).

It records each build's CPU-seconds (this process: training and its measurement) beside the accuracy.

    .venv/bin/python bench/programs_base.py [--arms v1,v2,v2-rewrites] [--rewrites 3] [--n 64] [--max-level 12]
        [--out bench/results/programs-base.json]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.provenance import run_config, write_result  # noqa: E402 (after the path it needs)

V2 = {"harness": "programs/v2", "max_position_embeddings": 1024}


def recipe(arm: str, rewrites: int):
    from rsi.basemodel import BaseRecipe
    from rsi.run import load_config

    mine = dict(load_config("programs").base_recipe)
    if arm != "v1":
        mine |= V2 | ({"rewrites": rewrites} if arm == "v2-rewrites" else {})
    return BaseRecipe(**mine)


def cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def measure(arm: str, rewrites: int, levels: list[int], n: int, out: Path) -> dict:
    from rsi.backends.hf import HFBackend
    from rsi.basemodel import train_base
    from rsi.evaluate import evaluate
    from rsi.hcp import load_harness
    from rsi.pair import Responder
    from rsi.tasks import get_family

    r = recipe(arm, rewrites)
    start = cpu_s()
    train_base(r, out)
    built = cpu_s() - start
    backend = HFBackend(out)
    try:
        pair = Responder(load_harness(r.harness), backend, f"pair-{arm}", family=get_family(r.family))
        scores = evaluate(pair, levels, n, split="test")
    finally:
        backend.close()
    test = {s.level: s.accuracy for s in scores}
    row = {"arm": arm, "harness": r.harness, "rewrites": r.rewrites, "digest": r.digest(),
           "build_cpu_s": round(built, 1), "test": test, "mean": sum(test.values()) / len(test)}
    print(f"{arm:12} build {built:7.0f} CPU-s  mean {row['mean']:.3f}  " +
          " ".join(f"L{lv} {acc:.2f}" for lv, acc in test.items()), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", default="v1,v2,v2-rewrites")
    ap.add_argument("--rewrites", type=int, default=3)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--max-level", type=int, default=12)
    ap.add_argument("--out", default=str(REPO / "bench/results/programs-base.json"))
    args = ap.parse_args()
    levels = list(range(1, args.max_level + 1))
    rows = []
    with tempfile.TemporaryDirectory(prefix="rsi-programs-base-") as tmp:
        for arm in args.arms.split(","):
            rows.append(measure(arm, args.rewrites, levels, args.n, Path(tmp) / arm))
    write_result(args.out, {"command": "python bench/programs_base.py " + " ".join(sys.argv[1:]), "split": "test",
                            "levels": levels, "n": args.n, "arms": rows}, run_config(args))


if __name__ == "__main__":
    main()
