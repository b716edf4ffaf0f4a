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


def champion(lineage: str):
    """The lineage's champion (``traffic_generation.parent_of``), its base model's directory (where the proxy's
    registry finds it) and its pair as a ``Responder`` on the hf backend; close ``responder.backend`` after."""
    from traffic_generation import parent_of

    from rsi.backends import get_backend
    from rsi.basemodel import BaseRecipe, base_dir_for
    from rsi.config import get_settings
    from rsi.pair import Responder
    from rsi.store import open_store
    from rsi.tasks import get_family

    parent, settings = parent_of(open_store(), lineage), get_settings()
    harness = parent["harness"]
    base_dir = harness.base_model_dir(settings.home) or base_dir_for(
        settings, BaseRecipe(**parent["spec"].get("base_recipe", {})))
    responder = Responder(harness, get_backend("hf", model_dir=base_dir), "wip", parent["adapter"],
                          get_family(harness.document.family))
    return parent, base_dir, responder


def turns(trajectory) -> int:
    return sum(m.role == "assistant" for m in trajectory.messages)


def rollouts(responder, tasks, params) -> dict[str, list]:
    """Per task id, its episodes under ``params`` as (passed the audit, trajectory), in sample order."""
    from rsi.audit import audit

    by_id, out = {t.id: t for t in tasks}, {}
    for t in responder.episodes(tasks, params):
        out.setdefault(t.task_id, []).append(
            (audit(t, by_id[t.task_id], responder.harness, responder.family).passed, t))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lineage", default="mol-sorting")
    parser.add_argument("--levels", default="7,8")
    parser.add_argument("--n", type=int, default=96, help="train-split tasks a level")
    parser.add_argument("--seed", type=int, default=123)
    args = parser.parse_args()

    from rsi.pair import sampling_params

    parent, _, responder = champion(args.lineage)
    family, harness = responder.family, responder.harness
    k = harness.document.decoding.samples
    print(f"{args.lineage} generation {parent['generation']} ({harness.id}), {args.n} train tasks a level, k {k}")
    print("| level | greedy right | one T=1 reply right | of those, greedy right too | any of k right | "
          "all k right | some of k right | extra turns, one reply | extra turns, shortest of k |")
    print("|---|---|---|---|---|---|---|---|---|")
    for level in (int(x) for x in args.levels.split(",")):
        tasks = family.tasks("train", args.seed, level, args.n)
        runs = {name: {task: [(ok, turns(t)) for ok, t in got]
                       for task, got in rollouts(responder, tasks, params).items()}
                for name, params in (("greedy", sampling_params(harness, seed=1, greedy=True)),
                                     ("sampled", sampling_params(harness, seed=1)))}
        greedy = {task for task, v in runs["greedy"].items() if v[0][0]}
        one = {task: v[0][1] for task, v in runs["sampled"].items() if v[0][0]}  # the first sample: one reply
        passes = {task: [n for ok, n in v if ok] for task, v in runs["sampled"].items()}
        right = {task: p for task, p in passes.items() if p}
        fewest = min([*one.values(), *(t for p in right.values() for t in p)], default=0)
        extra = lambda counts: dict(sorted(Counter(n - fewest for n in counts).items()))  # noqa: E731
        print(f"| {level} | {len(greedy)} | {len(one)} | {len(set(one) & greedy)} | {len(right)} | "
              f"{sum(len(p) == k for p in right.values())} | {sum(0 < len(p) < k for p in right.values())} | "
              f"{extra(one.values())} | {extra(min(p) for p in right.values())} |", flush=True)
    responder.backend.close()


if __name__ == "__main__":
    main()
