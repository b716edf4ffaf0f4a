"""Does a change of code change the built-in base's weights? Three small bases built on two versions of rsi.

Each side builds, from the same recipes with one torch thread: addition's text (the tiny profile's recipe),
sorting's expert episodes (40 steps) and a joint base of both (40 + 30 steps), then records each base's
``model_hash`` (weights, config, tokenizer files) and what its build measured (greedy accuracy per level,
pass@8). Equal rows mean the code that builds a base (``rsi.basemodel`` and a family's ``pretraining``) trains
the same weights. Sides are git refs or the working tree, run as ``bench/same_results.py`` runs them.

    .venv/bin/python bench/base_hashes.py --before REF [--after REF]

Prints each base's hash per side and writes ``bench/results/base-hashes.json``; exits 1 when the sides differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.provenance import REPO, run_config, write_result  # noqa: E402 (after the path it needs)
from bench.same_results import entry_points_of, source  # noqa: E402

BUILD = """
import json, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
from rsi.basemodel import BaseRecipe, FamilyPart, model_hash, train_base
from rsi.run import load_config

out = Path(sys.argv[1])
small = {"steps": 40, "warmup": 4, "batch_size": 16, "d_model": 64, "n_heads": 2, "intermediate_size": 128}
part = FamilyPart(family="sorting", harness="sorting/v1", train_levels=(1, 2), level_weights=(1.0, 1.0),
                  mistakes=0.35, steps=30)
recipes = {
    "addition": BaseRecipe(**load_config("tiny").base_recipe),
    "sorting": BaseRecipe(**{**small, "family": "sorting", "harness": "sorting/v1", "train_levels": (1, 2),
                             "level_weights": (1.0, 1.0), "mistakes": 0.35}),
    "joint": BaseRecipe(**load_config("tiny", base_recipe={**small, "also": [part.model_dump(mode="json")]}).base_recipe),
}
rows = []
for name, recipe in recipes.items():
    train_base(recipe, out / name, eval_n=16)
    meta = json.loads((out / name / "rsi_recipe.json").read_text())
    measured = {k: meta.get(k) for k in ("greedy", "pass_at_8", "also", "final_loss")}
    rows.append([name, model_hash(out / name), json.dumps(measured, sort_keys=True)])
print(json.dumps(rows))
"""


def build_side(code: Path, home: Path) -> list:
    home.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"PYTHONPATH": f"{code}{os.pathsep}{entry_points_of(code, home / 'entry-points')}",
                        "RSI_HOME": str(home / "rsi"), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", BUILD, str(home / "bases")], cwd=code, env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{done.stderr[-3000:]}\nbase_hashes: building the bases on {code} failed")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="git ref of the code before the change")
    parser.add_argument("--after", default=None, help="git ref of the code after it (default: the working tree)")
    parser.add_argument("--out", default=str(REPO / "bench/results/base-hashes.json"))
    args = parser.parse_args()
    sides = {}
    with tempfile.TemporaryDirectory(prefix="rsi-base-hashes-") as tmp:
        for name, ref in (("before", args.before), ("after", args.after)):
            sides[name] = build_side(source(ref, Path(tmp) / name / "src"), Path(tmp) / name / "home")
    print(f"{'base':<10} {'before':<18} {'after':<18} same")
    for (base, before, _), (_, after, _) in zip(sides["before"], sides["after"]):
        print(f"{base:<10} {before[:16]:<18} {after[:16]:<18} {before == after}")
    same = sides["before"] == sides["after"]
    print("identical" if same else "differ")
    write_result(args.out, {"before": args.before, "after": args.after or "working tree", "bases": sides,
                            "identical": same}, run_config(args))
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
