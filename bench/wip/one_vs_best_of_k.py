"""One reply a task against the best of k, at equal steps: the cause of the traffic_generation result, isolated.
From a sorting lineage's champion, N train tasks at each frontier level are sampled k times at the harness's
temperature (the execute stage's rollout) and audited. Two training sets share everything but one choice: ``one``
keeps a task's first sample when it passed (what one served reply at that temperature gives), ``best`` its shortest
passed sample (the ordinary selection, ``distinct_passed`` with cap 1); both get the same replay (the first sample of
``--replay`` tasks a level at levels 1 up to the frontier's, where it passed). Each trains ``--steps`` LoRA steps
(the profile's ``train`` spec) warm from the champion's adapter, then is scored greedy on the test split with the
champion. Research script; prints, writes nothing.

    RSI_HOME=/tmp/home .venv/bin/python bench/wip/one_vs_best_of_k.py [--lineage mol-sorting] [--levels 7,8] \
        [--n 256] [--steps 100]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lineage", default="mol-sorting")
    parser.add_argument("--levels", default="7,8", help="the frontier levels")
    parser.add_argument("--n", type=int, default=256, help="train tasks a frontier level")
    parser.add_argument("--replay", type=int, default=64, help="train tasks a level below the frontier")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--test-n", type=int, default=64)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()

    from served_vs_sampled import champion, rollouts, turns
    from traffic_generation import test_accuracy

    from rsi.pair import sampling_params
    from rsi.pair.text import training_parts
    from rsi.run.config import CycleConfig
    from rsi.select import Dataset, Example
    from rsi.train import train_adapter

    parent, base_dir, responder = champion(args.lineage)
    family, harness = responder.family, responder.harness
    spec = CycleConfig.model_validate(parent["spec"]).train.model_copy(update={"steps": args.steps})
    frontier = [int(x) for x in args.levels.split(",")]
    tasks = {lvl: family.tasks("train", args.seed, lvl, args.n if lvl in frontier else args.replay)
             for lvl in range(1, max(frontier) + 1)}
    by_id = {t.id: t for ts in tasks.values() for t in ts}
    samples = {}  # level by level, as the committed run sampled them
    for ts in tasks.values():
        samples |= rollouts(responder, ts, sampling_params(harness, seed=args.seed))
    responder.backend.close()

    def example(t, source: str) -> Example:
        prompt, completion, parts = training_parts(t.messages)
        return Example(trajectory_id=t.id, level=by_id[t.task_id].level, prompt=prompt, completion=completion,
                       source=source, turns=parts)

    replay, arms = [], {"one": [], "best": []}
    for task_id, got in samples.items():
        level, first_ok, first = by_id[task_id].level, got[0][0], got[0][1]
        if level not in frontier:
            if first_ok:
                replay.append(example(first, "replay"))
            continue
        if first_ok:
            arms["one"].append(example(first, "frontier"))
        passed = [t for ok, t in got if ok]
        if passed:
            shortest = min(passed, key=lambda t: (turns(t), t.id))
            arms["best"].append(example(shortest, "frontier"))
    accuracy = {"champion": test_accuracy(harness, base_dir, parent["adapter"], args.test_n)}
    with tempfile.TemporaryDirectory() as tmp:
        for arm, frontier_examples in arms.items():
            out = Path(tmp) / arm
            train_adapter(base_dir, Path(parent["adapter"]), Dataset(examples=tuple(frontier_examples + replay)), spec,
                          out, seed=args.seed)
            accuracy[arm] = test_accuracy(harness, base_dir, str(out), args.test_n)
    print(f"{args.lineage} generation {parent['generation']}: frontier {frontier}, {args.n} tasks a level, "
          f"k {harness.document.decoding.samples}; replay {len(replay)}; {args.steps} steps")
    print(f"frontier examples: one {len(arms['one'])}, best {len(arms['best'])}")
    print("| level | champion | one reply a task | best of k |")
    print("|---|---|---|---|")
    for lvl in accuracy["champion"]:
        print(f"| {lvl} | {accuracy['champion'][lvl]:.3f} | {accuracy['one'][lvl]:.3f} | {accuracy['best'][lvl]:.3f} |")


if __name__ == "__main__":
    main()
