"""What a served turn can teach, against what an ordinary generation's rollouts can: for a sorting lineage's
champion, per level, on N train-split tasks, one reply at temperature 1 (a person asking at OpenAI's default) and
the harness's k samples (what the execute stage rolls out, ``decoding.samples``), each audited as the cycle audits.
A task teaches most where the champion is right sometimes, not always: where its greedy reply is wrong, or where
only some of its k samples pass. Also the extra turns of the right episodes over the fewest any right episode of
that level took (the selection keeps a task's shortest passed episode; a served turn has one). Research script;
prints, writes nothing.

    RSI_HOME=/tmp/home .venv/bin/python bench/wip/served_vs_sampled.py [--lineage mol-sorting] [--levels 7,8] \
        [--n 96]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lineage", default="mol-sorting")
    parser.add_argument("--levels", default="7,8")
    parser.add_argument("--n", type=int, default=96, help="train-split tasks a level")
    parser.add_argument("--seed", type=int, default=123)
    args = parser.parse_args()

    from traffic_generation import parent_of

    from rsi.audit import audit
    from rsi.backends import get_backend
    from rsi.pair import Responder, sampling_params
    from rsi.store import open_store
    from rsi.tasks import get_family

    store = open_store()
    parent, family = parent_of(store, args.lineage), get_family("sorting")
    harness = parent["harness"]
    from rsi.config import get_settings
    base_dir = next(p for p in sorted((get_settings().home / "models").glob("base-*")) if p.is_dir())
    backend = get_backend("hf", model_dir=base_dir)
    responder = Responder(harness, backend, "wip", parent["adapter"], family)
    k = harness.document.decoding.samples
    print(f"{args.lineage} generation {parent['generation']} ({harness.id}), {args.n} train tasks a level, k {k}")
    print("| level | greedy right | one T=1 reply right | of those, greedy right too | any of k right | "
          "all k right | some of k right | extra turns, one reply | extra turns, shortest of k |")
    print("|---|---|---|---|---|---|---|---|---|")
    for level in (int(x) for x in args.levels.split(",")):
        tasks = family.tasks("train", args.seed, level, args.n)
        by_id = {t.id: t for t in tasks}
        runs = {}
        for name, params in (("greedy", sampling_params(harness, seed=1, greedy=True)),
                             ("sampled", sampling_params(harness, seed=1))):
            runs[name] = {}
            for t in responder.episodes(tasks, params):
                turns = sum(m.role == "assistant" for m in t.messages)
                runs[name].setdefault(t.task_id, []).append((audit(t, by_id[t.task_id], harness, family).passed,
                                                            turns))
        greedy = {task for task, v in runs["greedy"].items() if v[0][0]}
        one = {task: v[0][1] for task, v in runs["sampled"].items() if v[0][0]}  # the first sample: one reply
        passes = {task: [turns for ok, turns in v if ok] for task, v in runs["sampled"].items()}
        right = {task: p for task, p in passes.items() if p}
        fewest = min([*one.values(), *(t for p in right.values() for t in p)], default=0)
        extra = lambda turns: dict(sorted(Counter(t - fewest for t in turns).items()))  # noqa: E731
        print(f"| {level} | {len(greedy)} | {len(one)} | {len(set(one) & greedy)} | {len(right)} | "
              f"{sum(len(p) == k for p in right.values())} | {sum(0 < len(p) < k for p in right.values())} | "
              f"{extra(one.values())} | {extra(min(p) for p in right.values())} |", flush=True)
    backend.close()


if __name__ == "__main__":
    main()
