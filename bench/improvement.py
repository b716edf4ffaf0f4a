"""Does the gain come from the loop? The lineage beside a control arm with the same training steps.

- lineage: ``rsi-lineage`` for N generations (self-generated, audited data beyond the base's levels);
- control: the same number of LoRA training rounds and steps, warm-started the same way, but on ground-truth
  labels of the base's training levels only (what a person without the loop would train on).
Both end up evaluated greedily on the same held-out tasks. Prints a table and writes JSON.

    .venv/bin/python bench/improvement.py [--generations 8] [--profile demo] [--out bench/results/improvement.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def ground_truth_examples(run, levels: list[int], n: int, seed: int):
    """Examples labelled with the true answer, rendered in the harness's own answer format."""
    from rsi.parsers import digits_lsb
    from rsi.select import Example

    width = run.harness.document.answer.params["width"]
    tasks = [t for lvl in levels for t in run.family.tasks(seed, lvl, n)]
    return [Example(trajectory_id=f"label-{t.id}", level=t.level, prompt=run.harness.prompt(t.payload),
                    completion=digits_lsb(t.answer, width), source="replay") for t in tasks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--profile", default="demo")
    parser.add_argument("--out", default=str(REPO / "bench/results/improvement.json"))
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="rsi-bench-improvement-"))
    os.environ["RSI_HOME"] = str(root / "home")
    os.environ["PREFECT_HOME"] = str(root / "prefect")
    from flows.cycle import run_lineage
    from rsi.basemodel import BaseRecipe, ensure_base
    from rsi.config import Settings, get_settings
    from rsi.cycle import LineageRun, load_config
    from rsi.select import Dataset
    from rsi.splits import stream_seed
    from rsi.train import train_adapter

    config = load_config(args.profile)
    base = ensure_base(Settings(home=REPO / ".rsi"), BaseRecipe(**config.base_recipe))
    shutil.copytree(base, root / "home" / "models" / base.name)

    started = time.perf_counter()
    summaries = run_lineage(config, args.generations, print)
    lineage_s = time.perf_counter() - started
    run = LineageRun(config, get_settings())
    champ = run.champion_before(10**6)
    rounds = sum(1 for s in summaries if "gate" in s)

    started = time.perf_counter()
    adapter = None
    base_levels = list(run.recipe.train_levels)
    for r in range(rounds):
        examples = ground_truth_examples(run, base_levels, 1024, stream_seed("base", config.seed, r))
        out = root / "control" / f"round-{r}"
        train_adapter(run.base_dir, adapter, Dataset(examples=tuple(examples)), config.train, out,
                      seed=config.seed * 1000 + r + 1)
        adapter = out
    control_s = time.perf_counter() - started

    levels = list(range(1, run.max_level + 1))  # every level the harness can pose
    base_scores = run.scores(run.pair(None).id, None, levels)
    lineage_scores = run.scores(champ.pair_id, champ.adapter_dir, levels)
    from rsi.train import adapter_hash

    control_pair = run.pair(adapter_hash(adapter)) if adapter else run.pair(None)
    run.save_pair(control_pair, str(adapter) if adapter else None, None)
    control_scores = run.scores(control_pair.id, str(adapter) if adapter else None, levels)
    run.close()

    print(f"\n{rounds} training rounds x {config.train.steps} steps each arm; lineage {lineage_s:.0f} s, control "
          f"training {control_s:.0f} s")
    print(f"{'level':>5} {'base':>7} {'lineage':>8} {'control':>8}   (greedy accuracy, held-out, n={config.eval_n})")
    rows = []
    for lvl in levels:
        row = {"level": lvl, "base": base_scores[lvl].accuracy, "lineage": lineage_scores[lvl].accuracy,
               "control": control_scores[lvl].accuracy}
        rows.append(row)
        print(f"{lvl:>5} {row['base']:>7.3f} {row['lineage']:>8.3f} {row['control']:>8.3f}")
    beyond = [r for r in rows if r["level"] > max(base_levels)]
    gain = sum(r["lineage"] - r["control"] for r in beyond) / len(beyond)
    print(f"mean gain of the lineage over the control beyond level {max(base_levels)}: {gain:+.3f}")
    result = {"profile": args.profile, "generations": [s.get("gate") for s in summaries], "rounds": rounds,
              "steps_per_round": config.train.steps, "rows": rows, "mean_gain_beyond_base": gain,
              "lineage_seconds": lineage_s, "control_train_seconds": control_s, "cpus": os.cpu_count()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
